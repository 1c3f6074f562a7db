"""The language model's forward over a slab, written out: what the batched engine runs at every decode step and
every query-turn prefill (serve/engine/qvpic/batch.py), in place of transformers' generic forward.

Why: a decode step of a ~80M-parameter model is a dozen small matrix products per layer, and transformers
spends as long again around them (mask and position bookkeeping, per-layer cache objects, seven projections
where three do). This forward computes the same function with
- QKV fused into one `[hidden, q + 2·kv]` projection and gate/up into one `[hidden, 2·intermediate]` (one
  weight read and one kernel call each, where there were three and two),
- RoPE's cos/sin looked up from a table built once per model (the new tokens of a slab forward are text,
  whose three M-RoPE axes are equal, so M-RoPE reduces to 1-D RoPE at that position),
- keys and values written straight into the slab's columns (`SlabLayer.update`) and read by SDPA with
  grouped-query heads (no `repeat_kv` copy),
- logits of each row's last token only.
It is exact against transformers' forward to float rounding (tests/pipeline/runtime/test_fused_forward.py, with
controls).

Families: the Qwen2 decoder (Qwen2-VL, Qwen2.5-VL, LLaVA-OneVision's Qwen2 LLM) with default RoPE. Anything
else (GLM-4.1V's decoder, a scaled RoPE) keeps transformers' forward: `FusedDecoder.supports` says which.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from pipeline.runtime.decoder_ops import DecoderOps, native_decoder_ops, takes
from pipeline.runtime.dtypes import TORCH_DTYPES
from schemas.config import AttentionKernel, ForwardSpec

ROPE_TABLE_POSITIONS = 32_768  # positions covered by the cos/sin table (grown on demand past it)


# fp32 attention of this many new tokens or more per row goes to SDPA's tiled kernel (`attend`): a follow-up turn's
# ~55 tokens over 1,500 columns took 1.5 ms a layer there against 3.3 as two products (bench-qwen's heads, 2 threads)
SDPA_MIN_NEW = 32
# The native operations between the products run on one thread (decoder_ops.cpp: written for decode steps and short
# turns); past this many tokens in one forward torch's threaded ones are faster: a 512-token turn took 311 ms native
# against 293 on torch ops, a 56-token turn 59.3 against 60.1, a 16-row decode step 34.8 against 37.5 (`limits`)
NATIVE_MAX_TOKENS = 128
PACK_ROWS = 16  # oneDNN's batch-size hint for the packed layout: the engine's decode batch (1.6x aten's at 16 rows)


SDPA_BACKENDS = {AttentionKernel.FLASH: SDPBackend.FLASH_ATTENTION,
                 AttentionKernel.EFFICIENT: SDPBackend.EFFICIENT_ATTENTION,
                 AttentionKernel.MATH: SDPBackend.MATH, AttentionKernel.CUDNN: SDPBackend.CUDNN_ATTENTION}


def sdpa_backends(kernels: Sequence[AttentionKernel], device: torch.device) -> list[SDPBackend] | None:
    """The SDPA backends the forward pins on `device` (`ForwardSpec.attention_kernels`, in order): on CUDA only,
    where the dispatcher's own pick has changed between releases (cuDNN first, then opt-in); None elsewhere (the
    CPU's two kernels are chosen by `attend` itself)."""
    return [SDPA_BACKENDS[k] for k in kernels] if device.type == "cuda" else None


def pinned(backends: list[SDPBackend] | None) -> AbstractContextManager:
    """`sdpa_kernel(backends)` (only these enabled, for the forward's length), or nothing where None."""
    return sdpa_kernel(backends) if backends is not None else nullcontext()


class Projection:
    """`x @ weight.T + bias` as the engine runs it: on CPU with `prepack`, oneDNN's reordered weight for products
    of more than one row, and at one row in bf16 (one fp32 row: aten's own GEMV on the plain weight is faster,
    13.9 against 15.0-16.6 ms a bench-qwen token; one bf16 row: aten's 12.8-15.2 against the packed 10.2-11.0);
    with a `matmul_dtype`, the weight cast once (then only its packed form is kept) and the activations at each
    product (fp32 accumulation), the result back in the activations' dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, spec: ForwardSpec):
        dtype = TORCH_DTYPES[spec.matmul_dtype] if spec.matmul_dtype is not None else weight.dtype
        self.cast = dtype != weight.dtype
        weight = weight.to(dtype).contiguous() if self.cast else weight  # [out, in]
        self.bias = bias.to(dtype) if bias is not None and self.cast else bias
        self.packed = None
        if spec.prepack and weight.device.type == "cpu" and torch.backends.mkldnn.is_available() and (
                dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()):
            # (a CPU without native bf16, e.g. AVX2 only, keeps aten's bf16 product: slow, but the same numbers)
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS)
        # the plain weight only where a one-row product reads it: an fp32 one not cast (every other packed product
        # takes the packed form, and `weight` None says so)
        plain = self.packed is None or (not self.cast and dtype == torch.float32)
        self.weight = weight if plain else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = x.to(self.packed.dtype if self.packed is not None else self.weight.dtype) if self.cast else x
        if self.packed is not None and (self.weight is None or x.numel() > x.shape[-1]):
            y = torch.ops.mkldnn._linear_pointwise(y, self.packed, self.bias, "none", [], "")
        else:
            y = F.linear(y, self.weight, self.bias)
        return y.to(x.dtype) if self.cast else y


def fuse(linears: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The linears' weights (and biases) stacked along their outputs, `[sum(out), in]`; each linear's own
    parameters become views into it, so fusing costs no memory and transformers' forward reads the same bytes."""
    weight = torch.cat([lin.weight.detach() for lin in linears])
    bias = torch.cat([lin.bias.detach() for lin in linears]) if linears[0].bias is not None else None
    row = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight.data = weight[row:row + rows]
        if bias is not None:
            lin.bias.data = bias[row:row + rows]
        row += rows
    return weight, bias


class FusedLayer:
    """One decoder layer's weights: QKV fused, gate/up fused, the norms as (weight, eps)."""

    def __init__(self, layer: torch.nn.Module, spec: ForwardSpec):
        attn, mlp = layer.self_attn, layer.mlp
        # the plain weights `[out, in]` (the compiled graph's: pipeline/runtime/compiled.py); fusing copies nothing
        self.qkv_weight, self.qkv_bias = fuse([attn.q_proj, attn.k_proj, attn.v_proj])
        self.gate_up_weight, self.gate_up_bias = fuse([mlp.gate_proj, mlp.up_proj])
        self.o_weight, self.down_weight = attn.o_proj.weight.detach(), mlp.down_proj.weight.detach()
        self.qkv = Projection(self.qkv_weight, self.qkv_bias, spec)
        self.o = Projection(self.o_weight, None, spec)
        self.gate_up = Projection(self.gate_up_weight, self.gate_up_bias, spec)
        self.down = Projection(self.down_weight, None, spec)
        self.input_norm = (layer.input_layernorm.weight.detach(), layer.input_layernorm.variance_epsilon)
        self.post_norm = (layer.post_attention_layernorm.weight.detach(),
                          layer.post_attention_layernorm.variance_epsilon)


def rms_norm(x: torch.Tensor, norm: tuple[torch.Tensor, float]) -> torch.Tensor:
    """transformers' Qwen2RMSNorm (the variance in float32), as torch's one fused kernel where x is float32."""
    weight, eps = norm
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    x32 = x.to(torch.float32)
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Qwen's RoPE (rotate the two halves): x `[rows, heads, new, head_dim]`, cos/sin `[rows, 1, new, head_dim]`."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Grouped-query attention: q `[rows, heads, new, d]`, keys/values `[rows, kv_heads, width, d]` (the slab's
    columns, read in place, never copied per head), mask `[rows, 1, new, width]` additive → `[rows, heads, new, d]`.

    Head h reads kv head h // group (transformers' `repeat_kv` order), so the group's queries stack into one
    `[group · new, d]` block per kv head (row g · new + n: head g of the group, token n). Which kernel runs, by
    what was fastest on the CPU (docs/BENCHMARKS.md `limits`; per layer of bench-qwen):
    - one new token (a decode step), or a bf16 turn under `SDPA_MIN_NEW`: SDPA on the stacked blocks. Its CPU
      kernel then runs one block of `group · new` rows per kv head where `enable_gqa` ran one per query head: a
      16-row decode step over 600 columns 0.59 → 0.30 ms in bf16, 0.42 (the products) → 0.37 in fp32;
    - fp32 under `SDPA_MIN_NEW` tokens: two batched products on the stacked blocks (SDPA was as fast or slower);
    - longer turns: SDPA with `enable_gqa` (stacked, it was slower from ~64 tokens: 0.41 against 0.34 ms in bf16).
      Its tiled kernel never writes a long turn's scores `[kv_heads, group · new, width]`, which outgrow the
      caches. bf16 never takes torch's matmul: it copies the slab's strided keys and values before every product
      (17 of a 46 ms 16-row decode step over 1,120 columns)."""
    rows, heads, new, dim = q.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    if new == 1 or (q.dtype != torch.float32 and new < SDPA_MIN_NEW):
        stacked = mask if new == 1 else mask.repeat(1, 1, group, 1)  # [rows, 1, group · new, width]: row g · new + n
        out = F.scaled_dot_product_attention(q.reshape(rows, kv_heads, group * new, dim), keys, values,
                                             attn_mask=stacked, scale=scale)
        return out.view(rows, heads, new, dim)
    if q.dtype != torch.float32 or new >= SDPA_MIN_NEW:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
    width = keys.shape[2]
    scores = torch.matmul(q.reshape(rows, kv_heads, group * new, dim), keys.transpose(-1, -2)) * scale
    scores = scores.view(rows, kv_heads, group, new, width) + mask[:, :, None]  # mask → [rows, 1, 1, new, width]
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(weights.view(rows, kv_heads, group * new, width), values)
    return out.view(rows, heads, new, dim)


class FusedDecoder:
    """The text decoder of a loaded transformers VLM, as one function of (slab, ids, positions, mask)."""

    def __init__(self, model: torch.nn.Module, spec: ForwardSpec):
        text = language_model(model)
        self.spec = spec
        config = text.config
        self.embed = model.get_input_embeddings().weight.detach()  # [vocab, hidden]
        self.lm_head_weight = model.get_output_embeddings().weight.detach()  # [vocab, hidden]
        self.lm_head = Projection(self.lm_head_weight, None, spec)
        self.layers = [FusedLayer(layer, spec) for layer in text.layers]
        self.norm = (text.norm.weight.detach(), text.norm.variance_epsilon)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.scale = self.head_dim ** -0.5
        rotary = text.rotary_emb
        self.inv_freq = rotary.inv_freq.detach().to(torch.float32)  # [head_dim / 2]
        self.attention_scaling = float(rotary.attention_scaling)
        self.dtype = self.embed.dtype
        self._cos = self._sin = torch.empty(0)
        self._table(ROPE_TABLE_POSITIONS)
        if spec.native_ops and takes(self.embed):
            native_decoder_ops()  # built now (~0.5 s, once per process), not in the first request's forward
        self.compiled = None  # one-row forwards under torch.compile (pipeline/runtime/compiled.py), when configured
        self.sdpa_backends = sdpa_backends(spec.attention_kernels, self.embed.device)  # None off CUDA

    @staticmethod
    def supports(model: torch.nn.Module) -> bool:
        """Whether this forward computes `model`'s function: a Qwen2-style decoder with default RoPE."""
        try:
            text = language_model(model)
        except AttributeError:
            return False
        config, layer = text.config, text.layers[0]
        rope = getattr(config, "rope_parameters", None) or {}
        return (all(hasattr(layer.self_attn, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj"))
                and all(hasattr(layer.mlp, p) for p in ("gate_proj", "up_proj", "down_proj"))
                and layer.self_attn.q_proj.bias is not None and layer.self_attn.o_proj.bias is None
                and hasattr(layer, "post_attention_layernorm") and hasattr(text, "rotary_emb")
                and rope.get("rope_type", "default") == "default"
                and getattr(config, "hidden_act", "silu") == "silu"
                and not getattr(config, "use_sliding_window", False))

    def _table(self, positions: int) -> None:
        """cos/sin `[positions, head_dim]` in the model dtype, computed as transformers computes them (float32)."""
        freqs = torch.arange(positions, dtype=torch.float32)[:, None] * self.inv_freq[None, :]
        freqs = torch.cat((freqs, freqs), dim=-1)
        device = self.embed.device
        self._cos = (freqs.cos() * self.attention_scaling).to(device, self.dtype)
        self._sin = (freqs.sin() * self.attention_scaling).to(device, self.dtype)

    @torch.inference_mode()
    def forward(self, slab, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Logits `[rows, vocab]` of each row's last new token.

        slab: a prepared `Slab` (its write columns and width set for these tokens); ids `[rows, new]`;
        positions `[rows, new]` (text: one per token); mask `[rows, 1, new, width]` additive, model dtype.
        """
        rows, new = ids.shape
        # the highest position from the slab's host bookkeeping: reading `positions` back would drain the stream
        if slab.max_position >= self._cos.shape[0]:
            self._table(2 * slab.max_position + 1)
        if self.compiled is not None:
            logits = self.compiled.run(slab, ids, positions, mask)
            if logits is not None:
                return logits
        native = self.spec.native_ops and rows * new <= NATIVE_MAX_TOKENS and takes(self.embed, slab.kv)
        ops = native_decoder_ops() if native else None
        if ops is not None:
            return self._forward_native(ops, slab, ids, positions, mask)
        with pinned(self.sdpa_backends):
            return self._forward_torch(slab, ids, positions, mask)

    def _forward_torch(self, slab, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """`forward` on torch ops (any device)."""
        rows, new = ids.shape
        cos, sin = self._cos[positions][:, None], self._sin[positions][:, None]  # [rows, 1, new, head_dim]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        hidden = F.embedding(ids, self.embed)  # [rows, new, hidden]
        for layer, cache in zip(self.layers, slab.layers):
            x = rms_norm(hidden, layer.input_norm)
            q, k, v = layer.qkv(x).split([q_size, kv_size, kv_size], dim=-1)
            q = rotate(q.view(rows, new, self.num_heads, self.head_dim).transpose(1, 2), cos, sin)
            k = rotate(k.view(rows, new, self.num_kv_heads, self.head_dim).transpose(1, 2), cos, sin)
            v = v.view(rows, new, self.num_kv_heads, self.head_dim).transpose(1, 2)
            keys, values = cache.update(k, v)  # [rows, kv_heads, width, head_dim], the new ones written in place
            out = attend(q, keys, values, mask, self.scale)
            hidden = hidden + layer.o(out.transpose(1, 2).reshape(rows, new, q_size))
            x = rms_norm(hidden, layer.post_norm)
            gate, up = layer.gate_up(x).chunk(2, dim=-1)
            hidden = hidden + layer.down(F.silu(gate) * up)
        return self.lm_head(rms_norm(hidden[:, -1], self.norm))

    def _forward_native(self, ops: DecoderOps, slab, ids: torch.Tensor, positions: torch.Tensor,
                        mask: torch.Tensor) -> torch.Tensor:
        """`forward` with the operations between the products as native calls (pipeline/runtime/decoder_ops.py):
        the same function, the same rounding. Each layer's residual add is fused into the next norm."""
        rows, new = ids.shape
        q_size = self.num_heads * self.head_dim
        hidden = F.embedding(ids, self.embed)  # [rows, new, hidden], updated in place by the residual adds
        norms = [layer.input_norm for layer in self.layers[1:]] + [self.norm]
        x = ops.add_rms_norm(hidden, None, *self.layers[0].input_norm)
        for layer, cache, next_norm in zip(self.layers, slab.layers, norms):
            q = ops.rope_qkv(layer.qkv(x), self._cos, self._sin, positions, slab.write_columns, cache.keys,
                             cache.values, self.num_heads)  # [rows, heads, new, head_dim]; K and V into the slab
            width = slab.width
            out = attend(q, cache.keys[:rows, :, :width], cache.values[:rows, :, :width], mask, self.scale)
            x = ops.add_rms_norm(hidden, layer.o(out.transpose(1, 2).reshape(rows, new, q_size)), *layer.post_norm)
            down = layer.down(ops.silu_mul(layer.gate_up(x)))
            if next_norm is self.norm:  # the last layer: only each row's last token goes on
                hidden, down = hidden[:, -1], down[:, -1]
            x = ops.add_rms_norm(hidden, down, *next_norm)
        return self.lm_head(x)


def language_model(model: torch.nn.Module) -> torch.nn.Module:
    """The text decoder inside a transformers VLM (`model.model.language_model` in transformers 5)."""
    return model.model.language_model
