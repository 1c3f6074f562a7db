"""The compile prefix and the serving prompt from real checkpoints' chat templates (tests/fixtures/chat_templates/).

Each template is installed in a tiny checkpoint directory the two ways checkpoints ship one — `chat_template.jinja`
(GLM-4.1V) and `tokenizer_config.json`'s `chat_template` (Qwen2.5-VL-Instruct, llava-hf) — and read through the
project's loading path (`model_identity`, which fingerprints a store, and `VLM`). The expected prefixes are worked
out by hand from the template text (transformers renders with `trim_blocks` and `lstrip_blocks`: a block tag eats
the newline after it, `{%-` the whitespace before it); the serving prompt is compared token for token with
transformers' `apply_chat_template` of the same message, each image token expanded to the page's count as the
model's processor does. Negative controls: a one-character slip in a template moves the prefix off its literal
and the serving prompt off `apply_chat_template`.
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Mapping
from pathlib import Path

import pytest

from pipeline.runtime import VLM, model_identity
from pipeline.runtime.tiny import build
from schemas.config import ModelSpec
from serve.plan import PlannedChunk
from serve.routing.prompt import template_order
from tests.pipeline.runtime.test_runtime_exactness import page, page_block
from tests.support.paths import TESTS

FIXTURES = TESTS / "fixtures" / "chat_templates"
QUERY = "Which part number ships on 12 March?"
CHUNK = "Invoice 88213 lists part XK-4471-B, shipped to Oslo.\n"
PLACEMENTS = ["chat_template.jinja", "tokenizer_config.json"]
# template -> (built-in family it is installed in, hand-worked prefix, a one-character slip in the template,
# the user content in the order the template keeps it: LLaVA-OneVision's renders every image before any text)
CASES = {
    "qwen2_5_vl_instruct": (
        "tiny-qwen", "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n",
        ("You are a helpful assistant.", "You are a helpful assistant"), ["image", "text", "image"]),
    "glm4_1v_thinking": (
        "tiny-glm", "[gMASK]<sop><|user|>\n", ("<|user|>{{ '\\n' }}", "<|user|>"), ["image", "text", "image"]),
    "llava_onevision": (
        "tiny-llava", "<|im_start|>user\n", ("message['role'] + '\n'", "message['role']"), ["image", "image", "text"]),
}


def fixture_template(name: str) -> str:
    return (FIXTURES / f"{name}.jinja").read_text()


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory) -> tuple[str, Path]:
    """A tiny checkpoint of the template's family carrying the real template (as `chat_template.jinja`)."""
    family = CASES[request.param][0]
    out = tmp_path_factory.mktemp(request.param) / "checkpoint"
    return request.param, build(family, out, chat_template=fixture_template(request.param))


def install(checkpoint: Path, template: str, placement: str, into: Path) -> Path:
    """A copy of `checkpoint` that carries `template` only where `placement` says."""
    copy = into / placement.replace(".", "_")
    shutil.copytree(checkpoint, copy)
    (copy / "chat_template.jinja").unlink()
    if placement == "chat_template.jinja":
        (copy / placement).write_text(template)
    else:
        config = json.loads((copy / placement).read_text())
        (copy / placement).write_text(json.dumps({**config, "chat_template": template}))
    return copy


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_compile_prefix_is_cut_from_the_checkpoint_template(checkpoint, placement, tmp_path):
    name, path = checkpoint
    _, prefix, slip, _ = CASES[name]
    assert model_identity(ModelSpec(path=str(install(path, fixture_template(name), placement, tmp_path))))[3] == prefix
    # negative control: one character off in the template moves the prefix off the literal
    slipped = fixture_template(name).replace(*slip)
    assert slipped != fixture_template(name)
    moved = tmp_path / "slipped"
    moved.mkdir()
    assert model_identity(ModelSpec(path=str(install(path, slipped, placement, moved))))[3] != prefix


def expected_ids(vlm: VLM, template: str, content: list[dict], pages: list) -> list[int]:
    """`apply_chat_template` token ids of one user turn, each image token expanded to its page's image tokens
    (the count the model's vision path produces for that page, as its processor expands it)."""
    rendered = vlm.tokenizer.apply_chat_template([{"role": "user", "content": content}], chat_template=template,
                                                 add_generation_prompt=True, tokenize=True)
    ids = rendered["input_ids"] if isinstance(rendered, Mapping) else rendered
    image_id = vlm.model.config.image_token_id
    counts = iter(len(page_block(vlm, [p], [], [])[0]) for p in pages)
    return [t for i in ids for t in ([image_id] * next(counts) if i == image_id else [i])]


def test_serving_prompt_matches_apply_chat_template(checkpoint, tmp_path):
    """The prompt the serving path prefills — serving prefix, the chunks' ids as compiled, the query turn — is
    the checkpoint's own rendering of one user turn holding those chunks and the query, token for token."""
    name, path = checkpoint
    order = CASES[name][3]
    vlm = VLM(ModelSpec(path=str(install(path, fixture_template(name), "tokenizer_config.json", tmp_path)),
                        device="cpu"))
    rng = random.Random(4)
    pages = [page(rng, 140, 98), page(rng, 84, 56)]
    content, ours, page_iter = [], list(vlm.adapter.prefix_ids), iter(pages)
    for kind in order:
        if kind == "image":
            content.append({"type": "image"})
            ours += vlm.image_inputs([next(page_iter)])[2]
        else:
            content.append({"type": "text", "text": CHUNK})
            ours += vlm.adapter.encode(CHUNK)
    content.append({"type": "text", "text": QUERY})
    ours += vlm.query_turn_ids(QUERY)
    assert ours == expected_ids(vlm, fixture_template(name), content, pages)
    # negative control: the checkpoint's rendering under the slipped template differs from the serving prompt
    slipped = fixture_template(name).replace(*CASES[name][2])
    assert ours != expected_ids(vlm, slipped, content, pages)


def test_only_llava_onevision_renders_images_before_text(checkpoint, tmp_path):
    name, path = checkpoint
    vlm = VLM(ModelSpec(path=str(install(path, fixture_template(name), "chat_template.jinja", tmp_path)),
                        device="cpu"))
    assert vlm.adapter.template.images_first is (name == "llava_onevision")


def planned(chunk_id: str, tier: str | None) -> PlannedChunk:
    return PlannedChunk(chunk_id=chunk_id, doc_id="d", relevance=0.5, tier=tier, num_tokens=8, vision_tokens=0,
                        position_span=8, entry=None)


# (chunks as (id, tier), instruction, text after) -> what template_order gives, worked out by hand from the
# LLaVA-OneVision template: every image, then every text item in the order given.
ORDER_CASES = [
    ([("a", "low"), ("b", None), ("c", "high")], "", "Q?", (["a", "c", "b"], "", "Q?")),
    ([("a", "low"), ("c", "high")], "Read: ", "Q?", (["a", "c"], "", "Read: Q?")),
    ([("b", None), ("a", "low")], "Read: ", "Q?", (["a", "b"], "", "Read: Q?")),  # instruction after the text
    ([("b", None), ("d", None)], "Read: ", "Q?", (["b", "d"], "Read: ", "Q?")),  # no page: nothing moves
    ([("a", "low"), ("c", "low")], "", "Q?", (["a", "c"], "", "Q?")),
]


@pytest.mark.parametrize("chunks, instruction, text_after, expected", ORDER_CASES)
def test_template_order_puts_pages_then_text(chunks, instruction, text_after, expected):
    ordered, moved_instruction, after = template_order([planned(*c) for c in chunks], instruction, text_after)
    assert ([c.chunk_id for c in ordered], moved_instruction, after) == expected


@pytest.mark.parametrize("with_text_chunk", [False, True])
def test_llava_serving_prompt_follows_its_images_first_template(with_text_chunk, tmp_path_factory):
    """A request's content in the user's order (instruction, a page, [a text chunk], a page, the query): the
    prompt the serving path prefills after `template_order` is LLaVA-OneVision's own rendering of it, token for
    token. Negative control: the request order as given (the instruction and the text chunk before the pages) is
    not."""
    name = "llava_onevision"
    path = build("tiny-llava", tmp_path_factory.mktemp("llava") / "checkpoint", chat_template=fixture_template(name))
    vlm = VLM(ModelSpec(path=str(path), device="cpu"))
    rng = random.Random(5)
    pages = {"p1": page(rng, 140, 98), "p2": page(rng, 84, 56)}
    instruction = "Answer from the pages below.\n"
    given = [("p1", "low"), *([("t", None)] if with_text_chunk else []), ("p2", "low")]
    content = [{"type": "text", "text": instruction}] + [
        {"type": "image"} if tier else {"type": "text", "text": CHUNK} for _, tier in given]
    content.append({"type": "text", "text": QUERY})

    def prompt(chunks: list[PlannedChunk], instruction: str, text_after: str) -> list[int]:
        ids = list(vlm.adapter.prefix_ids) + (vlm.adapter.encode(instruction) if instruction else [])
        for chunk in chunks:
            ids += vlm.image_inputs([pages[chunk.chunk_id]])[2] if chunk.tier else vlm.adapter.encode(CHUNK)
        return ids + vlm.query_turn_ids(text_after)

    chunks = [planned(*c) for c in given]
    expected = expected_ids(vlm, fixture_template(name), content, [pages["p1"], pages["p2"]])
    ours = prompt(*template_order(chunks, instruction, QUERY))
    if with_text_chunk:  # the one order linked KV cannot give: the instruction lands after the text chunk
        assert ours == expected_ids(vlm, fixture_template(name), [
            {"type": "image"}, {"type": "image"}, {"type": "text", "text": CHUNK},
            {"type": "text", "text": instruction}, {"type": "text", "text": QUERY}], [pages["p1"], pages["p2"]])
        assert ours != expected
    else:
        assert ours == expected
    assert prompt(chunks, instruction, QUERY) != expected


def test_each_fixture_template_is_the_one_its_readme_row_hashes():
    """tests/fixtures/chat_templates/README.md names each template's source and, where one is published, its
    `sha256(json.dumps(template))`: the files may not drift from it (one character off fails)."""
    import hashlib
    import re

    rows = [line for line in (FIXTURES / "README.md").read_text().splitlines() if line.startswith("| `")]
    hashed = {}
    for row in rows:
        name = re.match(r"^\| `([\w.]+)\.jinja`", row)
        digest = re.search(r"\b([0-9a-f]{64})\b", row)
        if name and digest:
            hashed[name.group(1)] = digest.group(1)
    assert {"qwen2_5_vl_instruct", "glm4_1v_thinking", "qwen2_5_instruct"} <= set(hashed), hashed
    for name, digest in hashed.items():
        text = fixture_template(name)
        assert hashlib.sha256(json.dumps(text).encode()).hexdigest() == digest, name
        assert hashlib.sha256(json.dumps(text[:-1]).encode()).hexdigest() != digest  # control
