"""The experiments the notebooks tell, one module each. Results go to kvlab.results.

Transfers on this machine:

- sweep: the transfer sweep, timed against the same-run copy ceiling;
- targets: the CPU copy engines' targets, judged from the sweep's rows;
- layerwise_timing: layerwise loading against load-then-compute;
- timing: the clock and argument checks the three above share;
- bench: one import of sweep, targets, layerwise_timing and timing;
- costmodel: the two-term cost model (per segment, per byte) fitted on the sweep;
- device_check: the summary of one ``scripts/device-check`` run.

GPUs, from others' measurements:

- published: the published GPU copy measurements, and kvlab's own CUDA rows in their shape;
- gpu_costmodel: a cost rule per copy mechanism fitted on published rows, checked on the rest.

The connector in vLLM:

- paths: the names of the reuse paths every experiment compares;
- ttft: time to first token with and without connectors;
- registration: per-layer against cross-layer hand-over, as each vLLM release registers it;
- deployed: the connector in vLLM's own processes (``vllm serve``, tensor parallel, sharing);
- hit_costs: where a hit's time goes, lookups against stored chunks, Redis against its pace;
- engine_sharing: engines of two layouts sharing one store, in time to first token;
- tier_reads: where a hit from a file tier (shm, disk) spends its time, part by part;
- scaling: how costs grow with prompt length and concurrent requests;
- load_test: many clients and injected faults through ``vllm serve``.

Tiers beyond one machine:

- network: the cross-layer question on a Redis server;
- lmcache_redis: LMCache's own Redis backend on the same prefix and server;
- mooncake_costs: the cross-layer question on a Mooncake Store;
- peers: vLLM's and LMCache's own connectors on Mooncake Store and a Redis Cluster;
- scale_model: what the measured per-object and per-byte costs predict for many hosts.

Accuracy:

- roundtrip: bitwise KV round trips, offload then load;
- tasks: the offline texts and GSM8K-style tasks;
- engine_checks: generations, perplexity and a task score through the engine, per reuse path;
- lmeval: lm-eval's vLLM backend with and without KVLabConnector;
- architectures: every reference architecture through the engine and the connectors;
- seed_plan: vllm-ascend #2039's request replayed through ``vllm serve``.
"""
