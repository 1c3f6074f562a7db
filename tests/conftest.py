"""Shared fixtures: quiet libraries, offline everything, one loaded tiny model per family."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tests.support.fixtures_s3 import S3_ENV  # noqa: E402
from tests.support.ray_fixtures import SUITE_RAY_ENV  # noqa: E402

for _key, _value in SUITE_RAY_ENV.items():  # every Ray the suite starts, its jobs' private ones included
    os.environ.setdefault(_key, _value)

# Dummy S3 credentials before any Ray worker starts, so workers of the session-wide Ray inherit them.
for _key, _value in S3_ENV.items():
    os.environ.setdefault(_key, _value)

import pytest  # noqa: E402
import transformers  # noqa: E402

transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

FAMILY_MODELS = ["tiny-qwen", "tiny-qwen2", "tiny-glm", "tiny-llava"]  # Qwen2.5-VL, Qwen2-VL, GLM-4.1V, LLaVA-OV


@pytest.fixture(scope="session", params=FAMILY_MODELS)
def vlm(request):
    """A float32 tiny VLM of each family, loaded through the real from_pretrained path."""
    from pipeline.runtime import VLM
    from schemas.config import ModelSpec

    return VLM(ModelSpec(path=request.param, device="cpu"))


@pytest.fixture(scope="session")
def vlm_bf16(vlm):
    """`vlm`'s checkpoint in bfloat16, the serving dtype."""
    from pipeline.runtime import VLM
    from schemas.config import DType

    return VLM(vlm.spec.model_copy(update={"dtype": DType.BFLOAT16}))


# ---- the end of the run ---------------------------------------------------------------------------------------
# The suite's verdict is final once pytest has printed it. What runs after — interpreter finalisation, with daemon
# threads (the engines', the routers' pollers, Ray's and gRPC's) still inside native code — once died of SIGSEGV
# after the summary line (CI of stop 42: "make: *** [Makefile:75: test] Segmentation fault"), which would turn a
# green run red without any test failing. So the process leaves with pytest's own exit status as soon as pytest
# is done (streams flushed; every fixture, Ray's included, was already torn down). `make test` runs Python with
# -X faulthandler, so a crash *during* the run still prints every thread's stack. QVPIC_TEST_HARD_EXIT=0 turns
# this off to look for the crash itself.
_exit_status: list[int] = []


def pytest_sessionfinish(session, exitstatus):
    _exit_status.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    if _exit_status and os.environ.get("QVPIC_TEST_HARD_EXIT", "1") == "1" and not hasattr(config, "workerinput"):
        import logging
        import sys

        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_exit_status[-1])
