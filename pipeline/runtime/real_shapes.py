"""Real-shape checkpoints: the public architectures of Qwen2.5-VL-7B-Instruct, GLM-4.1V-9B-Thinking and
LLaVA-OneVision-7B with every per-layer width, head dimension, rotary setting, vision patch/merge size and
window-attention layout of the real config, but 2 decoder layers, a 2-layer vision tower and the tiny
factory's vocabulary; random weights, float32, saved like any checkpoint (pipeline/runtime/tiny.py).

They exist for exactness at the real models' shapes (tests/pipeline/runtime/test_real_shapes.py,
benchmarks/quality/real_shapes.py):
a rotary-layout bug that toy head dimensions hide (rotary dim 8 for the tiny GLM) shows here, where
Qwen2.5-VL rotates 128 channels in (t, h, w) sections [16, 24, 24] and GLM-4.1V rotates 64 of 128 in
[8, 12, 12]. Every value below is read from a public source, named next to it (repository @ commit: path).

`Width.NARROW` keeps every one of those geometry settings (head dimensions, rotary sections and factor, patch,
merge and window sizes, the windowed/full block layout) but cuts each tower to two attention heads and a
small MLP: the equivalence checks exercise exactly the rotary layout and vision-token geometry, at a
hundredth of the weights, so CI can run them (a full-width model takes ~90 s to build on two cores). The
full widths run in benchmarks/quality/real_shapes.py.
"""

from __future__ import annotations

import hashlib
from enum import Enum
from pathlib import Path

import torch

from pipeline.runtime.tiny import cache_root, publish
from pipeline.runtime.tiny_tokenizer import (
    GLM_CHAT_TEMPLATE,
    GLM_SPECIALS,
    LLAVA_CHAT_TEMPLATE,
    LLAVA_SPECIALS,
    QWEN_CHAT_TEMPLATE,
    QWEN_SPECIALS,
    build_tokenizer,
)

DECODER_LAYERS = 2
VISION_LAYERS = 2
VOCAB_SIZE = 4096  # the tiny factory's BPE; the real vocabularies only widen the embedding tables
_FACTORY_VERSION = "1"  # bump when anything below changes the produced checkpoint
_MARKER = "qvpic_real_shape.json"

# Qwen2.5-VL-7B-Instruct. NVIDIA/TensorRT-LLM @ 03dd9bb8: tests/unittest/_torch/modeling/test_modeling_qwen2_5vl.py
# (QWEN2_5_VL_7B_CONFIG, the checkpoint's config.json with its layer counts cut): every value below but the
# full-attention blocks. Those, [7, 15, 23, 31] of 32: sophgo/LLM-TPU @ 5e1c5982:
# models/Qwen2_5_VL/config/config.json (same vision tower) and transformers' Qwen2_5_VLVisionConfig default.
QWEN2_5_VL_7B_TEXT = dict(
    hidden_size=3584, intermediate_size=18944, num_attention_heads=28, num_key_value_heads=4,  # head_dim 128
    rms_norm_eps=1e-06, max_position_embeddings=128000,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
)
QWEN2_5_VL_7B_VISION = dict(
    hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584, patch_size=14,
    spatial_merge_size=2, temporal_patch_size=2, window_size=112, tokens_per_second=2, hidden_act="silu",
    # the real tower: windowed blocks, every 8th full; cut to 2 blocks it keeps one of each, windowed first
    fullatt_block_indexes=[VISION_LAYERS - 1],
)

# GLM-4.1V-9B-Thinking. sophgo/LLM-TPU @ a79a7289: models/GLM4V/config/config.json (its README.md beside it is the
# GLM-4.1V-9B-Thinking model card); the same values are huggingface/transformers' Glm4vConfig defaults
# (checkpoint zai-org/GLM-4.1V-9B-Thinking) and convert_glm4v_mgt_weights_to_hf.py's output config.
GLM_4_1V_9B_TEXT = dict(
    hidden_size=4096, intermediate_size=13696, num_attention_heads=32, num_key_value_heads=2,  # head_dim 128
    rms_norm_eps=1e-05, max_position_embeddings=65536,  # (attention_bias true: built into Glm4vTextAttention)
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12],
                     "partial_rotary_factor": 0.5},
)
GLM_4_1V_9B_VISION = dict(
    hidden_size=1536, intermediate_size=13696, num_heads=12, out_hidden_size=4096, image_size=336, patch_size=14,
    spatial_merge_size=2, temporal_patch_size=2, attention_bias=False, rms_norm_eps=1e-05, hidden_act="silu",
)

# LLaVA-OneVision-7B (llava-hf/llava-onevision-qwen2-7b-ov-hf). huggingface/transformers @ d058e0f7:
# src/transformers/models/llava_onevision/convert_llava_onevision_weights_to_hf.py builds it from
# Qwen/Qwen2-7B-Instruct and SiglipVisionConfig(hidden 1152, image 384, MLP 4304, 16 heads, patch 14, no head);
# the rest (AnyRes pinpoints of 384-px tiles, anyres_max_9, "full" features, layer -1) are LlavaOnevisionConfig's
# defaults. Qwen2-7B's decoder has the widths of Qwen2.5-VL-7B's (TensorRT-LLM config above): 3584 wide,
# 28 heads of 128, 4 KV heads, MLP 18944, 1-D RoPE θ 1e6.
LLAVA_ONEVISION_7B_TEXT = dict(
    model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_attention_heads=28, num_key_value_heads=4,
    rms_norm_eps=1e-06, max_position_embeddings=32768,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
)
LLAVA_ONEVISION_7B_VISION = dict(
    model_type="siglip_vision_model", hidden_size=1152, intermediate_size=4304, num_attention_heads=16,
    image_size=384, patch_size=14, vision_use_head=False,
)

REAL_SHAPES = ("qwen2.5-vl-7b", "glm-4.1v-9b", "llava-onevision-7b")
NARROW_HEADS = 2  # attention heads per tower in Width.NARROW (one KV head: grouped-query attention stays on)
NARROW_MLP = 512  # MLP width of every narrowed tower


class Width(str, Enum):
    FULL = "full"  # every width of the public config
    NARROW = "narrow"  # the real head dimensions and geometry, two heads per tower (module docstring)


def narrowed(text: dict, vision: dict) -> tuple[dict, dict]:
    """(text, vision) config dicts with two heads of the real head dimension and a small MLP; every other
    key, the rotary and vision geometry included, as given."""
    head_dim = text["hidden_size"] // text["num_attention_heads"]
    text = dict(text, hidden_size=NARROW_HEADS * head_dim, num_attention_heads=NARROW_HEADS,
                num_key_value_heads=1, intermediate_size=NARROW_MLP)
    heads_key = "num_heads" if "num_heads" in vision else "num_attention_heads"  # SigLIP names it differently
    vision_head_dim = vision["hidden_size"] // vision[heads_key]
    vision = dict(vision, hidden_size=NARROW_HEADS * vision_head_dim, intermediate_size=NARROW_MLP,
                  **{heads_key: NARROW_HEADS})
    if "out_hidden_size" in vision:  # the merger projects into the decoder's width
        vision["out_hidden_size"] = text["hidden_size"]
    return text, vision


def _qwen(tok, width: Width):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessorPil

    ids = tok.convert_tokens_to_ids
    text, vision = _widths(QWEN2_5_VL_7B_TEXT, QWEN2_5_VL_7B_VISION, width)
    config = Qwen2_5_VLConfig(
        text_config=dict(text, vocab_size=len(tok), num_hidden_layers=DECODER_LAYERS,
                         eos_token_id=ids("<|im_end|>"), pad_token_id=ids("<|endoftext|>"),
                         bos_token_id=ids("<|endoftext|>")),
        vision_config=dict(vision, depth=VISION_LAYERS),
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"), bos_token_id=ids("<|endoftext|>"),
        eos_token_id=ids("<|im_end|>"), pad_token_id=ids("<|endoftext|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
    )
    return Qwen2_5_VLForConditionalGeneration(config), Qwen2VLImageProcessorPil()


def _glm(tok, width: Width):
    from transformers import Glm4vConfig, Glm4vForConditionalGeneration, Glm4vImageProcessorPil

    ids = tok.convert_tokens_to_ids
    text, vision = _widths(GLM_4_1V_9B_TEXT, GLM_4_1V_9B_VISION, width)
    config = Glm4vConfig(
        text_config=dict(text, vocab_size=len(tok), num_hidden_layers=DECODER_LAYERS,
                         eos_token_id=[ids("<|endoftext|>"), ids("<|user|>"), ids("<|observation|>")],
                         pad_token_id=ids("<|endoftext|>")),
        vision_config=dict(vision, depth=VISION_LAYERS),
        image_token_id=ids("<|image|>"), video_token_id=ids("<|video|>"),
        image_start_token_id=ids("<|begin_of_image|>"), image_end_token_id=ids("<|end_of_image|>"),
        video_start_token_id=ids("<|begin_of_video|>"), video_end_token_id=ids("<|end_of_video|>"),
    )
    return Glm4vForConditionalGeneration(config), Glm4vImageProcessorPil()


def _llava(tok, width: Width):
    from transformers import (
        LlavaOnevisionConfig,
        LlavaOnevisionForConditionalGeneration,
        LlavaOnevisionImageProcessorPil,
    )

    ids = tok.convert_tokens_to_ids
    text, vision = _widths(LLAVA_ONEVISION_7B_TEXT, LLAVA_ONEVISION_7B_VISION, width)
    config = LlavaOnevisionConfig(
        text_config=dict(text, vocab_size=len(tok), num_hidden_layers=DECODER_LAYERS,
                         eos_token_id=ids("<|im_end|>"), pad_token_id=ids("<|endoftext|>"),
                         bos_token_id=ids("<|endoftext|>")),
        vision_config=dict(vision, num_hidden_layers=VISION_LAYERS),
        image_token_index=ids("<image>"), video_token_index=ids("<video>"),
        eos_token_id=ids("<|im_end|>"), pad_token_id=ids("<|endoftext|>"),
    )
    return LlavaOnevisionForConditionalGeneration(config), LlavaOnevisionImageProcessorPil()


def _widths(text: dict, vision: dict, width: Width) -> tuple[dict, dict]:
    return narrowed(text, vision) if width is Width.NARROW else (text, vision)


_FAMILIES = {  # name -> (special tokens, the tiny factory's template of the family, model builder)
    "qwen2.5-vl-7b": (QWEN_SPECIALS, QWEN_CHAT_TEMPLATE, _qwen),
    "glm-4.1v-9b": (GLM_SPECIALS, GLM_CHAT_TEMPLATE, _glm),
    "llava-onevision-7b": (LLAVA_SPECIALS, LLAVA_CHAT_TEMPLATE, _llava),
}


def build(name: str, out_dir: Path, chat_template: str | None = None, seed: int = 0,
          width: Width = Width.FULL) -> Path:
    """Materialise real-shape checkpoint `name` into `out_dir`, with `chat_template` (default: the tiny
    factory's template of the family) saved as the checkpoint's `chat_template.jinja`."""
    specials, default_template, make = _FAMILIES[name]
    tok = build_tokenizer(specials, VOCAB_SIZE, chat_template or default_template)
    torch.manual_seed(seed)
    model, image_processor = make(tok, width)
    return publish(out_dir, model, tok, image_processor, _MARKER,
                   {"name": name, "seed": seed, "width": width.value, "factory": _FACTORY_VERSION})


def ensure_real_shape(name: str, chat_template: str | None = None, seed: int = 0,
                      width: Width = Width.FULL) -> Path:
    """Local checkpoint directory of real-shape `name` (with `chat_template`, at `width`), built once and reused."""
    if name not in _FAMILIES:
        raise KeyError(f"unknown real-shape model {name!r}; known: {list(REAL_SHAPES)}")
    key = f"{name}:{seed}:{width.value}:{_FACTORY_VERSION}:{chat_template or ''}"
    out_dir = cache_root() / f"real-{name}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    if not (out_dir / _MARKER).exists():
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        build(name, out_dir, chat_template, seed, width)
    return out_dir
