"""Real-size VLMs with random weights, for speed on a GPU: the public architectures, no checkpoint.

Speed does not need trained weights, and none can be downloaded here. A "real-size" checkpoint is a
directory holding the public `config.json` architecture of the real model (layers, widths, heads,
vocabulary, vision tower, rotary layout), the tiny factory's offline tokenizer with the family's chat
template (its special-token ids patched into the config; the embedding table keeps the real
vocabulary size), and the family's image processor — but no weights. `random_weights()` makes
`from_pretrained` build such a model directly on its device with random initialisation (no CPU copy,
no 15 GB written to disk), once per process: the compile stage and the generator share it.

Sources (public config.json, read 2026-11; cross-checked against mirrors of the same file):
- Qwen/Qwen2.5-VL-7B-Instruct: https://huggingface.co/Qwen/Qwen2.5-VL-7B-Instruct/blob/main/config.json
  (vision_config lists only hidden_size 1280, in_chans 3, spatial_patch_size 14, tokens_per_second 2;
  the rest are Qwen2_5_VLVisionConfig's defaults: depth 32, 16 heads, MLP 3420, out 3584, window 112,
  full attention in blocks 7/15/23/31 — restated below so a transformers default change cannot move them)
- zai-org/GLM-4.1V-9B-Thinking: https://huggingface.co/zai-org/GLM-4.1V-9B-Thinking/blob/main/config.json
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
import transformers

from pipeline.runtime import (
    GLM_CHAT_TEMPLATE,
    GLM_SPECIALS,
    QWEN_CHAT_TEMPLATE,
    QWEN_SPECIALS,
    build_tokenizer,
    family_classes,
)

QWEN2_5_VL_7B = {
    "model_type": "qwen2_5_vl", "architectures": ["Qwen2_5_VLForConditionalGeneration"],
    "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
    "num_key_value_heads": 4, "hidden_act": "silu", "rms_norm_eps": 1e-06, "max_position_embeddings": 128000,
    "rope_theta": 1000000.0, "rope_scaling": {"type": "default", "rope_type": "default", "mrope_section": [16, 24, 24]},
    "vocab_size": 152064, "tie_word_embeddings": False, "attention_dropout": 0.0, "initializer_range": 0.02,
    "vision_config": {"hidden_size": 1280, "in_chans": 3, "spatial_patch_size": 14, "tokens_per_second": 2,
                      "depth": 32, "num_heads": 16, "intermediate_size": 3420, "out_hidden_size": 3584,
                      "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
                      "fullatt_block_indexes": [7, 15, 23, 31], "hidden_act": "silu"},
}
GLM_4_1V_9B = {
    "model_type": "glm4v", "architectures": ["Glm4vForConditionalGeneration"], "tie_word_embeddings": False,
    "text_config": {
        "model_type": "glm4v_text", "attention_bias": True, "attention_dropout": 0.0, "hidden_act": "silu",
        "hidden_size": 4096, "intermediate_size": 13696, "num_hidden_layers": 40, "num_attention_heads": 32,
        "num_key_value_heads": 2, "rms_norm_eps": 1e-05, "max_position_embeddings": 65536, "vocab_size": 151552,
        "partial_rotary_factor": 0.5, "rope_theta": 10000.0, "initializer_range": 0.02,
        "rope_scaling": {"rope_type": "default", "mrope_section": [8, 12, 12]},
    },
    "vision_config": {"model_type": "glm4v", "hidden_size": 1536, "depth": 24, "num_heads": 12, "attention_bias": False,
                      "intermediate_size": 13696, "hidden_act": "silu", "hidden_dropout_prob": 0.0,
                      "initializer_range": 0.02, "image_size": 336, "patch_size": 14, "out_hidden_size": 4096,
                      "rms_norm_eps": 1e-05, "spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3},
}
REAL_SIZE = {"qwen2.5-vl-7b": QWEN2_5_VL_7B, "glm-4.1v-9b": GLM_4_1V_9B}
_MARKER = "qvpic_real_size.json"


def materialise(name: str, root: Path, shrink: dict | None = None) -> Path:
    """A weightless checkpoint directory of real-size model `name` under `root` (built once).

    `shrink` (tests only) overrides text and vision fields, e.g. `{"text": {...}, "vision": {...}}`, so
    the same path can be exercised on a CPU with a model of the same layout but toy widths."""
    public = REAL_SIZE[name]
    out = root / (name if shrink is None else f"{name}-shrunk")
    if (out / _MARKER).exists():
        return out
    qwen = public["model_type"] == "qwen2_5_vl"
    tok = (build_tokenizer(QWEN_SPECIALS, 4096, QWEN_CHAT_TEMPLATE) if qwen
           else build_tokenizer(GLM_SPECIALS, 4096, GLM_CHAT_TEMPLATE))
    ids = tok.convert_tokens_to_ids
    config = json.loads(json.dumps(public))
    if shrink:
        (config if qwen else config["text_config"]).update(shrink.get("text", {}))
        config["vision_config"].update(shrink.get("vision", {}))
    if qwen:  # the public config's token ids are the real tokenizer's; ours are the tiny factory's
        config.update(image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
                      vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
                      bos_token_id=ids("<|endoftext|>"), eos_token_id=ids("<|im_end|>"),
                      pad_token_id=ids("<|endoftext|>"))
        eos = ids("<|im_end|>")
    else:
        config.update(image_token_id=ids("<|image|>"), video_token_id=ids("<|video|>"),
                      image_start_token_id=ids("<|begin_of_image|>"), image_end_token_id=ids("<|end_of_image|>"),
                      video_start_token_id=ids("<|begin_of_video|>"), video_end_token_id=ids("<|end_of_video|>"))
        eos = [ids("<|endoftext|>"), ids("<|user|>"), ids("<|observation|>")]
        config["text_config"].update(eos_token_id=eos, pad_token_id=ids("<|endoftext|>"))
    classes = family_classes(public["model_type"])
    config_cls = getattr(transformers, classes.model_cls).config_class
    out.mkdir(parents=True, exist_ok=True)
    config_cls.from_dict(config).save_pretrained(out)
    transformers.GenerationConfig(eos_token_id=eos).save_pretrained(out)
    tok.save_pretrained(out)
    (out / "chat_template.jinja").write_text(tok.chat_template)
    getattr(transformers, classes.image_processor_cls)().save_pretrained(out)
    (out / _MARKER).write_text(json.dumps({"name": name, "weights": "random, built on the device"}))
    return out


@contextlib.contextmanager
def random_weights(device: str, seed: int = 0):
    """While active, `from_pretrained` of a real-size directory builds the model on `device` with random
    weights (seeded), once per directory: later calls share that instance."""
    built: dict[str, torch.nn.Module] = {}
    patched = {}
    for classes in {family_classes(t) for t in ("qwen2_5_vl", "glm4v")}:
        cls = getattr(transformers, classes.model_cls)
        patched[cls] = cls.__dict__.get("from_pretrained")

        def from_pretrained(klass, path, *args, dtype=None, attn_implementation=None, **kwargs):
            key = str(Path(path).resolve())
            if not (Path(path) / _MARKER).exists():
                return super(klass, klass).from_pretrained(path, *args, dtype=dtype,
                                                           attn_implementation=attn_implementation, **kwargs)
            if key not in built:
                config = klass.config_class.from_pretrained(path)
                torch.manual_seed(seed)
                with torch.device(device):  # parameters are created and initialised on the device
                    built[key] = klass._from_config(config, dtype=dtype, attn_implementation=attn_implementation)
            return built[key]

        cls.from_pretrained = classmethod(from_pretrained)
    try:
        yield
    finally:
        for cls, original in patched.items():
            if original is None:
                del cls.from_pretrained
            else:
                cls.from_pretrained = original
