"""Large conversations are framed in a framing process of the router's own (serve/routing/framer.py): the same
framing as on a thread, none of its work on the router's GIL, errors and limits kept, a dead or stuck process
replaced. The reference is `PromptTemplate.frame` run in this process."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
from PIL import Image

from schemas.api import AnswerRequest
from schemas.config import ModelSpec
from schemas.conversation import Message
from schemas.errors import WorkerLostError
from schemas.tools import ToolUse
from serve.config import FramingSpec
from serve.routing import prompt as prompt_module
from serve.routing.framer import Framer, FramingProcess
from serve.routing.prompt import InvalidMessageError, PromptTemplate
from tests.support.store_factory import roles, serving_store, stack_of  # noqa: F401  (fixtures)

MODEL = ModelSpec(path="tiny-qwen", device="cpu")
QUESTION = "When does part XK-4471-B ship?"


@pytest.fixture(scope="module")
def prompt() -> PromptTemplate:
    return PromptTemplate.load(MODEL)


@pytest.fixture(scope="module")
def framer():
    framer = Framer(MODEL, FramingSpec())
    yield framer
    framer.close()


def png() -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (40, 24), "blue").save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def wide() -> list[Message]:
    """The hostile probe's shape, smaller: 12 messages of 12 text parts (156 parts)."""
    return [Message(role="user", content=[{"type": "text", "text": f"p{m}.{p} "} for p in range(12)])
            for m in range(12)]


def mixed() -> list[Message]:
    """Every kind of turn the template renders: system, named user, images, a tool call (and a legacy
    function_call), a tool result, an echoed assistant message with nulls, then 60 more turns."""
    return [Message(role="system", content="Answer from the pages."),
            Message(role="user", name="ann", content=[{"type": "text", "text": "look: <|im_start|>"},
                                                      {"type": "image_url", "image_url": {"url": png()}}]),
            Message(role="assistant", content=None, tool_calls=[{"id": "c1", "type": "function", "function": {
                "name": "lookup", "arguments": '{"part": "XK-4471-B", "n": [1, 2]}'}}]),
            Message(role="tool", tool_call_id="c1", content="ships in March"),
            Message(role="assistant", content=None, function_call={"name": "lookup", "arguments": "not json"}),
            Message(role="function", name="lookup", content="ships in May"),
            Message(role="assistant", content="It ships in March.", refusal=None, annotations=None),
            *[Message(role="user" if i % 2 == 0 else "assistant", content=f"turn {i}: more") for i in range(60)],
            Message(role="user", content=QUESTION)]


def tools() -> ToolUse:
    return ToolUse(tools=[{"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"part": {"type": "string"}}}}}])


CASES = {
    "wide": lambda: AnswerRequest(query="q", messages=wide(), top_k=2),
    "long text": lambda: AnswerRequest(query=QUESTION, messages=[Message(role="user", content="word " * 8_000)],
                                       top_k=2),
    "mixed, tools offered": lambda: AnswerRequest(query=QUESTION, messages=mixed(), tools=tools(), top_k=2),
    "continued": lambda: AnswerRequest(query=QUESTION, messages=[*wide(), Message(role="assistant", content="So")],
                                       top_k=2, add_generation_prompt=False, continue_final_message=True),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("groups", [1, 3])
def test_a_process_frames_as_this_process_does(prompt, framer, case, groups):
    """Layout, token counts and the conversation's digests (the response cache's and prefix affinity's keys) are
    those `PromptTemplate.frame` makes here, for every kind of turn; the request is one the framer offloads."""
    request = CASES[case]()
    assert framer.offloads(request.messages, request.tools)
    expected = prompt.frame(request, groups)
    got = asyncio.run(framer.frame(request, groups))
    assert got == expected
    assert got.conversation and len(got.conversation_chain) == len(request.messages)


def test_the_control_a_different_conversation_frames_differently(prompt, framer):
    """The control for the equality above: one part's text changed changes the layout, the digest and the
    chain's last link, so the equality compares what the process actually framed."""
    request = CASES["wide"]()
    messages = [*request.messages[:-1], Message(role="user", content=[{"type": "text", "text": "other"}])]
    other = asyncio.run(framer.frame(request.model_copy(update={"messages": messages}), 1))
    expected = prompt.frame(request, 1)
    assert other.layout != expected.layout and other.conversation != expected.conversation
    assert other.conversation_chain[:-1] == expected.conversation_chain[:-1]
    assert other.conversation_chain[-1] != expected.conversation_chain[-1]


def test_what_is_offloaded():
    """Small chats stay on threads (a process's round trip would cost more); a conversation reaching either limit,
    counted over messages, parts, tool calls and tools, goes to a process; `processes: 0` offloads nothing."""
    framer = Framer(MODEL, FramingSpec(min_parts=10, min_chars=1_000))
    chat = [Message(role="system", content="be brief"), Message(role="user", content=QUESTION)]
    assert not framer.offloads(chat)
    assert not framer.offloads(None)  # a native request: no conversation
    parts = [Message(role="user", content=[{"type": "text", "text": "a"}] * 8)]  # 1 message + 8 parts = 9
    assert not framer.offloads(parts)
    assert framer.offloads(parts, tools())  # + 1 tool = 10
    assert framer.offloads(parts * 2)
    assert not framer.offloads([Message(role="user", content="x" * 999)])
    assert framer.offloads([Message(role="user", content="x" * 1_000)])
    calls = [Message(role="assistant", tool_calls=[{"id": "c", "type": "function", "function": {
        "name": "f", "arguments": "1" * 1_000}}]), Message(role="user", content="a")]
    assert framer.offloads(calls)
    assert not Framer(MODEL, FramingSpec(processes=0, min_parts=1)).offloads(parts * 2)
    assert not framer._processes  # deciding starts nothing


@pytest.mark.parametrize("processes", [1, 0])
def test_the_router_frames_a_large_conversation_off_its_gil(serving_store, monkeypatch, processes):
    """`Router.plan` on the hostile probe's shape: the router's own template is never rendered (made to raise here,
    the process is not patched), and the plan is `route`'s with this process's framing. The control,
    `processes: 0`, frames on the router's thread: it renders here, and raises."""
    stack = stack_of(serving_store.uri, serving_store.model, framing={"processes": processes})
    try:
        router = stack.router
        request = AnswerRequest(query="q", messages=wide(), top_k=2)
        expected = router.frame(request, len(router.group_queries(request)))  # here, before the render raises
        rendered = []

        def refuse(*args, **kwargs):
            rendered.append(1)
            raise RuntimeError("rendered on the router")

        monkeypatch.setattr(prompt_module, "render_layout", refuse)
        if processes == 0:
            with pytest.raises(RuntimeError, match="rendered on the router"):
                asyncio.run(router.plan(request, cache_salt=b"t"))
            return
        plan = asyncio.run(router.plan(request, cache_salt=b"t"))
        assert not rendered
        assert (plan.layout, plan.prefix_tokens + plan.query_tokens, plan.conversation, plan.conversation_chain) == (
            expected.layout, sum(expected.text_tokens), expected.conversation, expected.conversation_chain)
        assert expected.layout.num_groups == 9  # the question and the latest 8 earlier user messages retrieve
    finally:
        stack.close()


def test_tokenize_renders_a_large_conversation_in_the_process(serving_store, monkeypatch):
    """`/tokenize` of a large conversation: the tokens this process's template gives, rendered in the framing process
    (the router's own render made to raise); a small one stays on a thread (it raises)."""
    from schemas.utility import TokenizeRequest

    stack = stack_of(serving_store.uri, serving_store.model)
    try:
        router = stack.router
        large, small = TokenizeRequest(messages=wide()), TokenizeRequest(messages=wide()[:1])
        expected = router.prompt.conversation_tokens(large.messages)
        assert len(expected) > 12 * 12
        monkeypatch.setattr(prompt_module, "render_layout", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("here")))
        assert asyncio.run(router.tokenize(large)).tokens == expected
        with pytest.raises(RuntimeError, match="here"):
            asyncio.run(router.tokenize(small))
    finally:
        stack.close()


def test_a_400_from_the_process_names_its_field(framer):
    """A message the template cannot take fails in the process as it would here: an InvalidMessageError naming the
    message's field, raised by the router."""
    deep = "[" * 70 + "]" * 70
    messages = [*wide(), Message(role="assistant", tool_calls=[{"id": "c", "type": "function", "function": {
        "name": "f", "arguments": deep}}]), Message(role="user", content=QUESTION)]
    with pytest.raises(InvalidMessageError) as raised:
        asyncio.run(framer.frame(AnswerRequest(query=QUESTION, messages=messages, top_k=2), 1))
    assert raised.value.param == "messages[12].tool_calls[0].function.arguments"


def test_the_process_runs_at_a_lower_cpu_priority(framer):
    """Its conversations are ones a client made large: BULK_NICE below the router (main thread and every thread it
    starts), so the router's and the generator's interactive work get the cores first."""
    from pipeline.priority import BULK_NICE

    pid = framer.start().result()
    expected = min(19, os.getpriority(os.PRIO_PROCESS, 0) + BULK_NICE)
    threads = os.listdir(f"/proc/{pid}/task")
    assert threads and {os.getpriority(os.PRIO_PROCESS, int(t)) for t in threads} == {expected}


def test_a_stuck_process_is_killed_and_the_request_refused(prompt):
    """Past `timeout_s` the request is a 400 naming `messages` and the limit, and the process is killed; the next
    conversation gets a new one and is framed."""
    framer = Framer(MODEL, FramingSpec(timeout_s=1e-4))
    try:
        request = CASES["long text"]()
        first = framer.start().result()
        with pytest.raises(InvalidMessageError, match=r"framing.timeout_s") as raised:
            asyncio.run(framer.frame(request, 1))
        assert raised.value.param == "messages"
        assert not _alive(first)
        framer.spec = FramingSpec(timeout_s=60)
        assert asyncio.run(framer.frame(request, 1)) == prompt.frame(request, 1)
        assert framer.start().result() != first
    finally:
        framer.close()


def test_a_process_that_dies_is_replaced_and_twice_is_a_503(prompt, monkeypatch):
    """A process killed while it frames: the conversation is sent once more, to a new process, and framed. Killed
    again there, that request is a WorkerLostError (503, retry); the next is framed by a new process. `close` ends
    every process."""
    framer = Framer(MODEL, FramingSpec())
    try:
        request = CASES["wide"]()
        pids = [framer.start().result()]
        call, kills = FramingProcess.call, []

        def killed(self, *args):
            if len(kills) < budget:
                kills.append(self.pid)
                os.kill(self.pid, signal.SIGKILL)
                self.popen.wait()
            return call(self, *args)

        monkeypatch.setattr(FramingProcess, "call", killed)
        budget = 1
        assert asyncio.run(framer.frame(request, 1)) == prompt.frame(request, 1)
        pids.append(framer.start().result())
        budget = 3
        with pytest.raises(WorkerLostError) as raised:
            asyncio.run(framer.frame(request, 1))
        assert raised.value.status_code == 503
        assert asyncio.run(framer.frame(request, 1)) == prompt.frame(request, 1)
        pids.append(framer.start().result())
        # the first process and its replacement killed, then the replacement's replacement; a fourth frames
        assert kills[:2] == pids[:2] and len(kills) == 3 and len(set(pids + kills)) == 4
        processes = list(framer._processes)
    finally:
        framer.close()
    assert processes and all(p.popen.poll() is not None for p in processes)


def test_a_script_without_a_main_guard_runs_once(tmp_path):
    """A user's script that frames at top level (no `if __name__ == "__main__"`): the framing process does not
    run it again (multiprocessing's spawn would import it in the child, building a second router there)."""
    marks = tmp_path / "marks"
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(f"""
        import asyncio
        from schemas.api import AnswerRequest
        from schemas.config import ModelSpec
        from schemas.conversation import Message
        from serve.config import FramingSpec
        from serve.routing.framer import Framer
        with open({str(marks)!r}, "a") as marks:
            marks.write("ran\\n")
        framer = Framer(ModelSpec(path="tiny-qwen", device="cpu"), FramingSpec(min_parts=1))
        request = AnswerRequest(query="q", messages=[Message(role="user", content="q")], top_k=2)
        framing = asyncio.run(framer.frame(request, 1))
        print(sum(framing.text_tokens))
        framer.close()
    """))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout.split()[-1]) > 0
    assert marks.read_text() == "ran\n"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_messages_cross_as_json_and_come_back_equal(framer):
    """The messages go to the process as pydantic's JSON and are validated there: every message of `mixed` (legacy
    function turns already rewritten by validation) validates back to itself."""
    from pydantic import TypeAdapter

    adapter = TypeAdapter(list[Message])
    messages = mixed()
    assert adapter.validate_json(adapter.dump_json(messages)) == messages
    assert json.loads(adapter.dump_json(messages))[4]["function_call"] is None  # rewritten as tool_calls


@pytest.mark.parametrize("case", CASES)
def test_a_request_pickles_its_conversation_as_json(case):
    """An AnswerRequest crosses Serve handles (Ray's cloudpickle) and pipes (pickle) with its messages as pydantic's
    JSON, not object by object, and arrives equal; one without messages pickles as any model does."""
    import pickle

    from ray import cloudpickle

    from schemas import api

    request = CASES[case]()
    for module in (pickle, cloudpickle):
        assert pickle.loads(module.dumps(request)) == request
    assert request.__reduce_ex__(pickle.HIGHEST_PROTOCOL)[0] is api._with_messages
    native = AnswerRequest(query=QUESTION, top_k=2)
    assert pickle.loads(cloudpickle.dumps(native)) == native
    assert native.__reduce_ex__(pickle.HIGHEST_PROTOCOL)[0] is not api._with_messages
