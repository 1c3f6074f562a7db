"""Scale: large stores, replicas, clusters and load (`python -m benchmarks.scale.<module>`).

- affinity: chunk-affinity dispatch vs Serve's default across generator replicas, and where the loader runs
- affinity_limit: affinity's workload replayed through the router's policy with exact knowledge (its limit)
- cluster: node loss under load and generator autoscaling on a real 3-node Ray cluster
- load: many requests through the whole Serve graph: latency, throughput, errors, each process's memory
- scale_ingest: ≥10k chunks of real text through `qvpic ingest`: rate against the stage-cost bound, reruns
- scale_serve: router start-up, route latency, memory, recall, hot-reload switch at 10^4..10^6 chunks
- shard_packing: KV entries one per file vs packed 8 and 32 to a file, on local disk and S3
- store_check: the start-up parts check and `qvpic verify` against parts and rows
"""
