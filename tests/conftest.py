import os

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
