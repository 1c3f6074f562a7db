"""Offline model factory: deterministic random-weight VLM checkpoints of real architectures.

No weights can be downloaded here, so tests, the demo and benchmarks build small Qwen2.5-VL, Qwen2-VL,
GLM-4.1V and LLaVA-OneVision checkpoints from configs, with a BPE tokenizer trained in memory and a short
approximation of the family's chat template (or a real one passed in, as tests/pipeline/runtime/test_chat_templates.py
does), and
`save_pretrained` them to a local directory. Everything downstream then loads them with
the same `from_pretrained(local_dir, local_files_only=True)` path a real checkpoint takes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from pipeline.runtime.tiny_tokenizer import (
    GLM_CHAT_TEMPLATE,
    GLM_SPECIALS,
    LLAVA_CHAT_TEMPLATE,
    LLAVA_SPECIALS,
    QWEN_CHAT_TEMPLATE,
    QWEN_SPECIALS,
    build_tokenizer,
)
from schemas.config import ModelFamily

TINY_ROOT_ENV = "QVPIC_MODEL_CACHE"
_FACTORY_VERSION = "1"  # bump when anything below (or tiny_tokenizer.py) changes the produced checkpoint


@dataclass(frozen=True)
class TinySize:
    """LLM and vision-tower dimensions of one built-in checkpoint."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vision_depth: int
    vision_hidden_size: int
    vision_heads: int
    vocab_size: int = 4096
    init_std: float = 0.02  # the LLM's initializer_range (transformers' default); larger: peakier attention
    # Weights drawn by numpy's PCG64 and rounded to a 2^-12 grid: the same bits on every CPU. torch's normal_ runs
    # an AVX2 kernel on some CPUs and a scalar one on others (different roundings), and a recording stamped with
    # the weights' hash (the vLLM oracle's) must not go stale on another machine.
    portable: bool = False


SIZES = {
    "tiny": TinySize(64, 2, 4, 2, 128, vision_depth=2, vision_hidden_size=32, vision_heads=2),
    # The smallest size vLLM's CPU attention takes (head_dim 64; it refuses 16): the vLLM oracle's recorded tokens
    # (tests/data/vllm_oracle.json) are this checkpoint's, so CI compares against them without vLLM.
    # Its LLM's weights are drawn wider than the default so that attention is not near-uniform: a misplaced token
    # (the oracle's controls) then moves the logits far above the two engines' float rounding. The vision tower
    # keeps the default: wide there, its activations grow and so does the engines' rounding gap on images.
    "oracle": TinySize(128, 2, 2, 1, 256, vision_depth=2, vision_hidden_size=64, vision_heads=2, init_std=0.1,
                       portable=True),
    # The oracle's size with two KV heads: vLLM's tensor parallelism gives each of two ranks its own head
    # (tests/serve/engine/vllm/test_vllm_tp.py); with the oracle's one, both ranks would hold the same.
    "tp": TinySize(128, 2, 2, 2, 256, vision_depth=2, vision_hidden_size=64, vision_heads=2, init_std=0.1,
                   portable=True),
    # ~100M LLM parameters: the size the benchmarks use.
    "bench": TinySize(768, 12, 12, 2, 2048, vision_depth=4, vision_hidden_size=256, vision_heads=4),
}
BUILTIN = {
    "tiny-qwen": (ModelFamily.QWEN2_5_VL, "tiny"),
    "tiny-qwen2": (ModelFamily.QWEN2_VL, "tiny"),
    "tiny-glm": (ModelFamily.GLM4V, "tiny"),
    "tiny-llava": (ModelFamily.LLAVA_ONEVISION, "tiny"),
    "oracle-qwen": (ModelFamily.QWEN2_5_VL, "oracle"),
    "tp-qwen": (ModelFamily.QWEN2_5_VL, "tp"),
    "bench-qwen": (ModelFamily.QWEN2_5_VL, "bench"),
    "bench-glm": (ModelFamily.GLM4V, "bench"),
}




def _text_config(size: TinySize, vocab_size: int, rope_parameters: dict, **token_ids) -> dict:
    return dict(
        vocab_size=vocab_size, hidden_size=size.hidden_size, intermediate_size=size.intermediate_size,
        num_hidden_layers=size.num_layers, num_attention_heads=size.num_heads, num_key_value_heads=size.num_kv_heads,
        max_position_embeddings=32768, rope_parameters=rope_parameters, **token_ids,
        **({"initializer_range": size.init_std} if size.init_std != 0.02 else {}),
    )


def _qwen_model(size: TinySize, tok):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessorPil

    head_dim = size.hidden_size // size.num_heads
    section = _mrope_section(head_dim // 2)
    ids = tok.convert_tokens_to_ids
    config = Qwen2_5_VLConfig(
        text_config=_text_config(
            size, len(tok), {"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": section},
            eos_token_id=ids("<|im_end|>"), pad_token_id=ids("<|endoftext|>"), bos_token_id=ids("<|endoftext|>"),
        ),
        vision_config=dict(
            depth=size.vision_depth, hidden_size=size.vision_hidden_size, num_heads=size.vision_heads,
            intermediate_size=2 * size.vision_hidden_size, out_hidden_size=size.hidden_size,
            fullatt_block_indexes=[size.vision_depth - 1],
        ),
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"), bos_token_id=ids("<|endoftext|>"),
        eos_token_id=ids("<|im_end|>"), pad_token_id=ids("<|endoftext|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
    )
    return Qwen2_5_VLForConditionalGeneration(config), Qwen2VLImageProcessorPil()


def _qwen2_model(size: TinySize, tok):
    """Qwen2-VL: Qwen2.5-VL's LLM, chat template and M-RoPE; an older vision tower (LayerNorm, no window attention)."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessorPil

    head_dim = size.hidden_size // size.num_heads
    ids = tok.convert_tokens_to_ids
    config = Qwen2VLConfig(
        text_config=_text_config(
            size, len(tok), {"rope_type": "default", "rope_theta": 1_000_000.0,
                             "mrope_section": _mrope_section(head_dim // 2)},
            eos_token_id=ids("<|im_end|>"), pad_token_id=ids("<|endoftext|>"), bos_token_id=ids("<|endoftext|>"),
        ),
        vision_config=dict(depth=size.vision_depth, embed_dim=size.vision_hidden_size, hidden_size=size.hidden_size,
                           num_heads=size.vision_heads, mlp_ratio=2),
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"), bos_token_id=ids("<|endoftext|>"),
        eos_token_id=ids("<|im_end|>"), pad_token_id=ids("<|endoftext|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
    )
    return Qwen2VLForConditionalGeneration(config), Qwen2VLImageProcessorPil()


LLAVA_TILE_PX = 56  # SigLIP tile side of the tiny LLaVA (real: 384): 4x4 patches of 14 px per tile


def _llava_model(size: TinySize, tok):
    """LLaVA-OneVision: SigLIP tiles (AnyRes up to `anyres_max_9`) projected into a Qwen2 LLM with 1-D RoPE."""
    from transformers import (
        LlavaOnevisionConfig,
        LlavaOnevisionForConditionalGeneration,
        LlavaOnevisionImageProcessorPil,
    )

    ids = tok.convert_tokens_to_ids
    pinpoints = [[LLAVA_TILE_PX * i, LLAVA_TILE_PX * j] for i in range(1, 7) for j in range(1, 7)]
    config = LlavaOnevisionConfig(
        text_config=dict(model_type="qwen2", **_text_config(
            size, len(tok), {"rope_type": "default", "rope_theta": 1_000_000.0},
            eos_token_id=ids("<|im_end|>"), pad_token_id=ids("<|endoftext|>"), bos_token_id=ids("<|endoftext|>"))),
        vision_config=dict(model_type="siglip_vision_model", hidden_size=size.vision_hidden_size,
                           intermediate_size=2 * size.vision_hidden_size, num_hidden_layers=size.vision_depth,
                           num_attention_heads=size.vision_heads, image_size=LLAVA_TILE_PX, patch_size=14,
                           vision_use_head=False),
        image_token_index=ids("<image>"), video_token_index=ids("<video>"), image_grid_pinpoints=pinpoints,
        vision_feature_select_strategy="full", vision_feature_layer=-1, vision_aspect_ratio="anyres_max_9",
        eos_token_id=ids("<|im_end|>"), pad_token_id=ids("<|endoftext|>"),
    )
    processor = LlavaOnevisionImageProcessorPil(size={"height": LLAVA_TILE_PX, "width": LLAVA_TILE_PX},
                                                image_grid_pinpoints=pinpoints)
    return LlavaOnevisionForConditionalGeneration(config), processor


def _glm_model(size: TinySize, tok):
    from transformers import Glm4vConfig, Glm4vForConditionalGeneration, Glm4vImageProcessorPil

    head_dim = size.hidden_size // size.num_heads
    section = _mrope_section(head_dim // 4)  # partial_rotary_factor 0.5: half of each head rotates
    ids = tok.convert_tokens_to_ids
    config = Glm4vConfig(
        text_config=_text_config(
            size, len(tok), {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section,
                             "partial_rotary_factor": 0.5},
            eos_token_id=[ids("<|endoftext|>"), ids("<|user|>"), ids("<|observation|>")],
            pad_token_id=ids("<|endoftext|>"),
        ),
        vision_config=dict(
            depth=size.vision_depth, hidden_size=size.vision_hidden_size, num_heads=size.vision_heads,
            intermediate_size=size.hidden_size, out_hidden_size=size.hidden_size,
        ),
        image_token_id=ids("<|image|>"), video_token_id=ids("<|video|>"),
        image_start_token_id=ids("<|begin_of_image|>"), image_end_token_id=ids("<|end_of_image|>"),
        video_start_token_id=ids("<|begin_of_video|>"), video_end_token_id=ids("<|end_of_video|>"),
    )
    return Glm4vForConditionalGeneration(config), Glm4vImageProcessorPil()


def _redraw_portably(model, seed: int, std: float) -> None:
    """Every matrix redrawn from numpy's PCG64 (the LLM's at `std`, the vision tower's at transformers' 0.02), rounded
    to 2^-12; vectors (norm weights, biases) stay as initialised (ones and zeros: exact on every CPU)."""
    import numpy as np
    import torch

    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if param.dim() < 2:
                continue
            scale = 0.02 if ".visual." in f".{name}" else std
            drawn = np.round(rng.standard_normal(tuple(param.shape)) * scale * 4096) / 4096
            param.copy_(torch.from_numpy(drawn))


def _mrope_section(num_freqs: int) -> list[int]:
    """Split rotary frequencies over (t, h, w) in Qwen's 16:24:24 proportion; sums to `num_freqs`."""
    t = max(1, num_freqs // 4)
    h = (num_freqs - t) // 2
    return [t, h, num_freqs - t - h]


def build(name: str, out_dir: Path, seed: int = 0, chat_template: str | None = None) -> Path:
    """Materialise built-in checkpoint `name` into `out_dir` (tokenizer, image processor, weights), its chat
    template the family's approximation above unless `chat_template` (e.g. a real checkpoint's) is given."""
    family, size_name = BUILTIN[name]
    size = SIZES[size_name]
    specials, template, make = {
        ModelFamily.QWEN2_5_VL: (QWEN_SPECIALS, QWEN_CHAT_TEMPLATE, _qwen_model),
        ModelFamily.QWEN2_VL: (QWEN_SPECIALS, QWEN_CHAT_TEMPLATE, _qwen2_model),
        ModelFamily.GLM4V: (GLM_SPECIALS, GLM_CHAT_TEMPLATE, _glm_model),
        ModelFamily.LLAVA_ONEVISION: (LLAVA_SPECIALS, LLAVA_CHAT_TEMPLATE, _llava_model),
    }[family]
    import torch  # here: resolving a built checkpoint's path (every chunk actor does) needs no torch

    tok = build_tokenizer(specials, size.vocab_size, chat_template or template)
    torch.manual_seed(seed)
    model, image_processor = make(size, tok)
    if size.portable:
        _redraw_portably(model, seed, size.init_std)
    return publish(out_dir, model, tok, image_processor, "qvpic_builtin.json",
                   {"name": name, "seed": seed, "factory": _FACTORY_VERSION})


def publish(out_dir: Path, model, tok, image_processor, marker: str, identity: dict) -> Path:
    """Save a built checkpoint into `out_dir` atomically, `marker` (a JSON file of `identity`) last: readers
    never see a half-written checkpoint, and a directory without its marker is a leftover to replace."""
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    image_processor.save_pretrained(tmp)
    (tmp / "chat_template.jinja").write_text(tok.chat_template)
    (tmp / marker).write_text(json.dumps(identity))
    if not (out_dir / marker).exists():  # a leftover partial directory, never a published one
        shutil.rmtree(out_dir, ignore_errors=True)
    try:
        os.replace(tmp, out_dir)
    except OSError:  # another process published the same (deterministic) checkpoint first
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def cache_root() -> Path:
    return Path(os.environ.get(TINY_ROOT_ENV, Path.home() / ".cache" / "qvpic" / "models"))


def ensure_model(name: str, seed: int = 0) -> Path:
    """Local checkpoint directory of built-in `name`, built once and reused (also across processes)."""
    if name not in BUILTIN:
        raise KeyError(f"unknown built-in model {name!r}; known: {sorted(BUILTIN)}")
    tag = hashlib.sha256(f"{name}:{seed}:{_FACTORY_VERSION}".encode()).hexdigest()[:12]
    out_dir = cache_root() / f"{name}-{tag}"
    if not (out_dir / "qvpic_builtin.json").exists():
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        build(name, out_dir, seed)
    return out_dir
