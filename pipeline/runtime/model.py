"""The VLM runtime shared by compile (offline) and serve (online): load, compile, prefill, decode (where the
checkpoint is and what it is: pipeline/runtime/checkpoint.py).

Positions are always passed explicitly, kept as `(axes, 1, L)` (3 for M-RoPE, 1 for 1-D RoPE) and
handed to the model in its own layout by the adapter; the models' stateful `rope_deltas` is never
relied on.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
import transformers
from PIL import Image
from transformers import AutoConfig, AutoTokenizer, DynamicCache

from pipeline.runtime.adapters import Adapter, family_classes
from pipeline.runtime.checkpoint import cache_argument, resolve_device, resolve_path
from pipeline.runtime.compile_chunks import ChunkCompiler
from pipeline.runtime.compiled import CompiledForward
from pipeline.runtime.conversation import PreparedSegment
from pipeline.runtime.dtypes import TORCH_DTYPES
from pipeline.runtime.fused import FusedDecoder
from pipeline.runtime.kv import AssembledContext, ChunkKV, RotationTable, assemble
from pipeline.runtime.sampling import adjust_logits, select_token
from schemas.config import ForwardSpec, ModelSpec, WeightsPlacement
from schemas.modes import ChunkKind, CompilePrefix
from schemas.sampling import Sampling

PREFIX_CACHE_SIZE = 64  # distinct instructions whose serving-prefix KV is kept (each a few hundred KB)


@dataclass
class Prefill:
    """State right after a prefill: the last position's logits and the cache to decode on."""

    logits: torch.Tensor  # [1, new_tokens, vocab] of the prefilled tokens
    cache: DynamicCache
    next_position: int


class VLM(ChunkCompiler):
    """One loaded VLM with the template prefix and rotary layout derived from the checkpoint."""

    def __init__(self, spec: ModelSpec):
        self.spec = spec
        self.path = resolve_path(spec)
        self.device = resolve_device(spec.device)  # where KV, rotations and claims live
        # where the parameters are and the forwards run: host memory only under vLLM's engine (ModelSpec.weights)
        self.weights_device = torch.device("cpu") if spec.weights is WeightsPlacement.HOST else self.device
        self.dtype = TORCH_DTYPES[spec.dtype]
        load = dict(local_files_only=True, trust_remote_code=spec.trust_remote_code)
        config = AutoConfig.from_pretrained(self.path, **load)
        classes = family_classes(config.model_type)
        self.family = classes.family
        model_cls = getattr(transformers, classes.model_cls)
        self.model = model_cls.from_pretrained(
            self.path, dtype=self.dtype, attn_implementation=spec.attn_implementation, **load
        ).to(self.weights_device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(self.path, **load)
        size = ({"size": {"shortest_edge": spec.min_pixels, "longest_edge": spec.max_pixels}} if classes.pixel_budget
                else {})
        self.image_processor = getattr(transformers, classes.image_processor_cls).from_pretrained(
            self.path, **size, **load
        )
        self.adapter = Adapter(self.model, self.tokenizer, self.image_processor)
        self.cache_argument = cache_argument(self.model)  # `cache`, or `past_key_values` before transformers 5.20
        # re-anchoring matrices by Δ, cached; made on the KV's device, wherever the weights are (the rotary module
        # moves its inverse frequencies to its input's device: transformers' own code)
        self.rotations = RotationTable(self.adapter.rotation_matrices)
        self._prefixes: OrderedDict[tuple[int, ...], ChunkKV] = OrderedDict()  # text ids -> their KV, LRU
        self._prefixes_lock = threading.Lock()  # the generator's event loop and an engine's thread both ask
        self.fused: FusedDecoder | None = None  # the batched engine's forward, once `use_forward` chose it

    def use_forward(self, spec: ForwardSpec) -> None:
        """How the batched engine's forwards run from now on (serve/engine/qvpic/batch.py `forward`): the written-out
        forward where `spec.fused` and the decoder supports it, else transformers'."""
        self._weights_on_device("qvpic's engine")
        if spec.fused and not FusedDecoder.supports(self.model):
            if spec.matmul_dtype is not None or spec.compiled:
                raise ValueError(f"forward.matmul_dtype and forward.compiled need the fused forward, which "
                                 f"{self.family.value}'s decoder does not have")
            self.fused = None
            return
        self.fused = FusedDecoder(self.model, spec) if spec.fused else None
        if spec.compiled:
            self.fused.compiled = CompiledForward(self.fused)
            self.fused.compiled.warm_up(self.dtype, self.device)

    def positions(self, input_ids: torch.Tensor, grids: torch.Tensor | None, start: int = 0) -> torch.Tensor:
        """`(axes, 1, L)` positions of a sequence whose first token sits at `start`."""
        if grids is None:
            pos = torch.arange(start, start + input_ids.shape[1], device=input_ids.device)
            return pos.view(1, 1, -1).expand(self.adapter.rope_axes, 1, -1)
        return self.adapter.rope_index(input_ids, grids) + start

    @property
    def vocab_size(self) -> int:
        """Rows of the output projection: the logits' last dimension (ids a logit bias may name)."""
        return self.model.get_output_embeddings().weight.shape[0]

    @property
    def prefix(self) -> ChunkKV:
        """The serving template prefix's KV at positions 0..P-1, computed once."""
        return self.serving_prefix()

    def serving_prefix(self, instruction: str = "") -> ChunkKV:
        """KV of `[template prefix][instruction]` at positions 0..: exactly what a full prefill computes for those
        tokens (`text_kv`)."""
        return self.text_kv(self.adapter.prefix_ids + (self.adapter.encode(instruction) if instruction else []))

    def text_kv(self, ids: Sequence[int]) -> ChunkKV:
        """KV of text `ids` at positions 0.., one forward per distinct run of ids (the last `PREFIX_CACHE_SIZE`
        kept): the serving prefix of each instruction, or what a vLLM-engine claim starts with."""
        key = tuple(ids)
        with self._prefixes_lock:
            if key in self._prefixes:
                self._prefixes.move_to_end(key)
                return self._prefixes[key]
        with torch.inference_mode():
            kv = self._compile([(list(ids), None, None)], ChunkKind.TEXT, CompilePrefix.NONE)[0]
        with self._prefixes_lock:
            self._prefixes[key] = kv
            if len(self._prefixes) > PREFIX_CACHE_SIZE:
                self._prefixes.popitem(last=False)
        return kv

    # ---- online ------------------------------------------------------------------------------
    def assemble(self, chunks: Sequence[ChunkKV], instruction: str = "",
                 out: torch.Tensor | None = None) -> AssembledContext:
        """`[serving prefix][instruction][c_1]…[c_n]` in request order with keys re-anchored (into `out`
        when given, e.g. a row of a batch's slab)."""
        moved = [c if c.kv.device == self.device else _to(c, self.device) for c in chunks]
        return assemble(self.serving_prefix(instruction), moved, self.rotations, out)

    def query_turn_ids(self, query: str) -> list[int]:
        """The tokens prefilled online after the context: the query text (for the serving path, the plan's
        `text_after_chunks`: the query framed as the mode asks) and the turn's closing — the one framing that
        the batched engine, the full prefill and the query-only prefill all share."""
        return self.adapter.encode(query) + self.adapter.turn_suffix_ids

    @torch.inference_mode()
    def prefill_query(self, context: AssembledContext, query: str, all_logits: bool = False) -> Prefill:
        """Prefill only the query turn on top of an assembled context (logits of its last token, or all)."""
        cache = DynamicCache(ddp_cache_data=[(k.to(self.dtype), v.to(self.dtype)) for k, v in context.layers])
        ids = self.query_turn_ids(query)
        return self._forward(torch.tensor([ids], device=self.device), cache, context.next_position,
                             logits_to_keep=0 if all_logits else 1)

    @torch.inference_mode()
    def prefill_full(self, pieces: Sequence[str | Sequence[Image.Image]], query: str,
                     all_logits: bool = False) -> Prefill:
        """Baseline: one full prefill of `[prefix][pieces…][query turn]`; a piece is text or page images."""
        return self.prefill_segments([PreparedSegment(list(self.adapter.prefix_ids)),
                                      PreparedSegment(self.query_turn_ids(query))], [pieces], all_logits)

    def online_segment(self, texts: Sequence[PreparedSegment],
                       groups: Sequence[Sequence[str | Sequence[Image.Image]]]) -> PreparedSegment:
        """`[texts[0]][group 0][texts[1]] … [texts[n]]` as one run of ids (a conversation's layout, each group's
        chunks as text or pages): what an online mode prefills, and keys its prefix-cache blocks by. A page's
        identity is the sha256 of its pixels (rendering is deterministic: the same chunk, the same page)."""
        whole = PreparedSegment([])
        for i, text in enumerate(texts):
            start = len(whole.ids)
            whole.ids += text.ids
            whole.pixel_values += text.pixel_values
            whole.grids += text.grids
            whole.image_spans += [(first + start, end + start, digest) for first, end, digest in text.image_spans]
            for piece in groups[i] if i < len(groups) else ():
                if isinstance(piece, str):
                    whole.ids += self.adapter.encode(piece)
                    continue
                pixel_values, grids, page_ids = self.image_inputs(piece)
                digest = hashlib.sha256()
                for page in piece:
                    digest.update(f"{page.mode}:{page.width}x{page.height}:".encode())
                    digest.update(page.tobytes())
                first = len(whole.ids)
                whole.ids += page_ids
                whole.pixel_values.append(pixel_values)
                whole.grids.append(grids)
                whole.image_spans.append((first, len(whole.ids), "pages:" + digest.hexdigest()))
        return whole

    @torch.inference_mode()
    def prefill_segments(self, texts: Sequence[PreparedSegment],
                         groups: Sequence[Sequence[str | Sequence[Image.Image]]], all_logits: bool = False) -> Prefill:
        """One full prefill of `[texts[0]][group 0][texts[1]] … [texts[n]]` (`online_segment`)."""
        whole = self.online_segment(texts, groups)
        input_ids = torch.tensor([whole.ids], device=self.device)
        pixel_values = self.adapter.concat_pixels(whole.pixel_values) if whole.pixel_values else None
        grids = torch.cat(whole.grids) if whole.grids else None
        return self._forward(input_ids, DynamicCache(), 0, pixel_values, grids, logits_to_keep=0 if all_logits else 1)

    @torch.inference_mode()
    def extend(self, state: Prefill, token_ids: Sequence[int]) -> Prefill:
        """Teacher-force `token_ids` on top of `state` (whose cache grows): the logits after each of them."""
        ids = torch.tensor([list(token_ids)], device=self.device)
        return self._forward(ids, state.cache, state.next_position, logits_to_keep=0)

    @torch.inference_mode()
    def _forward(self, input_ids, cache, start, pixel_values=None, grids=None, logits_to_keep: int = 1) -> Prefill:
        """One forward at explicit positions from `start`; logits of the last `logits_to_keep` tokens (0 = all),
        since a full-vocabulary logits tensor over a long prompt costs gigabytes."""
        self._weights_on_device("a prefill or decode")
        positions = self.positions(input_ids, grids, start)
        mask = torch.ones(1, cache.get_seq_length() + input_ids.shape[1], dtype=torch.long, device=self.device)
        out = self.model(**self.adapter.model_inputs(input_ids, positions, pixel_values, grids), attention_mask=mask,
                         **{self.cache_argument: cache}, use_cache=True, logits_to_keep=logits_to_keep)
        # text alone: its positions run on from `start`, known without reading the device's back
        end = start + input_ids.shape[1] if grids is None else int(positions.max()) + 1
        return Prefill(out.logits, getattr(out, self.cache_argument), end)

    @torch.inference_mode()
    def decode(self, state: Prefill, sampling: Sampling) -> Iterator[int]:
        """Yield generated token ids until end-of-turn or `max_new_tokens` (the end token is not yielded)."""
        generator = None
        if sampling.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(sampling.seed)
        logits, cache, position = state.logits[:, -1], state.cache, state.next_position
        generated: list[int] = []
        for step_index in range(sampling.max_new_tokens):
            if sampling.adjusts_logits:
                logits = adjust_logits(logits, generated, sampling)
            token = select_token(logits, sampling, generator)
            if token in self.adapter.end_of_turn_ids:
                return
            generated.append(token)
            yield token
            if step_index + 1 == sampling.max_new_tokens:
                return  # no forward for a token nobody will read
            step = self._forward(torch.tensor([[token]], device=self.device), cache, position)
            logits, position = step.logits[:, -1], step.next_position

    def generate(self, state: Prefill, sampling: Sampling) -> list[int]:
        return list(self.decode(state, sampling))

    def _weights_on_device(self, what: str) -> None:
        """Prefill and decode keep their cache and logits with the weights: host-placed weights serve only the
        forwards whose KV is handed on (compile, `text_kv`), under vLLM's engine."""
        if self.weights_device != self.device:
            raise RuntimeError(f"{what} needs the model's weights on {self.device} (model.weights: device); they "
                               f"are in host memory (model.weights: host, for vLLM's engine)")


def _to(chunk: ChunkKV, device: torch.device) -> ChunkKV:
    return ChunkKV(chunk.kv.to(device), chunk.position_span, chunk.compile_start, chunk.kind, chunk.grid_thw,
                   chunk.vision_tokens)
