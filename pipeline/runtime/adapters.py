"""What differs between VLM families, behind one small interface.

Everything that can be read from the model itself is: the template prefix and image markup come from
the checkpoint's own chat template, the rotary layout from its own modeling module (Qwen rotates
halves of the head; GLM interleaves pairs and rotates only `partial_rotary_factor` of each head), the
end-of-turn tokens from its generation config, an image's token count from its own processor code.
What remains per family is which classes to load and how positions work: M-RoPE families (Qwen2-VL,
Qwen2.5-VL, GLM-4.1V) take `(3, 1, L)` positions where an image spans fewer positions than tokens;
1-D RoPE families (LLaVA-OneVision) take `(1, L)` positions and every token advances by one. The
runtime keeps positions as `(axes, 1, L)` and lets the adapter hand the model its own layout.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from schemas.config import ModelFamily
from schemas.modes import DUMMY_PREFIX_SEED, CompilePrefix

_SENTINEL = "\u2063QVPIC_USER_CONTENT\u2063"


@dataclass(frozen=True)
class FamilyClasses:
    family: ModelFamily
    model_cls: str  # transformers class names, resolved lazily
    image_processor_cls: str
    rotate_fn: str  # the LLM modeling module's rotation of key pairs: halves (Qwen) or interleaved pairs (GLM)
    rope_axes: int = 3  # 3: M-RoPE (t, h, w); 1: plain 1-D RoPE
    grid_key: str = "image_grid_thw"  # the processor output (and model input) that lays out each page
    pixel_budget: bool = True  # the image processor takes min/max pixels (`size` shortest/longest edge)


FAMILIES: dict[str, FamilyClasses] = {
    "qwen2_5_vl": FamilyClasses(ModelFamily.QWEN2_5_VL, "Qwen2_5_VLForConditionalGeneration",
                                "Qwen2VLImageProcessorPil", "rotate_half"),
    "qwen2_vl": FamilyClasses(ModelFamily.QWEN2_VL, "Qwen2VLForConditionalGeneration", "Qwen2VLImageProcessorPil",
                              "rotate_half"),
    "glm4v": FamilyClasses(ModelFamily.GLM4V, "Glm4vForConditionalGeneration", "Glm4vImageProcessorPil",
                           "rotate_half_llm"),
    # SigLIP tiles (AnyRes) projected into a Qwen2 LLM; `image_sizes` [pages, 2] lays out each page.
    "llava_onevision": FamilyClasses(ModelFamily.LLAVA_ONEVISION, "LlavaOnevisionForConditionalGeneration",
                                     "LlavaOnevisionImageProcessorPil", "rotate_half", rope_axes=1,
                                     grid_key="image_sizes", pixel_budget=False),
}


def family_classes(model_type: str) -> FamilyClasses:
    try:
        return FAMILIES[model_type]
    except KeyError:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {sorted(FAMILIES)}") from None


@dataclass(frozen=True)
class ChatTemplate:
    """The chat template cut where user content starts and ends.

    A templated prompt is `prefix` + user content + `turn_suffix`; an image item of user content is
    `image_before` + N image tokens + `image_after`. `images_first`: the template renders every image of a
    turn before any of its text, whatever the content's order (LLaVA-OneVision's does); the router then
    orders a request's context the same way (serve/routing/prompt.py `template_order`).
    """

    prefix: str
    turn_suffix: str
    image_before: str
    image_after: str
    images_first: bool = False

    @classmethod
    def from_tokenizer(cls, tokenizer, image_token: str) -> "ChatTemplate":
        def render(content: list[dict]) -> str:
            messages = [{"role": "user", "content": content}]
            return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

        text_only = render([{"type": "text", "text": _SENTINEL}])
        with_image = render([{"type": "image"}, {"type": "text", "text": _SENTINEL}])
        if text_only.count(_SENTINEL) != 1:
            raise ValueError("the chat template does not place user text exactly once")
        prefix, turn_suffix = text_only.split(_SENTINEL)
        if not with_image.startswith(prefix) or not with_image.endswith(_SENTINEL + turn_suffix):
            raise ValueError("the chat template renders images somewhere other than inside the user turn")
        markup = with_image[len(prefix) : with_image.index(_SENTINEL)]
        if markup.count(image_token) != 1:
            raise ValueError(f"image markup {markup!r} does not hold the image token {image_token!r} once")
        image_before, image_after = markup.split(image_token)
        text_then_image = render([{"type": "text", "text": _SENTINEL}, {"type": "image"}])
        images_first = text_then_image.index(image_token) < text_then_image.index(_SENTINEL)
        return cls(prefix, turn_suffix, image_before, image_after, images_first)


class Adapter:
    """Family-specific pieces of one loaded model, derived from the model itself."""

    def __init__(self, model, tokenizer, image_processor=None):
        self.model = model
        self.tokenizer = tokenizer
        classes = family_classes(model.config.model_type)
        self.family, self.rope_axes, self.grid_key = classes.family, classes.rope_axes, classes.grid_key
        # The model's own rotary code: frequencies and M-RoPE sections from its rotary module, the pair
        # layout from its LLM's modeling module.
        self._rotate_pairs = getattr(sys.modules[type(model.model.language_model).__module__], classes.rotate_fn)
        self.image_token_id: int = model.config.image_token_id
        self.merge_size: int = getattr(model.config.vision_config, "spatial_merge_size", 1)
        self.template = ChatTemplate.from_tokenizer(tokenizer, tokenizer.convert_ids_to_tokens(self.image_token_id))
        self._count_image_tokens = _llava_token_counter(model.config, image_processor) \
            if classes.family is ModelFamily.LLAVA_ONEVISION else None

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    @cached_property
    def prefix_ids(self) -> list[int]:
        return self.encode(self.template.prefix)

    @cached_property
    def dummy_prefix_ids(self) -> list[int]:
        """As many tokens as the template prefix, drawn (seeded) from the ordinary vocabulary: the virtual
        prefix a chunk is compiled after in the dummy variant. No special or added token is drawn, so
        it carries no role, turn or image markup — only its length matches the template's."""
        tokenizer = self.tokenizer
        reserved = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
        ordinary = np.array([i for i in range(tokenizer.vocab_size) if i not in reserved])
        rng = np.random.default_rng(DUMMY_PREFIX_SEED)
        return [int(i) for i in rng.choice(ordinary, size=len(self.prefix_ids), replace=True)]

    def compile_prefix_ids(self, prefix: CompilePrefix) -> list[int]:
        """Token ids a chunk is compiled after (their KV is stripped): template, none, or dummy."""
        return {CompilePrefix.TEMPLATE: self.prefix_ids, CompilePrefix.NONE: [],
                CompilePrefix.DUMMY: self.dummy_prefix_ids}[CompilePrefix(prefix)]

    @cached_property
    def turn_suffix_ids(self) -> list[int]:
        return self.encode(self.template.turn_suffix)

    @cached_property
    def _image_markup_ids(self) -> tuple[list[int], list[int]]:
        return self.encode(self.template.image_before), self.encode(self.template.image_after)

    def image_ids(self, grid: torch.Tensor) -> list[int]:
        """Token ids of one page: its markup around its image tokens. `grid` is the page's row of the
        processor's layout output: a patch grid (t, h, w) → t·h·w/merge² tokens (M-RoPE families), or
        the page's (height, width) → the AnyRes token count of LLaVA-OneVision's own processor."""
        before, after = self._image_markup_ids
        if self._count_image_tokens is not None:
            num_image_tokens = self._count_image_tokens(*(int(v) for v in grid))
        else:
            num_image_tokens = int(grid.prod()) // self.merge_size**2
        return before + [self.image_token_id] * num_image_tokens + after

    def model_inputs(self, input_ids: torch.Tensor, positions: torch.Tensor, pixel_values: torch.Tensor | None,
                     grids: torch.Tensor | None) -> dict:
        """Keyword arguments of the model's forward for `input_ids` at `positions` `(axes, 1, L)`."""
        inputs = {"input_ids": input_ids, "pixel_values": pixel_values}
        if self.rope_axes == 1:
            return {**inputs, "image_sizes": grids, "position_ids": positions[0]}  # (1, L)
        mm_token_type_ids = (input_ids == self.image_token_id).int() if grids is not None else None
        return {**inputs, "image_grid_thw": grids, "mm_token_type_ids": mm_token_type_ids, "position_ids": positions}

    def concat_pixels(self, pixel_values: list[torch.Tensor]) -> torch.Tensor:
        """Several pieces' pixel values as one model input, pages in order of appearance."""
        if self.rope_axes == 3:
            return torch.cat(pixel_values)  # flattened patches [patches, channels]
        # LLaVA-OneVision: [pages, tiles, 3, H, W], tiles padded to the largest (the model reads only its own)
        tiles = max(p.shape[1] for p in pixel_values)
        return torch.cat([torch.nn.functional.pad(p, (0, 0, 0, 0, 0, 0, 0, tiles - p.shape[1])) for p in pixel_values])

    @cached_property
    def end_of_turn_ids(self) -> frozenset[int]:
        eos = self.model.generation_config.eos_token_id
        return frozenset([eos] if isinstance(eos, int) else (eos or []))

    def rope_index(self, input_ids: torch.Tensor, grids: torch.Tensor | None) -> torch.Tensor:
        """Positions `(axes, 1, L)` of a sequence starting at position 0 (M-RoPE: the model's own code)."""
        if self.rope_axes == 1:
            return torch.arange(input_ids.shape[1], device=input_ids.device).view(1, 1, -1)
        mm_token_type_ids = (input_ids == self.image_token_id).int()
        positions, _ = self.model.model.get_rope_index(
            input_ids, mm_token_type_ids=mm_token_type_ids, image_grid_thw=grids
        )
        return positions

    @property
    def rotary_emb(self) -> torch.nn.Module:
        return self.model.model.language_model.rotary_emb

    def rotate_keys_(self, keys: torch.Tensor, delta_per_token: torch.Tensor) -> None:
        """Shift cached keys in place by a per-token position delta, with the model's rotary layout.

        keys: `[..., tokens, head_dim]`, already rotated to their compile-time positions p.
        Rotations compose (R(p+Δ) = R(Δ)·R(p)), and an equal shift on t/h/w makes M-RoPE a 1-D
        rotation, so rotating by the model's angles at position Δ moves every key to p+Δ. Only the
        first `rotary_dim` channels rotate (GLM: half the head). Arithmetic is float32, cast back once;
        in place because this runs on every request over every cached token.
        """
        positions = delta_per_token.view(1, 1, -1).expand(self.rope_axes, 1, -1)  # (axes, batch=1, tokens)
        if self.rope_axes == 1:
            positions = positions[0]  # 1-D RoPE takes (batch, tokens)
        probe = torch.empty(0, device=keys.device, dtype=torch.float32)
        cos, sin = self.rotary_emb(probe, positions)  # [1, tokens, rotary_dim] (M-RoPE: in (t, h, w) sections)
        rotary = keys[..., : cos.shape[-1]]
        work = rotary.float()  # the same tensor when keys are float32
        rotated_pairs = self._rotate_pairs(work)
        work.mul_(cos[0]).addcmul_(rotated_pairs, sin[0])
        if work is not rotary:
            rotary.copy_(work)

    def rotation_matrices(self, deltas: torch.Tensor, head_dim: int) -> torch.Tensor:
        """`[n, head_dim, head_dim]` float32 matrices M_Δ with rotate(k, Δ) = k @ M_Δ, one per delta.

        Rotation is linear, so M_Δ's rows are the basis vectors rotated by the model's own code:
        the same layout (halves, interleaved pairs, pass-through channels of partial rotary) for free.
        A chunk's keys all shift by one Δ, so one matrix re-anchors the whole chunk; where it pairs channels
        only across halves (Qwen), `RotationTable.halves` reads per-channel factors off it instead, which two
        elementwise passes apply faster than the product (pipeline/runtime/kv.py).
        """
        basis = torch.eye(head_dim, device=deltas.device).repeat(deltas.numel(), 1)  # [n·head_dim, head_dim]
        self.rotate_keys_(basis.unsqueeze(0), deltas.repeat_interleave(head_dim))
        return basis.view(deltas.numel(), head_dim, head_dim)


def _llava_token_counter(config, image_processor):
    """(height, width) of a page → its image tokens, by LLaVA-OneVision's own processor code (AnyRes tiles,
    unpadding, newline features, the `anyres_max_N` cap), configured from the checkpoint. Each page is
    laid out as a single image (the model is called without `batch_num_images`), so its tokens do not
    depend on which other pages share the request: what a chunk compiles is what full prefill sees."""
    from transformers import LlavaOnevisionProcessor

    if image_processor is None:
        raise ValueError("LLaVA-OneVision needs its image processor to count image tokens")
    vision = config.vision_config
    counter = LlavaOnevisionProcessor.__new__(LlavaOnevisionProcessor)  # only its counting methods are used
    counter.image_processor = image_processor
    counter.num_image_tokens = (vision.image_size // vision.patch_size) ** 2
    counter.vision_aspect_ratio = config.vision_aspect_ratio
    tile = image_processor.size["height"], image_processor.size["width"]
    drop_cls = config.vision_feature_select_strategy == "default"

    def count(height: int, width: int) -> int:
        return counter._get_number_of_features(height, width, *tile) - drop_cls

    return count
