"""What the benchmarks share, and tools that are not benchmarks.

- machine: the CPU model and the flags that decide which kernels run, printed with every figure
- mutations: the mutation tool, each mutation against the tests meant to catch it (`qvpic bench mutations`)
- real_size: real-size VLM checkpoints (the public architectures) built with random weights on the device
- realistic_vectors: embeddings with a real model's neighbourhood structure, at any count
- same_requests: the same requests before and after a change, in two checkouts: identical answers, TTFT within noise
- ttft_store: the in-process benchmark store, built by the real ingest stages without Ray
"""
