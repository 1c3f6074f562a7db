"""The vLLM side of the peer benchmarks (benchmarks/peer/side_by_side.py, conversation.py): run by the peer venv's
Python (.peer-vllm/, `make peer-vllm`); the project's code imports only its helpers (vllm is imported inside
`main`, so the project's import checks see only this).

    .peer-vllm/bin/python benchmarks/peer/vllm_side.py JOB.json OUT.json

A job is JSON: the checkpoint, dtype and image pixel budget (optionally `prefix_caching` false, and a
`kv_connector_path` for vLLM's ExampleConnector), and a list of tasks run on one engine (one start); a request
is one user turn of parts, `{"text": ...}` or `{"image": "/path.png"}`, sent as chat
messages (the checkpoint's own chat template, images as base64 data URLs, parts in order), so that vLLM
templates, tokenises and preprocesses the images itself. Tasks (`kind`):
- `oracle`: greedy, `max_tokens` each; per request its prompt token ids, output ids and the top-2 logprobs
  of every step (their difference is the logit margin);
- `oracle_top`: as `oracle`, keeping each step's `top` best (token id, log-probability), and vLLM's version
  (benchmarks/peer/record_oracle.py records it for tests/pipeline/eval/test_vllm_oracle.py);
- `ttft`: the `warm` requests once (the prefix cache then holds whatever it can of the measured ones), then
  each of `requests` alone, one new token, timed (ms), with its prompt tokens and the token it chose;
- `decode`: the requests submitted together at each `concurrency`, `max_tokens` new tokens each, no early
  stop; tokens/s = new tokens / wall time, after a warm pass (their prompts in the prefix cache).
"""

from __future__ import annotations

import base64
import json
import sys
import time


def messages(parts: list[dict]) -> list[dict]:
    content = []
    for part in parts:
        if "text" in part:
            content.append({"type": "text", "text": part["text"]})
        else:
            with open(part["image"], "rb") as f:
                url = "data:image/png;base64," + base64.b64encode(f.read()).decode()
            content.append({"type": "image_url", "image_url": {"url": url}})
    return [{"role": "user", "content": content}]


def main(job_path: str, out_path: str) -> int:
    from vllm import LLM, SamplingParams

    with open(job_path) as f:
        job = json.load(f)
    extra = {}
    if job.get("kv_connector_path"):  # KV saved to and loaded from this folder (the connector spike, retired:
        # docs/benchmarks/notes.md; kept for the real connector)
        from vllm.config import KVTransferConfig

        extra["kv_transfer_config"] = KVTransferConfig(
            kv_connector="ExampleConnector", kv_role="kv_both",
            kv_connector_extra_config={"shared_storage_path": job["kv_connector_path"]})
    llm = LLM(model=job["model"], dtype=job["dtype"], max_model_len=job["max_model_len"], seed=0,
              enable_prefix_caching=job.get("prefix_caching", True),
              limit_mm_per_prompt={"image": job["max_images"], "video": 0},
              mm_processor_kwargs={"min_pixels": job["min_pixels"], "max_pixels": job["max_pixels"]}, **extra)

    def chat(batch, params):
        return llm.chat([messages(parts) for parts in batch], params, chat_template_content_format="openai",
                        use_tqdm=False)

    out = [TASKS[task["kind"]](chat, SamplingParams, task) for task in job["tasks"]]
    with open(out_path, "w") as f:
        json.dump(out, f)
    return 0


def oracle(chat, sampling, task: dict) -> dict:
    params = sampling(temperature=0.0, max_tokens=task["max_tokens"], logprobs=2)
    results = []
    for parts in task["requests"]:
        (o,) = chat([parts], params)
        steps = [sorted((lp.logprob for lp in step.values()), reverse=True) for step in o.outputs[0].logprobs]
        results.append({"prompt_ids": list(o.prompt_token_ids), "output_ids": list(o.outputs[0].token_ids),
                        "margins": [s[0] - s[1] if len(s) > 1 else None for s in steps]})
    return {"results": results}


def oracle_top(chat, sampling, task: dict) -> dict:
    import vllm

    params = sampling(temperature=0.0, max_tokens=task["max_tokens"], logprobs=task["top"])
    results = []
    for parts in task["requests"]:
        (o,) = chat([parts], params)
        # vLLM lists the top k and the sampled token (k + 1 entries when it is not among them): keep the k best
        steps = [sorted(([int(t), lp.logprob] for t, lp in step.items()), key=lambda e: -e[1])[:task["top"]]
                 for step in o.outputs[0].logprobs]
        results.append({"prompt_ids": list(o.prompt_token_ids), "output_ids": list(o.outputs[0].token_ids),
                        "top": steps})
    return {"results": results, "vllm": vllm.__version__}


def ttft(chat, sampling, task: dict) -> dict:
    one = sampling(temperature=0.0, max_tokens=1)
    for parts in task["warm"]:
        chat([parts], one)
    times, tokens, first = [], [], []
    for parts in task["requests"]:
        started = time.perf_counter()
        (o,) = chat([parts], one)
        times.append((time.perf_counter() - started) * 1e3)
        tokens.append(len(o.prompt_token_ids))
        first.append(o.outputs[0].token_ids[0] if o.outputs[0].token_ids else None)
    return {"ttft_ms": times, "context_tokens": tokens, "first_tokens": first}


def decode(chat, sampling, task: dict) -> dict:
    params = sampling(temperature=0.0, max_tokens=task["max_tokens"], ignore_eos=True)
    requests = task["requests"]
    chat(requests, sampling(temperature=0.0, max_tokens=1))  # warm: every prompt in the prefix cache
    rates = {}
    for concurrency in task["concurrency"]:
        started, new_tokens = time.perf_counter(), 0
        for first in range(0, len(requests), concurrency):
            new_tokens += sum(len(o.outputs[0].token_ids) for o in chat(requests[first:first + concurrency], params))
        rates[str(concurrency)] = new_tokens / (time.perf_counter() - started)
    return {"tokens_per_s": rates}


TASKS = {"oracle": oracle, "oracle_top": oracle_top, "ttft": ttft, "decode": decode}


if __name__ == "__main__":  # vLLM starts its engine with `spawn`: the work must sit behind this guard
    sys.exit(main(*sys.argv[1:]))
