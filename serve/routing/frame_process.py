"""A framing process (serve/routing/framer.py starts it): `PromptTemplate.frame` for the router, one conversation at a
time, over two pipes of length-prefixed pickles.

    python -m serve.routing.frame_process READ_FD WRITE_FD

Its first message is the router's `ModelSpec`; it loads the prompt template (the tokenizer and the chat template, no
weights) and answers `("ready", pid)`. Then each message is `(Job.FRAME, request, groups)`, answered with
`PromptTemplate.frame` of it (an AnswerRequest pickles its messages as pydantic's JSON, validated again here, as the
ingress validated them), or `(Job.TOKENIZE, messages_json)`, answered with the messages' prompt tokens as `/tokenize`
gives them. Each answer is `("ok", value)` or `("error", exception)`. It ends when the router closes its end. A plain
subprocess, not multiprocessing: spawn would import the router process's `__main__` here (a script without a main guard
would run again), and a fork would copy its threads.
"""

from __future__ import annotations

import enum
import os
import pickle
import struct
import sys
from typing import BinaryIO

_HEADER = struct.Struct("<Q")  # a message's length in bytes


class Job(enum.Enum):
    FRAME = "frame"
    TOKENIZE = "tokenize"


def send(stream: BinaryIO, message: object) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def receive(stream: BinaryIO) -> object:
    """The next message; EOFError when the other end is gone."""
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        raise EOFError("the pipe closed")
    size = _HEADER.unpack(header)[0]
    data = stream.read(size)
    if len(data) < size:
        raise EOFError("the pipe closed mid-message")
    return pickle.loads(data)


def serve_forever(reader: BinaryIO, writer: BinaryIO) -> None:
    from pydantic import TypeAdapter

    from schemas.conversation import Message
    from serve.routing.prompt import PromptTemplate

    messages_type = TypeAdapter(list[Message])
    prompt = PromptTemplate.load(receive(reader))
    send(writer, ("ready", os.getpid()))
    while True:
        try:
            job, *args = receive(reader)
        except EOFError:
            return
        try:
            if job is Job.FRAME:
                answer = ("ok", prompt.frame(*args))
            else:
                answer = ("ok", prompt.conversation_tokens(messages_type.validate_json(*args)))
        except Exception as error:  # noqa: BLE001  the router raises it as its own (InvalidMessageError: a 400)
            answer = ("error", error)
        try:
            send(writer, answer)
        except (pickle.PicklingError, TypeError, AttributeError):  # an exception that does not pickle
            send(writer, ("error", RuntimeError(f"framing failed: {type(answer[1]).__name__}: {answer[1]}")))


if __name__ == "__main__":
    from serve.routing import frame_process  # the module, not __main__: its Job is the class the router pickles

    with os.fdopen(int(sys.argv[1]), "rb") as reader, os.fdopen(int(sys.argv[2]), "wb") as writer:
        frame_process.serve_forever(reader, writer)
