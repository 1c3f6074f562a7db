"""Issue 60: a large image is shrunk to the processor's size before the processor (pipeline/runtime/compile_chunks.py
`fitted`), and the pixel values the model reads are the same, bit for bit, as the processor's on the upload.

The reference is the transformers PIL processor itself, given the original image."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil
from transformers.models.llava_onevision.image_processing_pil_llava_onevision import LlavaOnevisionImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from pipeline.runtime.compile_chunks import fitted
from schemas.config import ModelFamily

# (width, height): wider, taller, extreme aspect, one under the minimum (enlarged: passed as is), one already fitted
SIZES = [(1500, 1100), (640, 2900), (3000, 160), (40, 30), (532, 392)]
BOUNDS = [(3136, 200_704), (112 * 112, 401_408)]  # (shortest_edge, longest_edge): small, so most sizes shrink
PROCESSORS = {ModelFamily.QWEN2_VL: Qwen2VLImageProcessorPil, ModelFamily.GLM4V: Glm4vImageProcessorPil}


def noise(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    """Random pixels: any difference in resampling shows in the pixel values (a flat image would hide it)."""
    channels = {"RGB": 3, "RGBA": 4}.get(mode, 1)
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, channels), dtype=np.uint8)
    return Image.fromarray(pixels.squeeze(-1) if channels == 1 else pixels, mode)


def processed(processor, image: Image.Image) -> tuple[torch.Tensor, torch.Tensor]:
    out = processor(images=[image], return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


@pytest.mark.parametrize("family", list(PROCESSORS))
@pytest.mark.parametrize("bounds", BOUNDS)
def test_the_fitted_image_gives_the_processors_own_pixel_values(family, bounds):
    processor = PROCESSORS[family](size={"shortest_edge": bounds[0], "longest_edge": bounds[1]})
    shrunk = 0
    for i, (width, height) in enumerate(SIZES):
        page = noise(width, height, seed=i)
        fit = fitted(family, processor, page)
        shrunk += fit.size != page.size
        expected_values, expected_grid = processed(processor, page)
        values, grid = processed(processor, fit)
        assert torch.equal(grid, expected_grid), (width, height)
        assert torch.equal(values, expected_values), (width, height)
    assert shrunk >= 3  # the test covers the shrinking path, not only the pass-through


def test_other_modes_are_converted_as_before():
    """Grey and RGBA uploads: the image_inputs path converted them to RGB before the processor; it still does."""
    processor = Qwen2VLImageProcessorPil(size={"shortest_edge": 3136, "longest_edge": 200_704})
    for mode in ("L", "RGBA"):
        page = noise(1200, 900, mode)
        fit = fitted(ModelFamily.QWEN2_VL, processor, page)
        assert fit.mode == "RGB" and fit.size != page.size
        assert torch.equal(processed(processor, fit)[0], processed(processor, page.convert("RGB"))[0])


def test_control_another_resample_filter_changes_the_pixel_values():
    """Negative control: fitted with a filter other than the processor's, the pixel values differ, so the equality
    above is a real check of the filter and the size."""
    processor = Qwen2VLImageProcessorPil(size={"shortest_edge": 3136, "longest_edge": 200_704})
    page = noise(1500, 1100)
    wrong = page.resize(fitted(ModelFamily.QWEN2_VL, processor, page).size, resample=Image.Resampling.BILINEAR)
    assert wrong.size != page.size
    assert not torch.equal(processed(processor, wrong)[0], processed(processor, page)[0])


def test_the_processor_resizes_nothing_after_fitting(monkeypatch):
    """What the saving rests on: the processor's own resize gets an image already at its target size."""
    processor = Qwen2VLImageProcessorPil(size={"shortest_edge": 3136, "longest_edge": 200_704})
    seen = []
    original = Qwen2VLImageProcessorPil.resize

    def resize(self, image, *args, **kwargs):
        result = original(self, image, *args, **kwargs)
        seen.append((image.shape[-2:], result.shape[-2:]))
        return result

    monkeypatch.setattr(Qwen2VLImageProcessorPil, "resize", resize)
    page = noise(3000, 2000)
    processed(processor, fitted(ModelFamily.QWEN2_VL, processor, page))
    assert len(seen) == 1 and seen[0][0] == seen[0][1] and seen[0][0] != (2000, 3000)


def test_llava_onevision_is_passed_as_is():
    page = noise(1500, 1100)
    assert fitted(ModelFamily.LLAVA_ONEVISION, LlavaOnevisionImageProcessorPil(), page) is page
