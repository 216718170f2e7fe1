"""The seed's test plan, replayed: its exact request through ``vllm serve`` with
KVLabConnector (cross-layer blocks asked for, vLLM's prefix cache off, eager mode), sent with
the official ``openai`` client as users call a vLLM server (completions and chat), then a
long request twice: the repeat must be served from the connector with the same text."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvlab.runtime.servers import VLLMServer

# vllm-ascend #2039's check of its cross-layer connector: this prompt, 10 tokens, greedy.
SEED_PROMPT = ("Qwen3 is the latest generation of large language models in Qwen series, offering a comprehensive "
               "suite of dense and mixture-of-experts")
SEED_MAX_TOKENS = 10
SEED_EXTRA = {"enable_cross_layers_blocks": True}


@dataclass
class SeedReplay:
    """One ``vllm serve`` of ``model`` with the seed's connector config; ``run`` sends the
    requests and returns one row per request. MLA models need ``block_size=16`` and, for
    fp32 on AMX CPUs, ``attention_backend="CPU_MLA"``."""

    model: str | Path
    long_prompt: str
    dtype: str = "float32"
    block_size: int = 32
    attention_backend: str | None = None
    long_max_tokens: int = 16
    log_path: str | Path | None = None

    def run(self) -> list[dict[str, Any]]:
        from openai import OpenAI

        server = VLLMServer(self.model, extra=SEED_EXTRA, dtype=self.dtype, block_size=self.block_size,
                            attention_backend=self.attention_backend, log_path=self.log_path)
        with server:
            client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=server.request_timeout)
            name = server.served_model_name
            ids = {"return_token_ids": True}  # vLLM's extension: a random miniature's text may be all special tokens
            rows = [_row("seed prompt", "completions", client.completions.create(
                model=name, prompt=SEED_PROMPT, max_tokens=SEED_MAX_TOKENS, temperature=0, extra_body=ids))]
            rows.append(_row("seed prompt", "chat", client.chat.completions.create(
                model=name, messages=[{"role": "user", "content": SEED_PROMPT}], max_tokens=SEED_MAX_TOKENS,
                temperature=0, extra_body=ids)))
            for request in ("long, first", "long, repeat"):  # with each token's logprob: fp32, compared
                rows.append(_row(request, "completions", client.completions.create(
                    model=name, prompt=self.long_prompt, max_tokens=self.long_max_tokens, temperature=0,
                    logprobs=0, extra_body=ids)))
        labels = {"model": Path(server.model_folder).name, "dtype": self.dtype, "layout": server.registered_layout()}
        return [{**labels, **row} for row in rows]


def _row(request: str, api: str, response: Any) -> dict[str, Any]:
    choice = response.choices[0]
    details = response.usage.prompt_tokens_details
    return {"request": request, "api": api,
            "text": choice.message.content if api == "chat" else choice.text,
            "token_ids": list(getattr(choice, "token_ids", None) or []),
            "logprobs": list(choice.logprobs.token_logprobs) if api == "completions" and choice.logprobs else [],
            "prompt_tokens": response.usage.prompt_tokens, "completion_tokens": response.usage.completion_tokens,
            "cached_tokens": (details.cached_tokens or 0) if details else 0}
