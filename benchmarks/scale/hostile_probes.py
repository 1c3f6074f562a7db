"""The requests a hostile tenant loops beside a victim (issue 60 item 5), each built as the bytes a client sends.

Every probe is at or past one of the server's cost limits: a JSON Schema nested past its depth limit and one with
more subschemas than a request may hold, a 256-turn history (the most messages a chat may have), a 16-megapixel PNG
(the most pixels an image may have; it compresses, so it passes the body cap and costs its decode), 2,048
embedding inputs (the most a request may have), `n=8` choices of 4,096 tokens streamed (the most of both), a body
nested 10,000 levels deep, and one of nearly the most JSON objects and arrays a body may hold. Only httpx and
Pillow here: the hostile loop runs in a process of its own (benchmarks/scale/tenants.py), which must not load a
model.
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Callable
from dataclasses import dataclass

MODEL = "qvpic"  # serve/config.py's default served_model_name
STREAM_READ_S = 2.0  # how long the hostile client reads an endless stream before it hangs up and asks again


@dataclass(frozen=True)
class Probe:
    path: str
    body: bytes  # JSON, sent as is (a 10,000-level body cannot go through json.dumps)
    stream: bool = False


def _chat(**fields: object) -> bytes:
    return json.dumps({"model": MODEL, "max_tokens": 4, **fields}).encode()


def _ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def schema_deep() -> Probe:
    """A tool whose parameters nest 400 levels (the limit is 32; past ~1,000 the metaschema check once recursed
    past Python's stack: a 500)."""
    schema: dict = {"type": "string"}
    for _ in range(200):
        schema = {"type": "object", "properties": {"a": schema}}
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    return Probe("/v1/chat/completions", _chat(messages=_ask("call f"), tools=[tool], tool_choice="required"))


def schema_wide() -> Probe:
    """response_format with an anyOf of 3,000 subschemas, under the 64 KiB size cap (the limit is 1,024)."""
    schema = {"anyOf": [{"const": i} for i in range(3_000)]}
    return Probe("/v1/chat/completions", _chat(messages=_ask("pick one"), response_format={
        "type": "json_schema", "json_schema": {"name": "bomb", "schema": schema}}))


def history_256() -> Probe:
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}: " + "tell me more " * 40}
             for i in range(255)]
    return Probe("/v1/chat/completions", _chat(messages=turns + _ask("and now summarise all of it")))


_PNG_16MP: bytes | None = None


def image_16mp() -> Probe:
    """A 4,000 × 4,000 PNG (16,000,000 pixels, the per-image limit) in a data: URL: a gradient, so it compresses
    under the body cap and the server pays its full decode and resize."""
    global _PNG_16MP
    if _PNG_16MP is None:
        from PIL import Image

        image = Image.linear_gradient("L").resize((4_000, 4_000)).convert("RGB")
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        _PNG_16MP = buffer.getvalue()
    url = "data:image/png;base64," + base64.b64encode(_PNG_16MP).decode()
    content = [{"type": "text", "text": "what is in this picture?"}, {"type": "image_url", "image_url": {"url": url}}]
    return Probe("/v1/chat/completions", _chat(messages=[{"role": "user", "content": content}]))


def embeddings_2048() -> Probe:
    """2,048 inputs of ~460 characters: just under the request's 1,000,000 characters, so they are embedded."""
    inputs = [f"input {i:04}: " + "a long sentence to embed " * 18 for i in range(2_048)]
    return Probe("/v1/embeddings", json.dumps({"model": MODEL, "input": inputs}).encode())


def endless_n8() -> Probe:
    """Eight choices of 4,096 tokens each, streamed: the client reads for STREAM_READ_S and asks again."""
    body = {"model": MODEL, "messages": _ask("write forever"), "n": 8, "max_tokens": 4_096, "stream": True,
            "temperature": 1.0}
    return Probe("/v1/chat/completions", json.dumps(body).encode(), stream=True)


def deep_json() -> Probe:
    """A body nested 10,000 levels deep (Python's json recurses per level: past its stack, RecursionError)."""
    depth = 10_000
    return Probe("/v1/chat/completions",
                 f'{{"model": "{MODEL}", "messages": {"[" * depth}{"]" * depth}}}'.encode())


def wide_json() -> Probe:
    """63 messages of 62 text parts: 4,034 JSON objects and arrays, just under the 4,096 a body may hold (~12 ms of
    validation, which holds the GIL; charged as 4 requests). Twice as many parts are refused unparsed."""
    part = {"type": "text", "text": "ab"}
    return Probe("/v1/chat/completions", _chat(messages=[{"role": "user", "content": [part] * 62}] * 63))


PROBES: dict[str, Callable[[], Probe]] = {
    "schema bomb (400 levels)": schema_deep,
    "schema bomb (3,000 anyOf)": schema_wide,
    "256-turn history": history_256,
    "16 MP image": image_16mp,
    "2,048 embedding inputs": embeddings_2048,
    "n=8 × 4,096 tokens, streamed": endless_n8,
    "deep JSON (10,000 levels)": deep_json,
    "wide JSON (4,034 objects and arrays)": wide_json,
}
