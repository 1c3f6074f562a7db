"""Large conversations framed in processes of the router replica's own (`Framer`); the rest stay on its threads.

Framing (`PromptTemplate.frame`) is Python that holds the GIL: Jinja renders the chat template around a sentinel per
text part, and the parts' token runs are assembled and counted. A conversation of 63 messages of 62 parts costs ~39 ms
of it, a 256-turn history ~45 ms (tiny-qwen's tokenizer, AMD EPYC). On a worker thread that is off the event loop but
not off the GIL: the replica's other requests wait for it at each hand-off of the GIL, and beside a tenant looping such
conversations another tenant's questions spent 115-194 ms in the router (docs/RELIABILITY.md, issue 60). In a framing
process (serve/routing/frame_process.py) the router pays the messages' JSON (pydantic's serializer: ~2 ms for the 63 ×
62 parts) and the layout's decoding from JSON, on a thread that waits for the answer with the GIL released (the pipes
carry JSON and bytes, never a pickle: tests/pipeline/store/test_no_pickle.py). A tenant's large conversations then wait
for each other in the framing queue, not beside everyone's requests for the GIL, and tenants take turns there
(`FairExecutor`: another tenant's large conversation waits for the ones being framed, not for all those queued); small
ones stay on threads, where a process's round trip would cost more than their framing.

Each framing process belongs to one thread of `Framer`'s executor (`processes` of them): it starts with that thread's
first conversation (a deployed router starts one at once: `start`), loads the tokenizer (~280 MB resident, torch and
transformers imported: 2.5 s), and is replaced when it dies or is killed past `timeout_s`.
"""

from __future__ import annotations

import asyncio
import json
import os
import select
import subprocess
import sys
import threading
from concurrent.futures import Future

from schemas.api import AnswerRequest
from schemas.config import ModelSpec
from schemas.conversation import MESSAGES, Message, TextPart
from schemas.errors import WorkerLostError
from schemas.tools import ToolUse
from serve.config import FramingSpec
from serve.routing.fair_executor import FairExecutor
from serve.routing.frame_process import Job, decode_framing, receive, send
from serve.routing.prompt import Framing, InvalidMessageError

START_TIMEOUT_S = 120.0  # a process's import of transformers and torch and its tokenizer's load
TOKENIZE_KEY = ("tokenize",)  # /tokenize's conversations take their turns as one tenant (it is not told the tenant)
START_KEY = ("start",)


class Framer:
    """The router replica's framing processes, one per thread of a small executor whose queue is the framing queue,
    served a tenant at a time."""

    def __init__(self, model: ModelSpec, spec: FramingSpec):
        self.model, self.spec = model, spec
        self._calls = FairExecutor(spec.processes, "framer") if spec.processes else None
        self._local = threading.local()  # each executor thread's FramingProcess
        self._lock = threading.Lock()
        self._processes: set[FramingProcess] = set()  # every live one, for `close`

    def offloads(self, messages: list[Message] | None, tools: ToolUse | None = None) -> bool:
        """Whether a conversation is framed in a process: at least `min_parts` messages, content parts, tool calls and
        tools offered, or `min_chars` characters of text and call arguments (what the template renders one by one)."""
        if self._calls is None or messages is None:
            return False
        parts = chars = 0
        for message in messages:
            calls = message.tool_calls or ()
            parts += 1 + len(calls)
            chars += sum(len(call.function.arguments) for call in calls)
            if isinstance(message.content, str):
                chars += len(message.content)
            elif message.content:
                parts += len(message.content)
                chars += sum(len(p.text) for p in message.content if isinstance(p, TextPart))
        if tools is not None:
            parts += len(tools.tools)
        return parts >= self.spec.min_parts or chars >= self.spec.min_chars

    async def frame(self, request: AnswerRequest, groups: int, tenant: bytes = b"") -> Framing:
        """`PromptTemplate.frame(request, groups)` in a framing process, queued under `tenant` (the router's cache
        salt: server-side), its errors (InvalidMessageError: a 400) raised here as they are. Past `timeout_s` the
        process is killed and the request refused, naming `messages` (400). A process that dies under it is replaced
        and the conversation sent once more; dying again, it is a WorkerLostError (503). Cancelled while queued, it
        is never sent."""
        return await asyncio.wrap_future(self._calls.submit(tenant, self._frame, request, groups))

    async def tokenize(self, messages: list[Message]) -> list[int]:
        """`PromptTemplate.conversation_tokens(messages)` in a framing process, its errors and limits `frame`'s."""
        return await asyncio.wrap_future(self._calls.submit(TOKENIZE_KEY, self._tokenize, messages))

    def start(self) -> Future:
        """Starts a framing process now (a deployed router does, so its first large conversation does not wait for
        one to load); the future holds its pid."""
        return self._calls.submit(START_KEY, lambda: self._process().pid)

    def _frame(self, request: AnswerRequest, groups: int) -> Framing:  # on an executor thread: the JSON off the loop
        header = {"job": Job.FRAME.value, "groups": groups, "add_generation_prompt": request.add_generation_prompt,
                  "continue_final": request.continue_final_message,
                  "tools": request.tools.model_dump(mode="json") if request.tools is not None else None}
        return decode_framing(self._call(header, MESSAGES.dump_json(request.messages)))

    def _tokenize(self, messages: list[Message]) -> list[int]:
        return json.loads(self._call({"job": Job.TOKENIZE.value}, MESSAGES.dump_json(messages)))

    def _call(self, header: dict, payload: bytes) -> bytes:
        """The answer's payload from this thread's framing process (frame_process.py's protocol)."""
        for attempt in range(2):  # a process found dead (killed between conversations, or by this one): once more
            process = self._process()
            try:
                answer, result = process.call(header, payload, self.spec.timeout_s)
                break
            except TimeoutError:
                self._drop(process)
                raise InvalidMessageError(f"messages: framing this conversation took longer than "
                                          f"{self.spec.timeout_s:g} s (router framing.timeout_s); send a shorter one",
                                          "messages") from None
            except (EOFError, OSError):
                self._drop(process)
                if attempt:
                    raise WorkerLostError("the router's framing process died twice while framing this conversation; "
                                          "retry, or send a shorter one", retry_after_s=1.0) from None
        if answer["status"] == "invalid":
            raise InvalidMessageError(answer["message"], answer["param"])
        if answer["status"] != "ok":
            raise RuntimeError(f"the framing process failed: {answer['message']}")
        return result

    def _process(self) -> FramingProcess:
        process = getattr(self._local, "process", None)
        if process is None or process.popen.poll() is not None:
            if process is not None:
                self._drop(process)
            process = self._local.process = FramingProcess(self.model)
            with self._lock:
                self._processes.add(process)
        return process

    def _drop(self, process: FramingProcess) -> None:
        process.close()
        self._local.process = None
        with self._lock:
            self._processes.discard(process)

    def close(self) -> None:
        if self._calls is not None:
            self._calls.shutdown()
        with self._lock:
            processes, self._processes = self._processes, set()
        for process in processes:
            process.close()


class FramingProcess:
    """One `python -m serve.routing.frame_process`, its two pipes, one call at a time (its executor thread's)."""

    def __init__(self, model: ModelSpec):
        to_child, self._to_child = os.pipe()
        self._from_child, from_child = os.pipe()
        # the router's import path, as multiprocessing's spawn passes it (a test's or a Ray runtime_env's)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.popen = subprocess.Popen([sys.executable, "-m", "serve.routing.frame_process", str(to_child),
                                       str(from_child)], pass_fds=(to_child, from_child), env=env,
                                      stdin=subprocess.DEVNULL)
        os.close(to_child)
        os.close(from_child)
        self._writer, self._reader = os.fdopen(self._to_child, "wb"), os.fdopen(self._from_child, "rb")
        send(self._writer, {"model": model.model_dump(mode="json")})
        answer, _ = self._answer(START_TIMEOUT_S)
        if answer.get("status") != "ready":
            raise RuntimeError(f"framing process: unexpected first answer {answer!r}")
        self.pid = answer["pid"]

    def call(self, header: dict, payload: bytes, timeout_s: float) -> tuple[dict, bytes]:
        """TimeoutError past `timeout_s`; EOFError or OSError when the process is gone."""
        send(self._writer, header, payload)
        return self._answer(timeout_s)

    def _answer(self, timeout_s: float) -> tuple[dict, bytes]:
        readable, _, _ = select.select([self._reader], [], [], timeout_s)
        if not readable:
            raise TimeoutError
        return receive(self._reader)

    def close(self) -> None:
        self.popen.kill()  # it holds no state: a half-framed conversation is nobody's now
        for stream in (self._writer, self._reader):
            try:
                stream.close()
            except OSError:
                pass
        self.popen.wait()
