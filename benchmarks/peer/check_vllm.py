"""The peer venv's check (setup_vllm.sh): `import vllm`, torchvision through sitecustomize, one image prompt.

    .peer-vllm/bin/python benchmarks/peer/check_vllm.py CHECKPOINT_DIR
"""

from __future__ import annotations

import os
import sys
import tempfile
import time


def main(model: str) -> int:
    started = time.perf_counter()
    import torchvision  # noqa: F401  (fails with "operator torchvision::nms does not exist" without the fix)
    from PIL import Image, ImageDraw
    from vllm import LLM, SamplingParams
    from vllm_side import messages  # the script's own folder is on sys.path

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    print(f"== import vllm, torchvision: {time.perf_counter() - started:.1f} s", flush=True)
    with tempfile.TemporaryDirectory() as folder:
        page = Image.new("RGB", (448, 224), "white")
        ImageDraw.Draw(page).text((20, 90), "The peer venv reads an image.", fill="black")
        path = os.path.join(folder, "page.png")
        page.save(path)
        started = time.perf_counter()
        llm = LLM(model=model, dtype="float32", max_model_len=2048, limit_mm_per_prompt={"image": 1, "video": 0})
        print(f"== engine start: {time.perf_counter() - started:.0f} s", flush=True)
        convo = messages([{"image": path}, {"text": "What does the page say?"}])
        (out,) = llm.chat([convo], SamplingParams(temperature=0.0, max_tokens=4),
                          chat_template_content_format="openai", use_tqdm=False)
    images = out.prompt_token_ids.count(llm.get_tokenizer().convert_tokens_to_ids("<|image_pad|>"))
    print(f"== one image prompt: {len(out.prompt_token_ids)} prompt tokens ({images} image tokens), "
          f"output ids {list(out.outputs[0].token_ids)}", flush=True)
    return 0 if images == (448 // 28) * (224 // 28) else 1


if __name__ == "__main__":  # vLLM starts its engine with `spawn`
    sys.exit(main(sys.argv[1]))
