"""`qvpic estimate`: vision tokens of images, page sizes or rendered text, per tier, without a model.

    python -m jobs.estimate --size 595x842 --image scan.png
    python -m jobs.estimate --text-file chunk.txt --dpi 72 --dpi 120 --json

For text, the same text is also tokenized (`--tokenizer DIR`, any local `AutoTokenizer` checkpoint) so
the compression ratio text tokens / vision tokens can be read off. Without `--tokenizer` the built-in
offline `tiny-qwen` checkpoint's tokenizer is used: a small BPE trained in memory, so its counts are
only indicative — pass a real checkpoint directory for real ratios.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from PIL import Image
from rich.console import Console
from rich.table import Table

from pipeline.runtime import Renderer, vision_grid, vision_tokens
from schemas.config import ModelFamily, ModelSpec
from schemas.render import RenderSpec, TierSpec

DEFAULT_TOKENIZER_MODEL = "tiny-qwen"
# RenderSpec fields settable from the command line: (flag, field, type)
_RENDER_FLAGS = (
    ("--font-size-pt", "font_size_pt", float),
    ("--line-height-pt", "line_height_pt", float),
    ("--margin-pt", "margin_pt", float),
    ("--page-width-pt", "page_width_pt", float),
    ("--page-height-pt", "page_height_pt", float),
    ("--max-pages", "max_pages_per_chunk", int),
    ("--max-chars", "max_chars_per_chunk", int),
)


def _size(value: str) -> tuple[int, int]:
    try:
        width_px, height_px = (int(v) for v in value.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"size must look like 595x842 (width x height in px), got {value!r}") from None
    return width_px, height_px


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qvpic estimate", description=__doc__.split("\n\n")[0])
    p.add_argument("--family", type=ModelFamily, default=ModelFamily.QWEN2_5_VL,
                   help=f"one of {[f.value for f in ModelFamily]} (default qwen2_5_vl)")
    p.add_argument("--min-pixels", type=int, help=f"default {ModelSpec().min_pixels} (the qvpic runtime's)")
    p.add_argument("--max-pixels", type=int, help=f"default {ModelSpec().max_pixels} (the qvpic runtime's)")
    p.add_argument("--image", type=Path, action="append", default=[], help="image file (repeatable)")
    p.add_argument("--size", type=_size, action="append", default=[], help="WIDTHxHEIGHT in px (repeatable)")
    text = p.add_mutually_exclusive_group()
    text.add_argument("--text", help="chunk text to render")
    text.add_argument("--text-file", type=Path, help="UTF-8 file whose content is one chunk")
    p.add_argument("--dpi", type=int, action="append", default=[],
                   help="render tier DPI (repeatable; default: the RenderSpec tiers, 72 and 120)")
    defaults = RenderSpec()
    for flag, field, kind in _RENDER_FLAGS:
        p.add_argument(flag, dest=field, type=kind, help=f"RenderSpec.{field} (default {getattr(defaults, field)})")
    p.add_argument("--no-crop", action="store_true", help="keep full pages (no margin/tail cropping)")
    p.add_argument("--tokenizer", type=Path,
                   help=f"local tokenizer dir for text tokens (default: built-in {DEFAULT_TOKENIZER_MODEL})")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    return p


def _pixel_bounds(args: argparse.Namespace) -> dict[str, int | None]:
    if args.family is ModelFamily.LLAVA_ONEVISION:  # fixed 384-px tiling; passing bounds is an error
        return {"min_pixels": args.min_pixels, "max_pixels": args.max_pixels}
    spec = ModelSpec()
    return {
        "min_pixels": spec.min_pixels if args.min_pixels is None else args.min_pixels,
        "max_pixels": spec.max_pixels if args.max_pixels is None else args.max_pixels,
    }


def _image_row(source: str, width_px: int, height_px: int, family: ModelFamily, bounds: dict) -> dict:
    return {
        "source": source, "width_px": width_px, "height_px": height_px,
        "grid_thw": list(vision_grid(family, width_px, height_px, **bounds)),
        "vision_tokens": vision_tokens(family, width_px, height_px, **bounds),
    }


def _count_text_tokens(text: str, tokenizer_dir: Path | None) -> tuple[int, str]:
    from transformers import AutoTokenizer

    if tokenizer_dir is None:
        from pipeline.runtime import ensure_model

        tokenizer_dir = ensure_model(DEFAULT_TOKENIZER_MODEL)
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    return len(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]), str(tokenizer_dir)


def _text_report(args: argparse.Namespace, text: str, bounds: dict) -> dict:
    overrides = {field: getattr(args, field) for _, field, _ in _RENDER_FLAGS if getattr(args, field) is not None}
    if args.dpi:
        overrides["tiers"] = tuple(TierSpec(name=f"dpi{dpi}", dpi=dpi) for dpi in dict.fromkeys(args.dpi))
    spec = RenderSpec(crop=not args.no_crop, **overrides)
    text_tokens, tokenizer = _count_text_tokens(text, args.tokenizer)
    tiers = []
    for name, chunk in Renderer(spec).render_all_tiers(text).items():
        pages = [_image_row(f"page {i}", *page.size, args.family, bounds) for i, page in enumerate(chunk.pages)]
        num_vision = sum(p["vision_tokens"] for p in pages)
        tiers.append({
            "tier": name, "dpi": chunk.dpi, "pages": chunk.num_pages,
            "pixels": sum(p["width_px"] * p["height_px"] for p in pages), "vision_tokens": num_vision,
            "compression_ratio": text_tokens / num_vision, "missing_glyphs": chunk.missing_glyphs,
            "page_sizes": [[p["width_px"], p["height_px"]] for p in pages],
        })
    return {"num_chars": len(text), "text_tokens": text_tokens, "tokenizer": tokenizer, "tiers": tiers}


def _print_tables(report: dict, console: Console) -> None:
    family = report["family"]
    if report["images"]:
        table = Table(title=f"Images ({family})")
        for col in ("source", "size px", "grid t×h×w", "vision tokens"):
            table.add_column(col, justify="left" if col == "source" else "right")
        for r in report["images"]:
            table.add_row(r["source"], f"{r['width_px']}×{r['height_px']}", "×".join(map(str, r["grid_thw"])),
                          str(r["vision_tokens"]))
        console.print(table)
    if report["text"]:
        text = report["text"]
        table = Table(title=f"Text: {text['num_chars']} chars = {text['text_tokens']} text tokens ({family})")
        for col in ("tier", "dpi", "pages", "pixels", "vision tokens", "text/vision", "missing glyphs"):
            table.add_column(col, justify="left" if col == "tier" else "right")
        for t in text["tiers"]:
            table.add_row(t["tier"], str(t["dpi"]), str(t["pages"]), f"{t['pixels']:,}", f"{t['vision_tokens']:,}",
                          f"{t['compression_ratio']:.2f}", str(t["missing_glyphs"]))
        console.print(table)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not (args.image or args.size or args.text is not None or args.text_file):
        print("error: nothing to estimate; give --image, --size, --text or --text-file", file=sys.stderr)
        return 2
    try:
        bounds = _pixel_bounds(args)
        images = [_image_row(f"{w}x{h}", w, h, args.family, bounds) for w, h in args.size]
        for path in args.image:
            with Image.open(path) as img:  # reads the header only
                images.append(_image_row(str(path), *img.size, args.family, bounds))
        text = args.text_file.read_text(encoding="utf-8") if args.text_file else args.text
        report = {"family": args.family.value, **bounds, "images": images,
                  "text": _text_report(args, text, bounds) if text is not None else None}
    except (ValueError, OSError) as exc:  # bad sizes/config/text (ValueError subclasses), unreadable files
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_tables(report, Console(file=sys.stdout))
    return 0


if __name__ == "__main__":
    sys.exit(main())
