"""Side by side with vLLM, the engine users would pick instead (`python -m benchmarks.peer.<module>`); needs the
peer venv, .peer-vllm/ (`make peer-vllm`). A script's folder is its sys.path[0]: no module here may be named like
a package (vllm.py, torch.py, ray.py...), since vllm_side.py and check_vllm.py run from this folder.

- side_by_side: TTFT and decode against vLLM; `--oracle`: vLLM as a correctness oracle (peer-vllm, peer-vllm-oracle)
- conversation: 4-turn conversations through both engines' OpenAI servers, TTFT per turn and throughput
- conversation_report: conversation's tables, numbers in, Markdown out
- record_oracle: records vLLM's answers into tests/data/vllm_oracle.json for tests/pipeline/eval/test_vllm_oracle.py
- speed: side_by_side's timings (TTFT per workload, decode, the in-process floor)
- oracle: side_by_side's `--oracle` (greedy agreement of full prefill with vLLM, and its controls)
- servers: both engines' servers up together, and qvpic's in-process figures
- serve_floor: Serve's floor app, a request of qvpic's shape with nothing to do at any stop
- engine: runs vllm_side.py in the peer venv from the project's venv, with the same cores
- vllm_side: the vLLM side, run by the peer venv's Python (vllm imported inside `main`)
- check_vllm: the peer venv's check, run by setup_vllm.sh
- serve/engine/vllm/sitecustomize.py: copied into the peer venv (torchvision's CUDA wheel beside torch+cpu)
- setup_vllm.sh, requirements-vllm.in, requirements-vllm.lock: build and pin the peer venv
"""
