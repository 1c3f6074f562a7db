"""The O(1) vision-token estimator against the real transformers PIL image processors on real images,
and `qvpic estimate`, its command-line face."""

from __future__ import annotations

import json
import random
import re
from types import SimpleNamespace

import pytest
import torch
from PIL import Image
from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil
from transformers.models.llava_onevision.image_processing_pil_llava_onevision import LlavaOnevisionImageProcessorPil
from transformers.models.llava_onevision.modeling_llava_onevision import LlavaOnevisionModel
from transformers.models.llava_onevision.processing_llava_onevision import LlavaOnevisionProcessor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from pipeline.runtime import vision_grid, vision_tokens
from pipeline.runtime.tokens import DEFAULT_PIXEL_BOUNDS, LLAVA_GRID_PINPOINTS, TokenEstimateError, resized_size
from schemas.config import ModelFamily, ModelSpec

NUM_SIZES = 200
GEOMETRY_ONLY = {"do_rescale": False, "do_normalize": False}  # pixel values are irrelevant to the grid
FIXED_SIZES = [(1, 1), (27, 27), (28, 28), (29, 41), (595, 842), (992, 1403), (1, 150), (150, 1), (3, 50),
               (384, 384), (385, 1920), (4000, 3000)]


def random_sizes(seed: int) -> list[tuple[int, int]]:
    """Tiny, ordinary, extreme-aspect (up to 1:190) and a few huge (width, height) sizes."""
    rng = random.Random(seed)
    sizes = list(FIXED_SIZES)
    while len(sizes) < NUM_SIZES:
        kind = rng.random()
        if kind < 0.15:
            w, h = rng.randint(1, 60), rng.randint(1, 60)
        elif kind < 0.35:
            short = rng.randint(1, 40)
            long = min(int(short * rng.uniform(10, 190)), 5000)
            w, h = (short, long) if rng.random() < 0.5 else (long, short)
        elif kind < 0.37:
            w, h = rng.randint(3000, 5000), rng.randint(3000, 5000)
        else:
            w, h = (int(10 ** rng.uniform(1.5, 3.4)) for _ in range(2))
        if max(w, h) / min(w, h) <= 190:
            sizes.append((w, h))
    return sizes


def random_bounds(rng: random.Random, family: ModelFamily) -> tuple[int | None, int | None]:
    choice = rng.randrange(4)
    if choice == 0:
        return None, None  # the processor's own class defaults
    if choice == 1:
        return ModelSpec().min_pixels, ModelSpec().max_pixels  # what the qvpic runtime passes
    if choice == 2:
        return DEFAULT_PIXEL_BOUNDS[family][0], 1_389_000
    lo = rng.randint(3136, 300_000)
    return lo, rng.randint(lo, 4_000_000)


def blank(w: int, h: int) -> Image.Image:
    return Image.new("RGB", (w, h), "white")


@pytest.mark.parametrize(
    ("family", "processor_cls"),
    [(ModelFamily.QWEN2_5_VL, Qwen2VLImageProcessorPil), (ModelFamily.QWEN2_VL, Qwen2VLImageProcessorPil),
     (ModelFamily.GLM4V, Glm4vImageProcessorPil)],
)
def test_grid_and_tokens_match_merging_processors(family: ModelFamily, processor_cls: type) -> None:
    processor = processor_cls()
    rng = random.Random(family.value)
    for w, h in random_sizes(seed=len(family.value)):
        lo, hi = random_bounds(rng, family)
        kwargs = dict(GEOMETRY_ONLY)
        if lo is not None:
            kwargs["size"] = {"shortest_edge": lo, "longest_edge": hi}
        out = processor(blank(w, h), **kwargs)
        expected_grid = tuple(int(v) for v in out["image_grid_thw"][0])
        grid = vision_grid(family, w, h, min_pixels=lo, max_pixels=hi)
        assert grid == expected_grid, (w, h, lo, hi)
        # what processing_qwen2_vl / processing_glm4v expand the image placeholder to
        assert vision_tokens(family, w, h, min_pixels=lo, max_pixels=hi) == int(out["image_grid_thw"][0].prod()) // 4
        assert out["pixel_values"].shape[0] == grid[0] * grid[1] * grid[2]


def test_llava_onevision_matches_processor_and_model_packing() -> None:
    image_processor = LlavaOnevisionImageProcessorPil()
    assert [tuple(p) for p in image_processor.image_grid_pinpoints] == list(LLAVA_GRID_PINPOINTS)
    # The released llava-onevision-*-ov-hf processor settings; object.__new__ skips the tokenizer and
    # video processor (torchvision) that only the text side of the processor needs.
    processor = object.__new__(LlavaOnevisionProcessor)
    processor.image_processor = image_processor
    processor.num_image_tokens, processor.image_token = 729, "<image>"
    processor.vision_feature_select_strategy, processor.vision_aspect_ratio = "full", "anyres_max_9"
    fake_model = SimpleNamespace(config=SimpleNamespace(
        vision_config=SimpleNamespace(image_size=384, patch_size=14),
        image_grid_pinpoints=[list(p) for p in LLAVA_GRID_PINPOINTS],
    ))
    for i, (w, h) in enumerate(random_sizes(seed=7)):
        out = image_processor(blank(w, h), **GEOMETRY_ONLY)
        num_crops = out["pixel_values"][0].shape[0]
        assert vision_grid(ModelFamily.LLAVA_ONEVISION, w, h) == (num_crops, 27, 27), (w, h)
        num_tokens = processor.replace_image_token(out, 0).count("<image>")
        assert vision_tokens(ModelFamily.LLAVA_ONEVISION, w, h) == num_tokens, (w, h)
        if i % 5 == 0:  # the model's own unpad + newline packing agrees with the processor
            _, lens = LlavaOnevisionModel.pack_image_features(
                fake_model, [torch.zeros(num_crops, 729, 1)], image_sizes=torch.tensor([[h, w]]),
                image_newline=torch.zeros(1),
            )
            assert int(lens[0]) == num_tokens, (w, h)


def test_a4_page_sanity() -> None:
    qwen = ModelFamily.QWEN2_5_VL
    assert vision_tokens(qwen, 595, 842) == 630  # 72 DPI
    assert vision_tokens(qwen, 992, 1403, max_pixels=1_389_000) == 1750  # 120 DPI, not downscaled
    assert vision_tokens(qwen, 992, 1403, max_pixels=ModelSpec().max_pixels) == 1750
    assert vision_tokens(qwen, 992, 1403) == 1260  # class default 1,003,520 px downscales
    assert resized_size(qwen, 992, 1403, max_pixels=1_389_000) == (980, 1400)


@pytest.mark.parametrize("family", [ModelFamily.QWEN2_5_VL, ModelFamily.GLM4V])
@pytest.mark.parametrize("size", [(1, 250), (30_000, 100), (5, 1200)])
def test_extreme_aspect_rejected_like_the_processor(family: ModelFamily, size: tuple[int, int]) -> None:
    processor = Qwen2VLImageProcessorPil() if family is not ModelFamily.GLM4V else Glm4vImageProcessorPil()
    with pytest.raises(ValueError, match="aspect ratio"):
        processor(blank(*size), **GEOMETRY_ONLY)
    with pytest.raises(TokenEstimateError, match="aspect ratio"):
        vision_tokens(family, *size)


@pytest.mark.parametrize(
    ("family", "size", "bounds", "message"),
    [
        (ModelFamily.QWEN2_5_VL, (0, 10), {}, "positive"),
        (ModelFamily.GLM4V, (10, -1), {}, "positive"),
        (ModelFamily.QWEN2_5_VL, (100, 100), {"min_pixels": 5000, "max_pixels": 4000}, "min_pixels"),
        (ModelFamily.LLAVA_ONEVISION, (100, 100), {"max_pixels": 4000}, "do not apply"),
    ],
)
def test_bad_inputs_raise_clear_errors(family: ModelFamily, size: tuple[int, int], bounds: dict, message: str) -> None:
    with pytest.raises(TokenEstimateError, match=message):
        vision_tokens(family, *size, **bounds)


# --- `qvpic estimate` (jobs/estimate.py), the CLI face of the estimator -------------------------------


@pytest.fixture(scope="module")
def word_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A local tokenizer whose count is checkable: one token per word or punctuation run."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={"[UNK]": 0, "invoice": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    out = tmp_path_factory.mktemp("tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(out)
    return str(out)


def run_estimate(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    from jobs.estimate import main

    rc = main(list(argv))
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def test_estimate_sizes_and_images_json(capsys: pytest.CaptureFixture, tmp_path) -> None:
    blank(595, 842).save(tmp_path / "page.png")
    rc, out, _ = run_estimate(capsys, "--size", "595x842", "--size", "992X1403", "--image",
                              str(tmp_path / "page.png"), "--max-pixels", "1389000", "--json")
    assert rc == 0
    report = json.loads(out)
    assert report["family"] == "qwen2_5_vl" and report["max_pixels"] == 1_389_000 and report["text"] is None
    assert [r["vision_tokens"] for r in report["images"]] == [630, 1750, 630]
    assert report["images"][1]["grid_thw"] == [1, 100, 70]


def test_estimate_text_json(capsys: pytest.CaptureFixture, word_tokenizer_dir: str) -> None:
    text = "Invoice INV-2024-0042: part XK-4471-B, qty 12 @ $14.95.\n" * 40
    rc, out, _ = run_estimate(capsys, "--text", text, "--tokenizer", word_tokenizer_dir, "--json")
    assert rc == 0
    report = json.loads(out)["text"]
    assert report["text_tokens"] == len(re.findall(r"\w+|[^\w\s]+", text))
    assert [t["tier"] for t in report["tiers"]] == ["low", "high"]
    for tier in report["tiers"]:
        sizes = tier["page_sizes"]
        assert tier["pages"] == len(sizes) == 1
        assert tier["vision_tokens"] == sum(
            vision_tokens(ModelFamily.QWEN2_5_VL, w, h, max_pixels=ModelSpec().max_pixels) for w, h in sizes
        )
        assert tier["compression_ratio"] == pytest.approx(report["text_tokens"] / tier["vision_tokens"])
    low, high = report["tiers"]
    assert high["vision_tokens"] > 2 * low["vision_tokens"]


def test_estimate_render_flags_and_table_output(
    capsys: pytest.CaptureFixture, word_tokenizer_dir: str, tmp_path
) -> None:
    (tmp_path / "chunk.txt").write_text("total 1,234.56 EUR", encoding="utf-8")
    rc, out, _ = run_estimate(capsys, "--text-file", str(tmp_path / "chunk.txt"), "--tokenizer", word_tokenizer_dir,
                              "--dpi", "96", "--no-crop", "--family", "glm4v", "--json")
    assert rc == 0
    (tier,) = json.loads(out)["text"]["tiers"]
    assert (tier["tier"], tier["page_sizes"]) == ("dpi96", [[793, 1123]])
    rc, out, _ = run_estimate(capsys, "--size", "595x842", "--text", "12 pt", "--tokenizer", word_tokenizer_dir,
                              "--font-size-pt", "12")
    assert rc == 0 and "630" in out and "Images (qwen2_5_vl)" in out and "text tokens" in out


def test_estimate_default_tokenizer_is_the_builtin_checkpoint(capsys: pytest.CaptureFixture) -> None:
    rc, out, _ = run_estimate(capsys, "--text", "part XK-4471-B", "--json")
    assert rc == 0
    report = json.loads(out)["text"]
    assert "tiny-qwen" in report["tokenizer"] and report["text_tokens"] > 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "nothing to estimate"),
        (["--size", "1x300"], "aspect ratio"),
        (["--image", "/nonexistent/page.png"], "No such file"),
        (["--family", "llava_onevision", "--size", "10x10", "--max-pixels", "5"], "do not apply"),
        (["--text", "x", "--font-size-pt", "-1"], "font_size_pt"),
    ],
)
def test_estimate_errors_exit_2_with_a_message(capsys: pytest.CaptureFixture, argv: list[str], message: str) -> None:
    rc, _, err = run_estimate(capsys, *argv)
    assert rc == 2 and message in err
