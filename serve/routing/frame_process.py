"""A framing process (serve/routing/framer.py starts it): `PromptTemplate.frame` for the router, one conversation at a
time, over two pipes of length-prefixed messages.

    python -m serve.routing.frame_process READ_FD WRITE_FD

Each message is a JSON header and a payload of bytes, never a pickle. The first carries the router's `ModelSpec`; the
process loads the prompt template (the tokenizer and the chat template, no weights) and answers `ready` with its pid.
Then each message is a job (`Job`) whose payload is the conversation's messages as the router dumped them (pydantic's
JSON, validated again here as the ingress validated them): `frame`, with the groups, tools and ending in its header,
answered with `PromptTemplate.frame_conversation`'s `Framing` as JSON (`encode_framing`); or `tokenize`, answered with
the prompt's token ids. A message the template cannot take is answered `invalid`, with its words and field. It ends
when the router closes its end. It runs at `BULK_NICE`, below the router. A plain subprocess, not multiprocessing: spawn
would import the router process's `__main__` here (a script without a main guard would run again), and a fork would
copy its threads.
"""

from __future__ import annotations

import base64
import enum
import json
import os
import struct
import sys
from typing import BinaryIO

from schemas.prompt import ImageRef, PromptLayout, Segment

_SIZES = struct.Struct("<QQ")  # a message's header and payload lengths in bytes


class Job(enum.Enum):
    FRAME = "frame"
    TOKENIZE = "tokenize"


def send(stream: BinaryIO, header: dict, payload: bytes = b"") -> None:
    """One message: a JSON header and a payload of bytes (no pickle: nothing that crosses runs code)."""
    head = json.dumps(header).encode()
    stream.write(_SIZES.pack(len(head), len(payload)) + head + payload)
    stream.flush()


def receive(stream: BinaryIO) -> tuple[dict, bytes]:
    """The next message's header and payload; EOFError when the other end is gone."""
    sizes = stream.read(_SIZES.size)
    if len(sizes) < _SIZES.size:
        raise EOFError("the pipe closed")
    head_size, payload_size = _SIZES.unpack(sizes)
    data = stream.read(head_size + payload_size)
    if len(data) < head_size + payload_size:
        raise EOFError("the pipe closed mid-message")
    return json.loads(data[:head_size]), data[head_size:]


def encode_framing(framing) -> bytes:
    """A `Framing` as JSON: each token run a list, each image its fields with its bytes in base64."""
    def piece(p):
        if isinstance(p, ImageRef):
            return {"data": base64.b64encode(p.data).decode(), "digest": p.digest, "width_px": p.width_px,
                    "height_px": p.height_px}
        return p
    return json.dumps({"texts": [[piece(p) for p in text.pieces] for text in framing.layout.texts],
                       "text_tokens": framing.text_tokens, "conversation": framing.conversation,
                       "conversation_chain": framing.conversation_chain}).encode()


def decode_framing(data: bytes):
    """`encode_framing`'s inverse."""
    from serve.routing.prompt import Framing

    def piece(p):
        if isinstance(p, dict):
            return ImageRef(base64.b64decode(p["data"]), p["digest"], p["width_px"], p["height_px"])
        return tuple(p)
    value = json.loads(data)
    layout = PromptLayout(tuple(Segment(tuple(piece(p) for p in text)) for text in value["texts"]))
    return Framing(layout, tuple(value["text_tokens"]), value["conversation"], tuple(value["conversation_chain"]))


def serve_forever(reader: BinaryIO, writer: BinaryIO) -> None:
    from pipeline.priority import BULK_NICE, lower_process_priority
    from schemas.config import ModelSpec
    from schemas.conversation import MESSAGES
    from schemas.tools import ToolUse
    from serve.routing.prompt import InvalidMessageError, PromptTemplate

    # Each conversation here is one a client made large (past `router.framing`'s limits): the kernel gives the cores to
    # the replicas' interactive work first. Every thread so far (BLAS's, started at numpy's import); later ones inherit.
    lower_process_priority(BULK_NICE)
    prompt = PromptTemplate.load(ModelSpec.model_validate(receive(reader)[0]["model"]))
    send(writer, {"status": "ready", "pid": os.getpid()})
    while True:
        try:
            header, payload = receive(reader)
        except EOFError:
            return
        try:
            messages = MESSAGES.validate_json(payload)
            if header["job"] == Job.FRAME.value:
                tools = ToolUse.model_validate(header["tools"]) if header["tools"] is not None else None
                framing = prompt.frame_conversation(messages, header["groups"], tools,
                                                    header["add_generation_prompt"], header["continue_final"])
                answer, result = {"status": "ok"}, encode_framing(framing)
            else:
                answer, result = {"status": "ok"}, json.dumps(prompt.conversation_tokens(messages)).encode()
        except InvalidMessageError as error:  # a 400 naming its field, raised by the router as it is
            answer, result = {"status": "invalid", "message": str(error), "param": error.param}, b""
        except Exception as error:  # noqa: BLE001  anything else: the router's 500, with its words
            answer, result = {"status": "error", "message": f"{type(error).__name__}: {error}"}, b""
        send(writer, answer, result)


if __name__ == "__main__":
    with os.fdopen(int(sys.argv[1]), "rb") as reader, os.fdopen(int(sys.argv[2]), "wb") as writer:
        serve_forever(reader, writer)
