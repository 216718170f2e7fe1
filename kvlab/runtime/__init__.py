"""What runs outside this process: child processes with pinned threads (processes), managed
servers (servers: ``vllm serve``; lmcache: ``lmcache server``; redis), the connectors'
kv-transfer configs (configs), the local model folders (models) and the notebooks run
headless (notebooks) or in JupyterLab (lab). Each module imports vLLM, LMCache or
transformers only where it starts them."""
