"""The offline model factory is deterministic and its checkpoints load through the real path."""

from __future__ import annotations

import filecmp

import pytest

from pipeline.runtime import model_identity, resolve_path
from pipeline.runtime.tiny import BUILTIN, build
from pipeline.runtime import ensure_model
from schemas.config import ModelFamily, ModelSpec


def test_builds_are_byte_identical(tmp_path):
    first, second = build("tiny-glm", tmp_path / "a"), build("tiny-glm", tmp_path / "b")
    for name in ("model.safetensors", "config.json", "tokenizer.json", "preprocessor_config.json"):
        assert filecmp.cmp(first / name, second / name, shallow=False), name


@pytest.mark.parametrize("name", [n for n in BUILTIN if n.startswith("tiny-")])
def test_identity_is_stable_and_names_the_family(name):
    model_id, revision, family, prefix = model_identity(ModelSpec(path=name))
    assert (model_id, revision, family, prefix) == model_identity(ModelSpec(path=name))
    assert family is BUILTIN[name][0]
    assert prefix.startswith({ModelFamily.QWEN2_5_VL: "<|im_start|>system", ModelFamily.QWEN2_VL: "<|im_start|>system",
                              ModelFamily.GLM4V: "[gMASK]<sop>", ModelFamily.LLAVA_ONEVISION: "<|im_start|>user"}[family])


def test_local_directory_identity_and_errors(tmp_path):
    path = ensure_model("tiny-qwen")
    model_id, revision, _, _ = model_identity(ModelSpec(path=str(path)))
    assert model_id == path.name and len(revision) == 16
    with pytest.raises(FileNotFoundError, match="no config.json"):
        resolve_path(ModelSpec(path=str(tmp_path)))
    with pytest.raises(KeyError, match="unknown built-in"):
        ensure_model("tiny-llama")
