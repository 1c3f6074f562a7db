"""The fused forward under `torch.compile` (`engine.forward.compiled`): one graph for the whole decoder, compiled
by inductor with the weights frozen (so it prepacks them and picks each product's kernel by timing it: oneDNN,
MKL or its own AMX/AVX-512 micro-kernels) and the norms, RoPE and SiLU fused around the products.

Why only for one-row forwards (a query-turn prefill, a conversation's follow-up, a lone request's decode step):
the graph never writes the slab. A write into a graph input is functionalised into a copy of the whole slab (a
16-row decode step went 38 → 440 ms), so each layer attends to a copy of the row's columns with the new keys and
values put in place, and hands the new ones back; the caller writes them into the slab after the graph. That copy
is ~nothing for one row, and more than the graph saves over a 16-row decode step (fp32 39 → 50 ms), which keeps the
eager forward.

Measured on bench-qwen against the eager fused forward, 2 threads of an AMX Xeon (docs/BENCHMARKS.md `limits`,
`--compiled`): a bf16 model's one-row forwards take ~0.65-0.82x the time; an fp32 model's gain nothing (turns of
2-31 tokens are slower), so it is for bf16. Exact in fp32 (logits within 1e-5,
tests/pipeline/runtime/test_compiled_forward.py).
The cost: compiling, about 3 minutes on 2 cores when the engine starts (`warm_up`: a graph per kind of turn, and
per kind of slab), less once inductor's on-disk cache holds its kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pipeline.runtime.fused import SDPA_MIN_NEW, FusedDecoder, attend, rms_norm, rotate

# inductor's settings while it compiles: frozen weights (constant-folded, prepacked) and each product's kernel chosen
# by timing the candidates. Set around each call (a call may compile), not as `torch.compile(options=...)`, which
# left them off: bf16 1.33x the eager forward's time at one token, against 0.76x with them
INDUCTOR = {"freezing": True, "max_autotune": True}
CACHE_SIZE_LIMIT = 64  # graphs dynamo keeps for `DecoderGraph.forward` (all instances together)
WARM_UP_CAPACITY = 8192  # the throwaway slab's columns: the shapes the dynamic graph is guarded for derive from it
# turn lengths `warm_up` runs: a static graph and the dynamic one under `fused.SDPA_MIN_NEW` tokens (attend branches
# there), the one-token step, and the dynamic graph from `SDPA_MIN_NEW` on
WARM_UP_TOKENS = (2, 3, 1, SDPA_MIN_NEW + 8, SDPA_MIN_NEW + 9)


class DecoderGraph(torch.nn.Module):
    """The fused forward's function (pipeline/runtime/fused.py `FusedDecoder.forward`, torch ops) with the weights
    as frozen parameters. They are the decoder's own tensors (the fused QKV and gate/up are the ones `fuse` built
    and the checkpoint's linears view): registering them copies nothing."""

    def __init__(self, decoder: FusedDecoder):
        super().__init__()
        if any(layer.gate_up_bias is not None for layer in decoder.layers):
            raise ValueError("the compiled forward takes Qwen2's MLP, which has no bias")

        def frozen(tensor: torch.Tensor) -> torch.nn.Parameter:
            return torch.nn.Parameter(tensor, requires_grad=False)

        def stack(name: str) -> torch.nn.ParameterList:
            return torch.nn.ParameterList(frozen(getattr(layer, name)) for layer in decoder.layers)

        self.embed, self.lm_head = frozen(decoder.embed), frozen(decoder.lm_head_weight)
        self.final_norm, self.eps = frozen(decoder.norm[0]), decoder.norm[1]
        self.qkv, self.qkv_bias, self.o = stack("qkv_weight"), stack("qkv_bias"), stack("o_weight")
        self.gate_up, self.down = stack("gate_up_weight"), stack("down_weight")
        self.input_norm = torch.nn.ParameterList(frozen(layer.input_norm[0]) for layer in decoder.layers)
        self.post_norm = torch.nn.ParameterList(frozen(layer.post_norm[0]) for layer in decoder.layers)
        self.layer_eps = [(layer.input_norm[1], layer.post_norm[1]) for layer in decoder.layers]
        self.heads, self.kv_heads, self.head_dim = decoder.num_heads, decoder.num_kv_heads, decoder.head_dim
        self.scale = decoder.scale

    def forward(self, kv: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor, columns: torch.Tensor,
                mask: torch.Tensor, cos_table: torch.Tensor,
                sin_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """kv: the slab `[layers, 2, 1, kv_heads, capacity, head_dim]` (read only); ids/positions `[1, new]`;
        columns `[new]`: where the new tokens go; mask `[1, 1, new, width]`. Returns the last token's logits
        `[1, vocab]` and the new keys and values `[layers, 2, 1, kv_heads, new, head_dim]`."""
        rows, new = ids.shape
        width = mask.shape[-1]  # the columns the new tokens may see (theirs included)
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        cos, sin = cos_table[positions][:, None], sin_table[positions][:, None]  # [rows, 1, new, head_dim]
        hidden = F.embedding(ids, self.embed)  # [rows, new, hidden]
        written = []
        for i, (input_eps, post_eps) in enumerate(self.layer_eps):
            x = rms_norm(hidden, (self.input_norm[i], input_eps))
            q, k, v = F.linear(x, self.qkv[i], self.qkv_bias[i]).split([q_size, kv_size, kv_size], dim=-1)
            q = rotate(q.view(rows, new, self.heads, self.head_dim).transpose(1, 2), cos, sin)
            k = rotate(k.view(rows, new, self.kv_heads, self.head_dim).transpose(1, 2), cos, sin)
            v = v.view(rows, new, self.kv_heads, self.head_dim).transpose(1, 2)
            written.append(torch.stack((k, v)))
            # the slab's columns with the new ones put in place, out of place: [rows, kv_heads, width, head_dim]
            keys = kv[i, 0, :, :, :width].index_copy(2, columns, k)
            values = kv[i, 1, :, :, :width].index_copy(2, columns, v)
            out = attend(q, keys, values, mask, self.scale)
            hidden = hidden + F.linear(out.transpose(1, 2).reshape(rows, new, q_size), self.o[i])
            gate, up = F.linear(rms_norm(hidden, (self.post_norm[i], post_eps)), self.gate_up[i]).chunk(2, dim=-1)
            hidden = hidden + F.linear(F.silu(gate) * up, self.down[i])
        logits = F.linear(rms_norm(hidden[:, -1], (self.final_norm, self.eps)), self.lm_head)
        return logits, torch.stack(written)


class CompiledForward:
    """`DecoderGraph` compiled, and when it applies: `FusedDecoder.forward` calls `run`, which answers None where
    the eager forward must run instead."""

    def __init__(self, decoder: FusedDecoder):
        # dynamic shapes from the start: one graph serves every turn length and width (0 and 1 specialise: the
        # one-token step is a graph of its own)
        self.graph = torch.compile(DecoderGraph(decoder).eval(), dynamic=True)
        # dynamo keeps the graphs of every `DecoderGraph` (one code object) in one cache, 8 by default; one decoder
        # warms up ~5, and past the limit a second one (fp32 and bf16 side by side in `limits`) would run the
        # module's Python uncompiled without a word
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, CACHE_SIZE_LIMIT)
        self.decoder = decoder
        self.refused = 0  # forwards the graph would have had to recompile for (run eagerly instead)

    def run(self, slab, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor | None:
        """The last token's logits `[1, vocab]`, the new keys and values written into the slab; None where the
        graph does not apply (more than one row, or a full slab) or would have to compile again (after `warm_up`, a
        request never waits for a compile)."""
        if slab.kv.shape[2] != 1 or slab.width == slab.kv.shape[4]:
            # (a slab with no column past this forward's: the graphs are guarded on there being one, and compiling
            # one more kind of graph at start for it cost more than it would buy; such a row runs eagerly)
            return None
        # the graph is guarded on its inputs' kind (inference tensor or not): the small ones always come as the
        # engine makes them (in inference mode), whoever made them; the slab comes either way (`warm_up`)
        with torch.inference_mode():
            ids, positions, columns, mask = (t if t.is_inference() else t.clone()
                                             for t in (ids, positions, slab.write_columns[0], mask))
        try:
            with torch.compiler.set_stance("fail_on_recompile"), torch._inductor.config.patch(INDUCTOR):
                logits, written = self.graph(slab.kv, ids, positions, columns, mask, self.decoder._cos,
                                             self.decoder._sin)
        except RuntimeError as error:
            if "recompil" not in str(error).lower():
                raise
            self.refused += 1
            return None
        slab.kv[:, :, :, :, columns] = written
        return logits

    def warm_up(self, dtype: torch.dtype, device: torch.device) -> None:
        """Compile now (when the engine starts) rather than in the first requests: each turn length of
        `WARM_UP_TOKENS` over a throwaway one-row slab with room to spare, as the engine's forwards see theirs:
        the tokens, positions and mask made in inference mode, the slab either way (a slab on memory a finished one
        held is a normal tensor, a fresh one an inference tensor, and the graph is guarded for what it saw)."""
        decoder, cached = self.decoder, 40
        shape = (len(decoder.layers), 2, 1, decoder.num_kv_heads, WARM_UP_CAPACITY, decoder.head_dim)
        normal = torch.zeros(shape, dtype=dtype, device=device)
        with torch.inference_mode(), torch._inductor.config.patch(INDUCTOR):
            for kv in (torch.zeros(shape, dtype=dtype, device=device), normal):
                for new in WARM_UP_TOKENS:
                    ids = torch.zeros(1, new, dtype=torch.long, device=device)
                    positions = torch.arange(cached, cached + new, device=device)[None]
                    mask = torch.zeros(1, 1, new, cached + new, dtype=dtype, device=device)
                    self.graph(kv, ids, positions, positions[0], mask, decoder._cos, decoder._sin)
