"""Renderer throughput: pages per second per tier, one process, one core.

    python -m benchmarks.perf.render_throughput

Renders multi-page Latin and CJK chunks at 72/96/120 DPI (Glyph layout defaults) and reports the
median (and best) over repeats of pages/s for rendering alone and for rendering plus PNG encoding.
"""

from __future__ import annotations

import io
import statistics
import time

from benchmarks.quality.legibility import reference_text
from pipeline.eval import markdown_table, write_section
from pipeline.runtime import Renderer
from schemas.render import RenderSpec, TierSpec

DPIS = (72, 96, 120)
REPEATS = 9
CJK_SENTENCE = "这是一个关于发票编号、零件号和日期的测试段落，中文文本需要逐字换行。"
TEXTS = {
    # invoice lines joined into paragraphs, so lines wrap at the full page width like prose chunks
    "latin": "\n\n".join(reference_text(seed).replace("\n", " ") for seed in range(16)),
    "cjk": (CJK_SENTENCE * 12 + "\n") * 30,
}


def _timings(fn, repeats: int = REPEATS) -> list[float]:
    fn()  # warm glyph and advance caches, as a long-lived renderer actor would be
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def _encode_png(pages) -> int:
    nbytes = 0
    for page in pages:
        buf = io.BytesIO()
        page.save(buf, format="PNG")
        nbytes += buf.tell()
    return nbytes


def run() -> str:
    start = time.perf_counter()
    renderer = Renderer(RenderSpec())
    init_ms = (time.perf_counter() - start) * 1e3
    rows = []
    for name, text in TEXTS.items():
        for dpi in DPIS:
            tier = TierSpec(name="bench", dpi=dpi)
            chunk = renderer.render(text, tier)
            render_s = _timings(lambda text=text, tier=tier: renderer.render(text, tier))
            both_s = _timings(lambda text=text, tier=tier: _encode_png(renderer.render(text, tier).pages))
            width_px, height_px = chunk.pages[0].size
            rows.append([name, dpi, len(text), chunk.num_pages, f"{width_px}×{height_px}",
                         round(chunk.num_pages / statistics.median(render_s), 1),
                         round(chunk.num_pages / min(render_s), 1),
                         round(chunk.num_pages / statistics.median(both_s), 1),
                         round(_encode_png(chunk.pages) / chunk.num_pages / 1024, 1)])
            print(*rows[-1], sep="\t", flush=True)
    headers = ["text", "DPI", "chars", "pages", "first page px", "pages/s (render)", "best pages/s (render)",
               "pages/s (render + PNG)",
               "PNG KiB/page"]
    return (
        f"Median (and best) of {REPEATS} repeats after one warm-up, single thread; the machine is shared, so "
        f"the best-of column is the less contended figure. Renderer init (font resolution and "
        f"loading for the default tiers): {init_ms:.0f} ms.\n\n" + markdown_table(headers, rows)
    )


def main() -> None:
    path = write_section("render_throughput", "Renderer throughput", "python -m benchmarks.perf.render_throughput",
                         run())
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
