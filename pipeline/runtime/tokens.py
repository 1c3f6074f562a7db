"""O(1) vision-token estimators: how many image tokens a VLM's own processor turns an image into.

Pure arithmetic mirroring transformers 5.24's PIL image processors (no model, no pixels), so routing,
budgeting and `qvpic estimate` can price a page before it is encoded. tests/pipeline/runtime/test_tokens.py checks every
family against the real processors on real images.

`min_pixels` / `max_pixels` are the processor's `size["shortest_edge"]` / `size["longest_edge"]`
bounds; `None` means the processor class default. GLM-4.1V compares them against
`temporal_patch_size (2) × h × w`, exactly as its processor does. LLaVA-OneVision tiles into fixed
384-px crops and has no pixel bounds.
"""

from __future__ import annotations

import math

from schemas.config import ModelFamily

# Qwen2-VL / Qwen2.5-VL / GLM-4.1V: 14-px ViT patches, 2×2 patches merged into one LLM token.
PATCH_PX = 14
MERGE_SIZE = 2
RESIZE_FACTOR_PX = PATCH_PX * MERGE_SIZE  # resized sides are multiples of 28 px
GLM_TEMPORAL_PATCH_SIZE = 2
MAX_ASPECT_RATIO = 200  # both smart_resize variants reject longer/shorter side ratios above this

# (min_pixels, max_pixels) class defaults of Qwen2VLImageProcessorPil (shared by Qwen2.5-VL) and
# Glm4vImageProcessorPil.
DEFAULT_PIXEL_BOUNDS: dict[ModelFamily, tuple[int, int]] = {
    ModelFamily.QWEN2_VL: (56 * 56, 28 * 28 * 1280),
    ModelFamily.QWEN2_5_VL: (56 * 56, 28 * 28 * 1280),
    ModelFamily.GLM4V: (112 * 112, 28 * 28 * 15000),
}

# LLaVA-OneVision (SigLIP-384/14, anyres_max_9, vision_feature_select_strategy "full", as shipped in
# the llava-onevision-qwen2-*-ov-hf processor configs).
LLAVA_CROP_PX = 384
LLAVA_PATCHES_PER_SIDE = LLAVA_CROP_PX // PATCH_PX  # 27
LLAVA_BASE_TOKENS = LLAVA_PATCHES_PER_SIDE**2  # 729 tokens of the whole image resized to one crop
LLAVA_MAX_TILES = 9  # "anyres_max_9": features beyond ~9 crops are interpolated down
# Same order as LlavaOnevisionImageProcessorPil.image_grid_pinpoints: ties resolve to the first entry.
LLAVA_GRID_PINPOINTS: tuple[tuple[int, int], ...] = tuple(
    (LLAVA_CROP_PX * i, LLAVA_CROP_PX * j) for i in range(1, 7) for j in range(1, 7)
)


class TokenEstimateError(ValueError):
    """The image size or pixel bounds are not something the family's processor accepts."""


def _check_size(width_px: int, height_px: int) -> None:
    if width_px < 1 or height_px < 1:
        raise TokenEstimateError(f"image size must be positive, got {width_px}x{height_px} px")


def _check_aspect(height: float, width: float) -> None:
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise TokenEstimateError(f"aspect ratio {ratio:.1f} of {width}x{height} px exceeds {MAX_ASPECT_RATIO}")


def _qwen_resize(height: int, width: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers.models.qwen2_vl smart_resize, same float arithmetic (Python round = banker's)."""
    factor = RESIZE_FACTOR_PX
    _check_aspect(height, width)
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _glm_resize(height: int, width: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers.models.glm4v smart_resize for one image (num_frames = temporal_factor = 2)."""
    factor, frames = RESIZE_FACTOR_PX, GLM_TEMPORAL_PATCH_SIZE
    if height < factor or width < factor:  # upscaled first, truncating, before the aspect check
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    _check_aspect(height, width)
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if frames * h_bar * w_bar > max_pixels:  # the processor's t_bar is `frames` for a single image
        beta = math.sqrt((frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif frames * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _llava_best_resolution(height: int, width: int) -> tuple[int, int]:
    """transformers.image_processing_utils.select_best_resolution over the default pinpoints."""
    best, best_effective, best_wasted = LLAVA_GRID_PINPOINTS[0], 0, float("inf")
    for cand_h, cand_w in LLAVA_GRID_PINPOINTS:
        scale = min(cand_w / width, cand_h / height)
        effective = min(int(width * scale) * int(height * scale), width * height)
        wasted = cand_w * cand_h - effective
        if effective > best_effective or (effective == best_effective and wasted < best_wasted):
            best, best_effective, best_wasted = (cand_h, cand_w), effective, wasted
    return best


def _llava_tokens(height: int, width: int) -> int:
    """LlavaOnevisionProcessor._get_number_of_features: base crop + unpadded tiles + one newline per row."""
    best_h, best_w = _llava_best_resolution(height, width)
    side = LLAVA_PATCHES_PER_SIDE
    rows, cols = side * (best_h // LLAVA_CROP_PX), side * (best_w // LLAVA_CROP_PX)  # tile feature grid
    if width / height > cols / rows:  # letterboxed top/bottom: drop the padded feature rows
        new_rows = int(round(height * (cols / width), 7))
        rows -= (rows - new_rows) // 2 * 2
    else:
        new_cols = int(round(width * (rows / height), 7))
        cols -= (cols - new_cols) // 2 * 2
    unpadded, newlines = rows * cols, rows
    ratio = math.sqrt(rows * cols / (LLAVA_MAX_TILES * side**2))
    if ratio > 1.1:  # the model bilinearly shrinks the feature map to ~9 crops' worth
        unpadded = int(rows // ratio) * int(cols // ratio)
        newlines = int(rows // ratio)
    return LLAVA_BASE_TOKENS + unpadded + newlines


def _pixel_bounds(family: ModelFamily, min_pixels: int | None, max_pixels: int | None) -> tuple[int, int]:
    default_min, default_max = DEFAULT_PIXEL_BOUNDS[family]
    lo = default_min if min_pixels is None else min_pixels
    hi = default_max if max_pixels is None else max_pixels
    if lo < 1 or hi < lo:
        raise TokenEstimateError(f"need 1 <= min_pixels <= max_pixels, got min={lo}, max={hi}")
    return lo, hi


def resized_size(
    family: ModelFamily, width_px: int, height_px: int, *, min_pixels: int | None = None, max_pixels: int | None = None
) -> tuple[int, int]:
    """(width, height) in px the processor resizes the image to (LLaVA-OneVision: the best tiling)."""
    _check_size(width_px, height_px)
    if family is ModelFamily.LLAVA_ONEVISION:
        if min_pixels is not None or max_pixels is not None:
            raise TokenEstimateError("LLaVA-OneVision tiles fixed 384-px crops; min_pixels/max_pixels do not apply")
        best_h, best_w = _llava_best_resolution(height_px, width_px)
        return best_w, best_h
    lo, hi = _pixel_bounds(family, min_pixels, max_pixels)
    resize = _glm_resize if family is ModelFamily.GLM4V else _qwen_resize
    h_bar, w_bar = resize(height_px, width_px, lo, hi)
    return w_bar, h_bar


def vision_grid(
    family: ModelFamily, width_px: int, height_px: int, *, min_pixels: int | None = None, max_pixels: int | None = None
) -> tuple[int, int, int]:
    """(t, h, w) patch grid before merging, as the processor's `image_grid_thw` reports it.

    LLaVA-OneVision has no thw grid; it returns (number of 384-px crops incl. the base image, 27, 27):
    the shape of the patch features its vision tower produces.
    """
    resized_w, resized_h = resized_size(family, width_px, height_px, min_pixels=min_pixels, max_pixels=max_pixels)
    if family is ModelFamily.LLAVA_ONEVISION:
        num_crops = 1 + (resized_h // LLAVA_CROP_PX) * (resized_w // LLAVA_CROP_PX)
        return num_crops, LLAVA_PATCHES_PER_SIDE, LLAVA_PATCHES_PER_SIDE
    return 1, resized_h // PATCH_PX, resized_w // PATCH_PX


def vision_tokens(
    family: ModelFamily, width_px: int, height_px: int, *, min_pixels: int | None = None, max_pixels: int | None = None
) -> int:
    """Number of image placeholder tokens the LLM sees for one image of this size."""
    if family is ModelFamily.LLAVA_ONEVISION:
        resized_size(family, width_px, height_px, min_pixels=min_pixels, max_pixels=max_pixels)  # validates
        return _llava_tokens(height_px, width_px)
    t, h, w = vision_grid(family, width_px, height_px, min_pixels=min_pixels, max_pixels=max_pixels)
    return t * h * w // (MERGE_SIZE * MERGE_SIZE)
