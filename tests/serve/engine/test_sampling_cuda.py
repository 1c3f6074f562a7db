"""Grammar masks and the sampler on a simulated CUDA device (tests/support/fake_cuda.py).

On a GPU the logits row is on the device, and llguidance writes its bitmask in host memory: the kernel that
applies it (torch.compile'd, llguidance's) reads both on one device. Its stand-in here asserts exactly that, and
FakeTensorMode raises on any other device mismatch. The sampler then runs every decoding control on `cuda:0`
logits: no mismatch, no generator on the host, and no host read of a whole row (a silent CPU fallback). Controls:
the bitmask left on the host (as it was) fails, and so does a row moved to the host to sample.
"""

from __future__ import annotations

from types import SimpleNamespace

import llguidance.torch
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from transformers import AutoTokenizer

from pipeline.runtime import sampling as sampling_module
from pipeline.runtime.tiny import ensure_model
from schemas.api import AnswerRequest
from schemas.sampling import Sampling
from serve.engine import grammar as grammar_module
from serve.engine.grammar import Grammars
from serve.engine.qvpic.sampler import Sampler
from serve.engine.sequence import Sequence
from tests.support.fake_cuda import CUDA, HostReads

TOP = 3  # top_logprobs in the logprobs case


@pytest.fixture(scope="module")
def grammars() -> Grammars:
    tokenizer = AutoTokenizer.from_pretrained(ensure_model("tiny-qwen"))
    return Grammars(tokenizer, len(tokenizer), {tokenizer.convert_tokens_to_ids("<|im_end|>")})


def json_object(grammars: Grammars):
    lark = AnswerRequest(query="q", top_k=1, response_format={"type": "json_object"}).grammar_text
    return grammars.matcher(lark, "response_format")


class KernelOnOneDevice:
    """llguidance's mask kernel, stood in for: it reads the logits and the bitmask on one device (as the compiled
    kernel must: a CUDA kernel cannot read host memory), and the bitmask covers the row."""

    def __init__(self):
        self.calls: list[torch.device] = []

    def __call__(self, logits: torch.Tensor, mask: torch.Tensor) -> None:
        assert logits.device == mask.device, f"the mask kernel across devices: {logits.device}, {mask.device}"
        assert mask.dtype == torch.int32 and mask.shape[1] * 32 >= logits.shape[1]
        self.calls.append(logits.device)


@pytest.fixture
def on_fake_cuda(monkeypatch):
    """The mask kernel stood in for; bitmasks llguidance can write (FakeTensorMode's tensors have no memory: these
    are real host memory, as on a GPU host, filled outside the mode), each recorded with whether it was asked pinned;
    host reads recorded."""
    kernel = KernelOnOneDevice()
    monkeypatch.setattr(llguidance.torch, "apply_token_bitmask_inplace_kernel", kernel)
    asked: list[bool] = []
    real = grammar_module.host_bitmask

    def host_bitmask(vocab_size: int, pinned: bool) -> torch.Tensor:
        asked.append(pinned)
        with unset_fake_temporarily():
            return real(vocab_size, pinned=False)  # this torch cannot pin: it has no CUDA

    monkeypatch.setattr(grammar_module, "host_bitmask", host_bitmask)
    real_fill = llguidance.torch.fill_next_token_bitmask

    def fill(matcher, bitmask: torch.Tensor, index: int) -> None:  # llguidance writes through a host pointer
        with unset_fake_temporarily():
            real_fill(matcher, bitmask, index)

    monkeypatch.setattr(llguidance.torch, "fill_next_token_bitmask", fill)
    return SimpleNamespace(kernel=kernel, pinned=asked, reads=HostReads().install(monkeypatch))


def test_the_grammar_mask_is_applied_on_the_logits_device(grammars, on_fake_cuda):
    matcher = json_object(grammars)
    with FakeTensorMode(allow_non_fake_inputs=True):
        masked = grammars.mask(matcher, torch.empty(grammars.vocab_size, dtype=torch.bfloat16, device=CUDA))
    assert masked.device == CUDA and masked.shape == (grammars.vocab_size,) and masked.dtype == torch.float32
    assert on_fake_cuda.kernel.calls == [CUDA]
    assert on_fake_cuda.pinned == [True]  # bound for a GPU: page-locked, so the copy is asynchronous


def test_control_the_bitmask_left_on_the_host_fails(grammars, on_fake_cuda, monkeypatch):
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **k: self)  # nothing moves: the host's bitmask stays
    matcher = json_object(grammars)
    with FakeTensorMode(allow_non_fake_inputs=True), pytest.raises(AssertionError, match="across devices"):
        grammars.mask(matcher, torch.empty(grammars.vocab_size, device=CUDA))


CASES = {"greedy": Sampling(), "penalties": Sampling(presence_penalty=0.5, frequency_penalty=0.3),
         "logit_bias": Sampling(logit_bias=((3, 2.0), (5, -1.0))), "temperature": Sampling(temperature=0.7),
         "seeded": Sampling(temperature=0.7, seed=3), "top_p": Sampling(temperature=0.7, top_p=0.9),
         "logprobs": Sampling(logprobs=TOP), "grammar": Sampling(temperature=0.7, top_p=0.9, seed=1, grammar="-"),
         "top_k_min_p": Sampling(temperature=0.7, top_k=5, min_p=0.05, top_p=0.9, seed=2),
         "repetition_min_tokens": Sampling(repetition_penalty=1.3, min_tokens=5, stop_token_ids=(9,))}


def sample_on_fake_cuda(grammars: Grammars, sampling: Sampling, monkeypatch) -> tuple[int, list[torch.device]]:
    """One token chosen from a `cuda:0` row under `sampling`, and the devices its generators were made on."""
    generators: list[torch.device] = []
    real_generator = torch.Generator

    def generator(device=None):  # this torch has no CUDA generator: a host one, the device asked recorded
        generators.append(torch.device(device))
        return real_generator()

    monkeypatch.setattr(torch, "Generator", generator)
    sampler = Sampler(SimpleNamespace(device=CUDA, adapter=SimpleNamespace(end_of_turn_ids=frozenset({2}))))
    sampler._grammars = grammars
    seq = Sequence(sampling=sampling, context=None, num_prompt_tokens=4, num_query_tokens=0, emit=lambda t: None,
                   token_ids=[5, 7, 7], grammar=json_object(grammars) if sampling.grammar else None)
    with FakeTensorMode(allow_non_fake_inputs=True):
        token = sampler.token(seq, torch.empty(grammars.vocab_size, dtype=torch.bfloat16, device=CUDA), best=0)
    return token, generators


@pytest.mark.parametrize("case", CASES)
def test_every_decoding_control_runs_on_the_logits_device(case, grammars, on_fake_cuda, monkeypatch):
    sampling = CASES[case]
    token, generators = sample_on_fake_cuda(grammars, sampling, monkeypatch)
    assert isinstance(token, int)
    assert generators == ([CUDA] if sampling.seed is not None else [])
    reads = on_fake_cuda.reads.reads
    assert all(r.device == CUDA for r in reads), reads  # every choice made on the device, its result read
    assert all(r.numel <= TOP for r in reads), reads  # a token, a log-probability, top-k: never a whole row
    assert on_fake_cuda.kernel.calls == ([CUDA] if sampling.grammar else [])


def test_control_a_row_sampled_on_the_host_fails(grammars, on_fake_cuda, monkeypatch):
    real = sampling_module.choose_token
    monkeypatch.setattr("serve.engine.qvpic.sampler.choose_token", lambda row, s, g: real(row.cpu(), s, None))
    sample_on_fake_cuda(grammars, CASES["top_p"], monkeypatch)
    assert {r.device for r in on_fake_cuda.reads.reads} == {torch.device("cpu")}  # what the test above refuses
