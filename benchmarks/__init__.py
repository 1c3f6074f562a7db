"""qvpic's benchmarks, grouped by purpose; each writes its section of docs/BENCHMARKS.md, which opens with the
headline figures and an index of its sections (investigations tried and not kept, and retired spikes, are in
docs/benchmarks/notes.md).

    qvpic bench --list                      # every benchmark by group, and which ones `qvpic bench` (all) runs
    qvpic bench ttft --quick                # one, by its suite name (table: jobs/bench_suites.py)
    python -m benchmarks.perf.ttft --quick  # the same, by module; `--help` shows a benchmark's options

perf/     speed of the engine and the serving path on this machine: TTFT per mode, batching and decode, the
          forwards against the machine's limits, routing, ingest and compile throughput, KV formats, the GPU run
quality/  fidelity to full prefill (single turn, conversations, recompute), exactness at the real models'
          shapes, legibility of rendered pages, the IVF calibration's queries
scale/    large stores (ingest at 10k chunks, routing at 10^6), store checks and shard packing, affinity dispatch
          across replicas, a 3-node cluster's node loss and autoscaling, load through the whole Serve graph
peer/     side by side with vLLM on the same checkpoint, chunks and questions; needs the peer venv
          (`make peer-vllm`)
tools/    what the benchmarks share (the in-process store, the machine line, real-size shapes, realistic
          embeddings), the mutation tool, and the same requests before and after a change

Each group's `__init__` lists its modules.
"""
