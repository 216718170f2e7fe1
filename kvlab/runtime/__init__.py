"""What runs outside this process: child processes with pinned threads (processes), vLLM
engines one per process (engine), managed servers (servers: ``vllm serve``; lmcache:
``lmcache server``), the connectors' kv-transfer configs (configs), the local model folders
(models) and the notebooks run headless (notebooks). Each module imports vLLM, LMCache or
transformers only where it starts them."""
