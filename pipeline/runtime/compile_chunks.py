"""The offline compile of chunk KV, as methods of `VLM` (pipeline/runtime/model.py): each chunk, text or page
images, forwarded after its compile prefix, whose KV is then stripped. Several chunks of one kind go in one padded
forward.

The host class provides `model`, `tokenizer`, `adapter`, `family`, `image_processor`, `device`, `dtype`,
`cache_argument` and `positions`.
"""

from __future__ import annotations

from typing import Sequence

import torch
from PIL import Image
from transformers import DynamicCache

from pipeline.runtime.kv import ChunkKV
from pipeline.runtime.tokens import resized_size
from schemas.config import ModelFamily
from schemas.modes import ChunkKind, CompilePrefix, Variant


def fitted(family: ModelFamily, image_processor, page: Image.Image) -> Image.Image:
    """`page` in RGB, shrunk to the size the processor would resize it to, with the processor's resample filter.

    The processor then resizes nothing, and its copies and conversions run on the fitted pixels, not the upload's.
    The pixel values are the same, bit for bit (tests/pipeline/runtime/test_fitted.py). A 16 MP upload for
    tiny-qwen costs ~110 ms here and ~27 ms in the processor, against ~265 ms in the processor alone.
    LLaVA-OneVision tiles the image (its resize is not one resize) and is passed as is. So is an image the processor
    would enlarge: enlarging it here gives the same pixels and saves nothing.
    """
    page = page if page.mode == "RGB" else page.convert("RGB")
    if family is ModelFamily.LLAVA_ONEVISION:
        return page
    size = image_processor.size
    width, height = resized_size(family, page.width, page.height, min_pixels=size["shortest_edge"],
                                 max_pixels=size["longest_edge"])
    if width * height >= page.width * page.height:
        return page
    return page.resize((width, height), resample=image_processor.resample)


class ChunkCompiler:
    """`VLM`'s compile methods: a chunk's stored entry, of any variant."""

    # ---- compile (offline) -------------------------------------------------------------------
    def image_inputs(self, pages: Sequence[Image.Image]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Pixel values, the per-page layout (`[pages, 3]` patch grids, or LLaVA's `[pages, 2]` sizes) and the
        token ids of the pages in order."""
        processed = self.image_processor(images=[fitted(self.family, self.image_processor, p) for p in pages],
                                         return_tensors="pt")
        grids = processed[self.adapter.grid_key]
        ids = [tok for grid in grids for tok in self.adapter.image_ids(grid)]
        return processed["pixel_values"].to(self.weights_device, self.dtype), grids.to(self.weights_device), ids

    def compile_variant(self, variant: Variant, text: str = "", pages: Sequence[Image.Image] = ()) -> ChunkKV:
        """The stored entry of `variant`: the chunk's source text or its pages, after the variant's prefix."""
        if variant.kind is ChunkKind.TEXT:
            return self.compile_text(text, variant.prefix)
        return self.compile_images(pages, variant.prefix)

    @torch.inference_mode()
    def compile_images(self, pages: Sequence[Image.Image], prefix: CompilePrefix = CompilePrefix.TEMPLATE,
                       position_offset: int = 0) -> ChunkKV:
        """KV of one chunk's page images, compiled after `prefix` (whose KV is then stripped).

        `position_offset` shifts the whole compile sequence (prefix included) to start there.
        """
        return self.compile_many([pages], prefix, position_offset)[0]

    @torch.inference_mode()
    def compile_text(self, text: str, prefix: CompilePrefix = CompilePrefix.TEMPLATE,
                     position_offset: int = 0) -> ChunkKV:
        return self.compile_many([text], prefix, position_offset)[0]

    @torch.inference_mode()
    def compile_many(self, chunks: Sequence[str | Sequence[Image.Image]],
                     prefix: CompilePrefix = CompilePrefix.TEMPLATE, position_offset: int = 0) -> list[ChunkKV]:
        """KV of several chunks of one kind (all texts, or all page lists), each compiled after `prefix`
        (whose KV is then stripped), in one forward.

        Each sequence is `[prefix][chunk]` at its own explicit positions (`adapter.rope_axes` of them),
        right-padded to the longest: causal attention never lets a real token see the padding after it,
        and the padded keys are masked too, so every chunk's KV equals its single-chunk compile (to float
        rounding). Pages of every chunk go through the vision tower together, in order of appearance.
        Every family batches this way: the adapter lays out the model's inputs (M-RoPE or 1-D positions,
        patch grids or LLaVA-OneVision's image sizes and padded tiles).
        """
        if not chunks:
            return []
        kind = ChunkKind.TEXT if isinstance(chunks[0], str) else ChunkKind.IMAGE
        if any(isinstance(c, str) != (kind is ChunkKind.TEXT) for c in chunks):
            raise ValueError("compile_many takes chunks of one kind: all texts or all page lists")
        pieces = []  # (token ids, pixel values, layout) of each chunk
        for chunk in chunks:
            if kind is ChunkKind.TEXT:
                pieces.append((self.adapter.encode(chunk), None, None))
                if not pieces[-1][0]:
                    raise ValueError("cannot compile an empty text chunk")
            else:
                pixel_values, grids, chunk_ids = self.image_inputs(chunk)
                pieces.append((chunk_ids, pixel_values, grids))
        return self._compile(pieces, kind, prefix, position_offset)

    def _compile(self, pieces, kind: ChunkKind, prefix: CompilePrefix, position_offset: int = 0) -> list[ChunkKV]:
        """`[prefix][chunk]` of each `(chunk ids, pixel values, layout)` in one padded forward, the prefix stripped:
        run where the weights are, the KV returned on `device`."""
        prefix_ids = self.adapter.compile_prefix_ids(prefix)
        sequences = []
        for chunk_ids, _, grids in pieces:
            ids = torch.tensor([prefix_ids + chunk_ids], device=self.weights_device)
            sequences.append((ids, self.positions(ids, grids, position_offset), grids))
        pixel_list = [p for _, p, _ in pieces if p is not None]
        grid_list = [g for _, _, g in pieces if g is not None]
        out = self._forward_padded(sequences, self.adapter.concat_pixels(pixel_list) if pixel_list else None,
                                   torch.cat(grid_list) if grid_list else None)
        results = []
        for b, (ids, positions, grids) in enumerate(sequences):
            length, num_prefix = ids.shape[1], len(prefix_ids)
            # strip the prefix and the padding
            kv = stack_cache(getattr(out, self.cache_argument), b)[:, :, :, num_prefix:length]
            # Chunk positions restart wherever the prefix ended; the span is how far the next one moves.
            compile_start = int(positions[0, 0, num_prefix])
            span = int(positions[:, 0, num_prefix:].max()) + 1 - compile_start
            grid_rows = [tuple(int(v) for v in g) for g in grids] if grids is not None else []
            vision_tokens = int((ids[0, num_prefix:] == self.adapter.image_token_id).sum())
            kv = kv.clone() if kv.device == self.device else kv.to(self.device)  # one copy, the padding left behind
            results.append(ChunkKV(kv, span, compile_start, kind, grid_rows, vision_tokens))
        return results

    def _forward_padded(self, sequences, pixel_values, grids):
        """One forward over right-padded sequences `(ids [1, L_b], positions (axes, 1, L_b), grids)`."""
        longest = max(ids.shape[1] for ids, _, _ in sequences)
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        if pad_id == self.adapter.image_token_id:
            raise ValueError("the pad token is the image token: padded batches would misplace image features")
        axes = sequences[0][1].shape[0]
        device = self.weights_device
        input_ids = torch.full((len(sequences), longest), pad_id, dtype=torch.long, device=device)
        mask = torch.zeros(len(sequences), longest, dtype=torch.long, device=device)
        positions = torch.zeros(axes, len(sequences), longest, dtype=torch.long, device=device)
        for b, (ids, pos, _) in enumerate(sequences):
            length = ids.shape[1]
            input_ids[b, :length], mask[b, :length], positions[:, b, :length] = ids[0], 1, pos[:, 0]
            # Padding continues the positions; its keys are masked and its outputs discarded.
            positions[:, b, length:] = pos[:, 0, -1:] + torch.arange(1, longest - length + 1, device=device)
        return self.model(**self.adapter.model_inputs(input_ids, positions, pixel_values, grids),
                          attention_mask=mask if len(sequences) > 1 else None, use_cache=True, logits_to_keep=1)


def stack_cache(cache: DynamicCache, row: int = 0) -> torch.Tensor:
    """Batch row `row` of a model cache as one tensor `[layers, 2, kv_heads, tokens, head_dim]`."""
    return torch.stack([torch.stack([layer.keys[row], layer.values[row]]) for layer in cache.layers])

