"""The vLLM peer of benchmarks/peer_vllm.py: its venv (setup_vllm.sh, requirements-vllm.lock, sitecustomize.py),
the side that runs in it (vllm_side.py, check_vllm.py) and the project-side halves (engine, oracle, speed, servers)."""
