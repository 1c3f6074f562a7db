"""The offline model factory is deterministic and its checkpoints load through the real path."""

from __future__ import annotations

import filecmp
import json
import shutil

import pytest

from pipeline.runtime import ensure_model, model_identity, resolve_path
from pipeline.runtime.tiny import BUILTIN, build
from schemas.config import ModelFamily, ModelSpec


def test_builds_are_byte_identical(tmp_path):
    first, second = build("tiny-glm", tmp_path / "a"), build("tiny-glm", tmp_path / "b")
    for name in ("model.safetensors", "config.json", "tokenizer.json", "preprocessor_config.json"):
        assert filecmp.cmp(first / name, second / name, shallow=False), name


@pytest.mark.parametrize("name", [n for n in BUILTIN if n.startswith("tiny-")])
def test_identity_names_the_family_and_the_template_prefix(name):
    """The prefix is checked against the checkpoint's own chat template, rendered by its tokenizer and cut where
    the user's content starts, not against what model_identity computes."""
    from transformers import AutoTokenizer

    model_id, revision, family, prefix = model_identity(ModelSpec(path=name))
    assert (model_id, family) == (name, BUILTIN[name][0]) and revision == ensure_model(name).name.rsplit("-", 1)[-1]
    tokenizer = AutoTokenizer.from_pretrained(ensure_model(name), local_files_only=True)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": "\x01"}]}],
                                             tokenize=False, add_generation_prompt=True)
    assert prefix == rendered[:rendered.index("\x01")]
    assert prefix.startswith({ModelFamily.QWEN2_5_VL: "<|im_start|>system", ModelFamily.QWEN2_VL: "<|im_start|>system",
                              ModelFamily.GLM4V: "[gMASK]<sop>",
                              ModelFamily.LLAVA_ONEVISION: "<|im_start|>user"}[family])


def test_local_revision_follows_the_config_and_the_weight_files(tmp_path):
    """A local checkpoint's revision changes with its config or its weight files and with nothing else: not
    with a file's mtime, nor with where the directory is mounted; a pinned revision is taken as given."""
    checkpoint = tmp_path / "a" / "ckpt"
    shutil.copytree(ensure_model("tiny-qwen"), checkpoint)
    revision = lambda path=checkpoint: model_identity(ModelSpec(path=str(path)))[1]  # noqa: E731
    first = revision()
    moved = tmp_path / "elsewhere" / "ckpt"
    shutil.copytree(checkpoint, moved)
    (moved / "model.safetensors").touch()
    assert revision(moved) == first  # same name and bytes, another mount and mtime

    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, "qvpic_note": "edited"}))
    after_config = revision()
    with (checkpoint / "model.safetensors").open("ab") as weights:
        weights.write(b"\0" * 8)
    after_weights = revision()
    (checkpoint / "extra.safetensors").write_bytes(b"\0" * 8)
    after_new_file = revision()
    assert len({first, after_config, after_weights, after_new_file}) == 4
    assert model_identity(ModelSpec(path=str(checkpoint), revision="v1.2"))[1] == "v1.2"


def test_local_directory_identity_and_errors(tmp_path):
    path = ensure_model("tiny-qwen")
    model_id, revision, _, _ = model_identity(ModelSpec(path=str(path)))
    assert model_id == path.name and len(revision) == 16
    with pytest.raises(FileNotFoundError, match="no config.json"):
        resolve_path(ModelSpec(path=str(tmp_path)))
    with pytest.raises(KeyError, match="unknown built-in"):
        ensure_model("tiny-llama")
