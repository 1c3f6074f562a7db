"""Typed configuration shared by the offline and online paths.

Everything here is validated at construction (pydantic, frozen, unknown fields rejected) so a bad
config fails where it is written, not deep inside a Ray worker.
"""

from __future__ import annotations

import re
from enum import Enum

from pydantic import Field, field_validator, model_validator

from schemas.frozen import Frozen

# Mode, Variant and RenderSpec are documented (docs/ARCHITECTURE.md) and still imported from here by modules another
# branch edits (serve/governance/turn.py, benchmarks/scale): their homes are schemas/modes.py and schemas/render.py.


class ModelFamily(str, Enum):
    """VLM families the runtime (and the vision-token estimator) knows."""

    QWEN2_5_VL = "qwen2_5_vl"
    QWEN2_VL = "qwen2_vl"
    GLM4V = "glm4v"
    LLAVA_ONEVISION = "llava_onevision"


class DType(str, Enum):
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"


class WeightsPlacement(str, Enum):
    """Where a loaded VLM keeps its parameters (`ModelSpec.weights`); its KV and rotary tables stay on `device`."""

    DEVICE = "device"  # on the model's device: every forward runs there (qvpic's engine, compile jobs)
    # in host memory, the forwards qvpic still runs (a template prefix's KV, a repair's compile) on the CPU with their
    # KV moved to the device: vLLM's engine, which holds its own copy of the weights on the GPU (docs/DEPLOY.md)
    HOST = "host"


class KVQuant(str, Enum):
    """How a store keeps its KV entries (chosen per store at ingest, part of every entry's identity).

    The quantised formats follow KIVI: keys per channel (one scale per layer, head and channel, over
    the entry's tokens — key outliers live in fixed channels), values per token (one scale per layer,
    head and token, over the channels). See pipeline/store/kv_quant.py."""

    NONE = "none"  # the model's dtype, as compiled
    INT8 = "int8"  # symmetric int8, absmax scales
    FP8 = "fp8"  # float8 e4m3 (torch.float8_e4m3fn), absmax scales to its ±448 range


class RecomputeKind(str, Enum):
    """Which tokens of every linked chunk are recomputed with attention to the context before them
    (pipeline/runtime/selective_recompute.py): a repair of what position-independent caching drops."""

    NONE = "none"  # link the cached KV as it is
    LEADING = "leading"  # EPIC: the first `leading_num_tokens` tokens of every chunk
    # CacheBlend: the `deviation_fraction` of each chunk's tokens whose layer-1 K/V deviate most
    DEVIATION = "deviation"


class ScoreNormalisation(str, Enum):
    """How the router turns cosine relevances into the shares that τ is compared against."""

    LINEAR = "linear"  # negatives clipped to 0, then each score over their sum
    RAW = "raw"  # negatives clipped to 0, not divided: τ is a cumulative cosine, not bounded by 1
    SOFTMAX = "softmax"  # softmax of score / temperature: every chunk gets a share, sharper as T falls



class ModelSpec(Frozen):
    """Which VLM to load and how.

    `path` is a local checkpoint directory, or one of the built-in offline names
    (`tiny-qwen`, `tiny-glm`, `bench-qwen`, `bench-glm`) that the tiny factory materialises on disk
    first so that every model goes through the same `from_pretrained` path.
    """

    path: str = "tiny-qwen"
    revision: str = "local"
    dtype: DType = DType.FLOAT32
    device: str = "auto"  # "auto" = cuda when present, else cpu; refused on an NVIDIA node whose torch cannot use it
    attn_implementation: str = "sdpa"
    trust_remote_code: bool = False
    max_pixels: int = Field(1_605_632, gt=0)  # >= 1,389,000 so a 120-DPI A4 page is not downscaled
    min_pixels: int = Field(3136, gt=0)
    # None: the engine's choice (`weights_for`): host under vLLM's engine, on the device under qvpic's
    weights: WeightsPlacement | None = None

    def weights_for(self, engine: EngineKind) -> ModelSpec:
        """This spec with `weights` set: as given, else host memory for vLLM's engine (its own copy of the weights is
        on the GPU; on a CPU host memory is the device, so nothing changes there) and the device for qvpic's."""
        if self.weights is not None:
            return self
        return self.model_copy(update={"weights": WeightsPlacement.HOST if engine is EngineKind.VLLM
                                       else WeightsPlacement.DEVICE})


class HybridSpec(Frozen):
    """Hybrid representation per chunk (`qvpic serve --hybrid`): in `qvpic` mode the router serves a chunk
    as its text entry instead of its pages where this declared rule says so (serve/routing/hybrid.py):

    1. cheaper as text: text tokens ≤ `text_cost_ratio` × the tokens of its pages — at the lowest tier
       before promotion (such a chunk is text and takes no promotion), then at the tier it was routed to;
    2. illegible: its pages at the routed tier scored below `min_legibility` at ingest (`qvpic ingest
       --legibility`; unmeasured counts as legible) and its text costs at most
       `illegible_text_cost_ratio` × their tokens, within the request's token room (most relevant first).
    """

    enabled: bool = False
    text_cost_ratio: float = Field(1.0, gt=0.0, le=16.0)
    min_legibility: float = Field(0.97, ge=0.0, le=1.0)
    illegible_text_cost_ratio: float = Field(2.0, gt=0.0, le=16.0)


MAX_RAW_TAU = 1024.0  # a raw cumulative cosine: at most one per chunk of a request (MAX_IDS_PER_REQUEST)


def check_tau(tau: float, normalisation: ScoreNormalisation) -> None:
    """Shares sum to 1, so τ > 1 promotes as τ = 1 would: refused, except for raw cosines, which are unbounded."""
    if tau > 1.0 and normalisation is not ScoreNormalisation.RAW:
        raise ValueError(f"τ={tau:g} > 1 needs the raw normalisation ({normalisation.value} shares sum to 1)")


class RouterSpec(Frozen):
    """Defaults of the relevance router; τ and B can be overridden per request."""

    tau: float = Field(0.5, ge=0.0, le=MAX_RAW_TAU)  # cumulative relevance share (raw: cosine) that is promoted
    max_high_res: int = Field(4, ge=0)  # budget B of promoted chunks
    normalisation: ScoreNormalisation = ScoreNormalisation.LINEAR
    temperature: float = Field(0.05, gt=0.0, le=10.0)  # of the softmax normalisation; unused by linear
    hybrid: HybridSpec = HybridSpec()  # text instead of pages per chunk, by a declared rule (off by default)

    @model_validator(mode="after")
    def _tau_fits_normalisation(self) -> "RouterSpec":
        check_tau(self.tau, self.normalisation)
        return self


class RecomputeSpec(Frozen):
    """Selective recompute of linked chunks before the query is prefilled; off by default. Each chunk's
    tokens are rebuilt from its stored source (text, or pages rendered again) at serve time."""

    kind: RecomputeKind = RecomputeKind.NONE
    leading_num_tokens: int = Field(16, ge=1)  # LEADING: k tokens per chunk (a chunk shorter than k: all of it)
    deviation_fraction: float = Field(0.15, gt=0.0, le=1.0)  # DEVIATION: r, the share of each chunk's tokens

    @property
    def enabled(self) -> bool:
        return self.kind is not RecomputeKind.NONE


class PrefixCacheSpec(Frozen):
    """The generator's prefix KV cache (serve/engine/qvpic/prefix_cache.py): blocks of a finished request's prompt
    and answer, keyed by everything before them (tokens, images, linked chunks) and the tenant."""

    block_tokens: int = Field(16, ge=1, le=1024)  # columns per block (vLLM: 16 on GPU, 128 on its CPU backend)
    device_nbytes: int = Field(1 << 30, ge=0)  # LRU on the generator's device; 0 switches the cache off
    host_nbytes: int = Field(2 << 30, ge=0)  # LRU in host memory for what the device tier evicts; 0: none
    # Keep the logits a finished prompt's last column gave, under the prompt's key: the same request again (a retry,
    # "regenerate") samples its first token from them and runs no forward. False: it recomputes that one column
    # (vLLM's prefix cache does). `[vocab]` floats an entry (600 KB for Qwen2.5-VL), counted in the bounds above.
    final_logits: bool = True


class AttentionKernel(str, Enum):
    """An SDPA kernel the fused forward may run on CUDA (torch.nn.attention.SDPBackend by the same name)."""

    FLASH = "flash"  # FLASH_ATTENTION: takes no additive mask, so masked calls fall through to the next
    EFFICIENT = "efficient"  # EFFICIENT_ATTENTION (memory-efficient): takes the additive mask
    MATH = "math"  # the reference kernel: any inputs
    CUDNN = "cudnn"  # CUDNN_ATTENTION: off by default (ForwardSpec.attention_kernels)


class ForwardSpec(Frozen):
    """How the engine runs the language model's batched forwards (decode steps, query-turn prefills):
    pipeline/runtime/fused.py. Full prefills of images and the offline compile always run transformers'."""

    fused: bool = True  # the written-out forward where the checkpoint's decoder supports it (else transformers')
    prepack: bool = True  # on CPU: weights reordered once for oneDNN (one more copy of the LLM's weights)
    # The dtype of the fused forward's matrix products (weights cast once, activations at each product, fp32
    # accumulation); None = the model's. bfloat16 on a CPU with AMX/avx512_bf16 is ~3x faster from 16 rows and is
    # no longer exact: tests/pipeline/runtime/test_fused_forward.py states and tests its tolerance. Needs `fused`.
    matmul_dtype: DType | None = None
    # On CPU: the operations between the products (norms, residual adds, RoPE, the KV write, SiLU) as native calls
    # (pipeline/runtime/decoder_ops.py, built at first use), the same numbers; false (or no compiler): torch ops
    native_ops: bool = True
    # torch's intra-op threads in the generator's process. None: the replica's CPU reservation rounded *up*
    # (serve/engine/generator.py `forward_threads`): Ray sets OMP_NUM_THREADS to it rounded down, so a 1.5-CPU
    # replica on a 2-core node ran its forwards on one thread, and the default 0.1 CPU always on one.
    threads: int | None = Field(None, ge=1, le=1024)
    # One-row forwards (a query turn, a conversation's follow-up, a lone request's decode step) as one torch.compile
    # graph (pipeline/runtime/compiled.py): a bf16 model's take ~0.65-0.82x the eager fused forward's time on an AMX
    # CPU; an fp32 model's gain nothing (docs/BENCHMARKS.md `limits`). Costs ~3 minutes of compiling on 2 cores when
    # the engine starts. Needs `fused` and the model's own dtype for the products.
    compiled: bool = False
    # The SDPA kernels the fused forward may pick from on CUDA (a `sdpa_kernel` around it; the CPU keeps torch's own
    # choice). cuDNN attention is left out on purpose: the engine's attention is masked (an additive mask) over a width
    # that grows by one every decode step, and cuDNN's kernel builds (and caches) an execution plan per new shape,
    # where flash/efficient take any width. Its correctness has moved with versions too: torch 2.5 made it opt-in
    # after wrong results (pytorch/pytorch#138522), and on torch 2.11-2.13 with cuDNN 9.19-9.20 the unpinned default
    # picked it on B200 and corrupted greedy decoding of models with < 8 kv heads (pytorch/pytorch#193893; the
    # engine's Qwen2.5-VL-7B has 4). Add `cudnn` only where benchmarks/gpu_check's `attention` step shows it exact
    # and faster at the engine's shapes on that GPU.
    attention_kernels: tuple[AttentionKernel, ...] = Field(
        (AttentionKernel.FLASH, AttentionKernel.EFFICIENT, AttentionKernel.MATH), min_length=1)

    @model_validator(mode="after")
    def _needs_fused(self) -> "ForwardSpec":
        if self.matmul_dtype is not None and not self.fused:
            raise ValueError("forward.matmul_dtype needs forward.fused: true "
                             "(transformers' forward runs the model's dtype)")
        if self.compiled and (not self.fused or self.matmul_dtype is not None):
            raise ValueError("forward.compiled needs forward.fused: true and no forward.matmul_dtype "
                             "(the compiled graph runs the fused forward in the model's dtype)")
        return self


class EngineKind(str, Enum):
    """What executes a generator's forwards (serve/engine/interface.py: the `Engine` seam)."""

    QVPIC = "qvpic"  # qvpic's own engine (serve/engine/qvpic/): CPU and GPU, the exactness oracle, every feature
    VLLM = "vllm"  # vLLM's engine with qvpic's KV connector (serve/engine/vllm/): needs vllm installed


CPU_MAX_KV_NBYTES = 4 << 30  # the batch's KV cap unless set: on a CPU also when it is left to the device (None)


class EngineConfig(Frozen):
    """The generator's batching engine: how many requests share a forward pass and how much KV they
    may hold (prompt plus decoded tokens, as the batch's slab lays them out). Past either cap requests
    wait in a bounded queue; past the queue they are refused with 503 and Retry-After."""

    kind: EngineKind = EngineKind.QVPIC
    # vLLM's engine only: the ranks a checkpoint's layers are split across, each a worker process of the generator
    # replica (vLLM's multiprocessing executor) on one of the replica's GPUs — generator_deployment.num_gpus is this
    # many; on a CPU each rank is bound to its share of the replica's cores (docs/DEPLOY.md "Engines")
    tensor_parallel_size: int = Field(1, ge=1, le=16)

    max_batch_size: int = Field(16, ge=1, le=1024)  # rows of one decode forward
    # The batch's KV slab, all rows and layers. None: sized at start from the device (serve/engine/kv_budget.py): on
    # a GPU 80% of its free memory after the weights, less hot_tier_nbytes and prefix_cache.device_nbytes (one
    # replica a GPU: replicas sharing one would each count the same free memory); on a CPU CPU_MAX_KV_NBYTES.
    # qvpic's engine only: vLLM's takes a number (it loads its own weights after the generator's).
    max_kv_nbytes: int | None = Field(CPU_MAX_KV_NBYTES, ge=1)
    max_waiting: int = Field(64, ge=1)  # requests queued for a row beyond the running ones
    # The most of the batch's rows (at least one) and of its KV bytes one tenant's requests hold at once while another
    # tenant holds some too (n choices are n rows); past it the tenant's next requests wait in the generator, while
    # the others' go ahead. Alone, a tenant may use the whole batch. None: no cap (serve/engine/shares.py).
    max_tenant_share: float | None = Field(None, gt=0.0, le=1.0)
    # A step's prefill work, in tokens at no context (a token reading many columns costs more: its attention,
    # serve/engine/qvpic/scheduler.py `column_cost`). Joins are spread over steps, and a linked prompt that costs more
    # is prefilled in pieces, one a step (chunked prefill), so the running rows keep decoding between them and no
    # tenant's long prompt holds the batch (issue 60). A full prefill (an online mode's) or a prompt with an image in
    # its last text costs what it costs, alone in its step. 2048: vLLM's default where it serves an API from a CPU or
    # a smaller GPU; vLLM's engine takes it as `max_num_batched_tokens` (at least 2048).
    max_prefill_tokens: int = Field(2048, ge=1)
    hot_tier_nbytes: int = Field(1 << 30, ge=0)  # chunk KV kept resident on the generator's device
    # On a CPU, memory of finished slabs kept for the next ones (a fresh page faults at its first write:
    # serve/engine/qvpic/slab_memory.py); 0 allocates every slab afresh. A GPU's caching allocator does this itself.
    slab_reuse_nbytes: int = Field(1 << 30, ge=0)
    prefix_cache: PrefixCacheSpec = Field(default_factory=PrefixCacheSpec)
    forward: ForwardSpec = Field(default_factory=ForwardSpec)


_HOSTNAME = re.compile(r"^(?=.{1,253}$)[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)*$")


class ImageUrlsSpec(Frozen):
    """Chat images given by http(s) URL, fetched by the ingress (serve/http/image_urls.py). Off by default: the
    server then fetches nothing and such a part is a 400 naming it. On, only hosts of `allowed_domains` are
    fetched (a domain allows its subdomains), never from a private, loopback, link-local, multicast or reserved
    address (checked on the address DNS gave, which is the one connected to), never through a redirect to
    another host, within `max_bytes` and `timeout_s` (docs/SECURITY.md, "Image URLs")."""

    enabled: bool = False
    allowed_domains: tuple[str, ...] = Field((), max_length=256)  # e.g. images.example.com; empty: none
    max_bytes: int = Field(8 << 20, ge=1, le=8 << 20)  # one image as fetched (schemas/conversation.py's cap)
    timeout_s: float = Field(10.0, gt=0, le=60)  # the whole fetch of one image: DNS, redirects, body
    max_redirects: int = Field(3, ge=0, le=10)  # each to the same host

    @field_validator("allowed_domains")
    @classmethod
    def _hostnames(cls, domains: tuple[str, ...]) -> tuple[str, ...]:
        for domain in domains:
            if _HOSTNAME.match(domain) is None:
                raise ValueError(f"{domain!r}: a lowercase host name (no scheme, port, path or wildcard)")
        return domains

    @model_validator(mode="after")
    def _domains_when_enabled(self) -> ImageUrlsSpec:
        if self.enabled and not self.allowed_domains:
            raise ValueError("image_urls.enabled needs allowed_domains: the hosts images may be fetched from")
        return self
