"""qvpic on vLLM: vLLM's engine behind the `Engine` seam, with qvpic's KV connector supplying each request's
template prefix and linked chunks re-anchored (connector.py), the request as vLLM takes it (prompt.py), and the
engine's thread (engine.py). Importing this package imports vllm."""

from serve.engine.vllm.engine import VllmEngine

__all__ = ["VllmEngine"]
