"""The experiments the notebooks tell: transfer timing against the same-run copy ceiling
(bench) and its cost model (costmodel), time to first token with and without connectors
(ttft), per-layer against cross-layer hand-over (registration), KV round trips (roundtrip),
accuracy through the engine (engine_checks, over tasks), and lm-eval (lmeval). Results go
to kvlab.results."""
