"""`qvpic serve --engine vllm`: the Serve application with vLLM's engine in the generator replica (a Ray actor),
answering over HTTP what the in-process stack on vLLM's engine answers, then draining on SIGTERM.

Runs where vLLM imports (`make test-vllm`); skipped elsewhere. ~2 min: a local Ray, Serve, and vLLM's start.
"""

from __future__ import annotations

import signal
import subprocess
import sys

import httpx
import pytest

pytest.importorskip("vllm")

from tests.e2e.test_serve_lifecycle import START_TIMEOUT_S, wait_for  # noqa: E402
from tests.serve.engine.vllm.conftest import KV_NBYTES, MODEL  # noqa: E402
from tests.serve.engine.vllm.test_vllm_http import call  # noqa: E402
from tests.support.paths import REPO  # noqa: E402
from tests.support.ray_fixtures import free_port  # noqa: E402

pytestmark = pytest.mark.vllm
QUESTION = "When does part XK-4471-B ship?"


def test_qvpic_serve_on_vllms_engine_answers_as_the_in_process_stack(store_uri, stacks, tmp_path):
    port = free_port()
    command = [sys.executable, "-m", "jobs.run_server", "--store", store_uri, "--model", MODEL.path, "--device", "cpu",
               "--engine", "vllm", "--port", str(port), "--num-cpus", "4", "--max-batch-size", "4"]
    config = tmp_path / "config.yaml"  # the KV cap: vLLM's CPU backend would otherwise ask for 92% of memory
    config.write_text(f"applications:\n- args:\n    generator:\n      engine:\n        max_kv_nbytes: {KV_NBYTES}\n")
    server = subprocess.Popen(command + ["--config", str(config)], cwd=REPO,
                              stdout=(tmp_path / "stdout").open("w"), stderr=(tmp_path / "stderr").open("w"))
    body = {"model": "qvpic", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 8, "temperature": 0,
            "qvpic": {"chunk_ids": ["invoices#00000"]}}
    try:
        wait_for(lambda: "qvpic: serving" in (tmp_path / "stdout").read_text() or server.poll() or None,
                 START_TIMEOUT_S, "qvpic serve --engine vllm")
        assert server.poll() is None, (tmp_path / "stderr").read_text()[-3000:]
        response = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        served = response.json()["choices"][0]["message"]["content"]
        in_process = call(stacks[1].api(), "/v1/chat/completions", body)  # the in-process stack on vLLM's engine
        assert served == in_process.json()["choices"][0]["message"]["content"]
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=120) == 0
    finally:
        if server.poll() is None:
            server.kill()
