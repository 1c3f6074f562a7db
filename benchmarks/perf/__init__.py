"""Speed of the engine and the serving path on this machine (`python -m benchmarks.perf.<module>`).

- batching: iteration-level batching vs the serialised engine, tokens/s and TTFT at 1/4/16 clients
- compile_batch: compile-stage chunks/s by compile batch size (gpu_compile.sh runs it on a GPU)
- governance: cost governance's overhead on TTFT (quotas, accounting, admission; memory and Redis)
- gpu: paper-scale speed on one GPU, real-size shapes with random weights (a step of gpu.sh)
- gpu.sh: the GPU run in one script (limits, compile_batch, gpu); without CUDA, the same path on tiny models
- gpu_compile.sh: compile_batch on a GPU (a step of gpu.sh)
- ingest: Ray Data compile throughput per model and actor count, KV bytes per chunk
- kv_quant: int8 / fp8 KV entries vs unquantised: bytes, load, TTFT and fidelity
- lazy_tier: `qvpic ingest --lazy-high-tier`: ingest saved vs first-promotion TTFT, convergence to all-hot
- limits: memory bandwidth, product rates, and the engine's forwards against their bounds
- render_throughput: renderer pages/s per DPI and script
- routing: a new query's route (embedding and the rest), a conversation's follow-ups, the search at 10^6 rows
- routing_follow_ups: routing's follow-up part (no entry point of its own)
- runtime: full prefill vs query-only prefill on an assembled cache, re-anchoring cost
- served_stream: one answer streamed through a live server, ms per token and each process's CPU per token
- structured: json_schema, forced tool call and logprobs vs plain decoding, cost per token
- threads: which thread runs the forward (one OpenMP pool per process), each arrangement in a fresh process
- ttft: TTFT of every serving mode, its breakdown, scaling with chunks, KV bytes and the HTTP share
- ttft_http: ttft's online path over HTTP on a loopback Serve app (no entry point of its own)
"""
