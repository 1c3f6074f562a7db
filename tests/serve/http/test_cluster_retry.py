"""A call whose serving replica died is retried once on another (serve/http/backend.py), a stream only
before its first event; no Ray: the handles are stand-ins that fail the way Serve's do."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from ray.exceptions import ActorDiedError

from serve.http.backend import HandleBackend, api_error

DIED = ActorDiedError()


class Response:
    """What `handle.method.remote()` returns: awaitable (or async-iterable when streaming), cancellable."""

    def __init__(self, outcome: object, events: list[object] | None = None):
        self.outcome, self.events, self.cancelled = outcome, events or [], False

    def __await__(self):
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome
        yield  # never reached: makes this a generator, as __await__ must be

    def __aiter__(self):
        return self._events()

    async def _events(self):
        for event in self.events:
            yield event
        if isinstance(self.outcome, BaseException):
            raise self.outcome

    def cancel(self) -> None:
        self.cancelled = True


class Handle:
    """A deployment handle whose every method answers the next of `responses`; calls are recorded."""

    def __init__(self, responses: Iterator[Response]):
        self.responses, self.calls = responses, []

    def options(self, **_: object) -> "Handle":
        return self

    def __getattr__(self, method: str):
        handle = self

        class Method:
            @staticmethod
            def remote(*args: object) -> Response:
                handle.calls.append((method, args))
                return next(handle.responses)

        return Method


def backend(generator: Handle) -> HandleBackend:
    return HandleBackend(router=generator, loader=generator, generator=generator)


def collect(events) -> list[object]:
    async def read() -> list[object]:
        return [event async for event in events]

    return asyncio.run(read())


def test_a_call_whose_replica_died_is_retried_once_with_what_is_left_of_its_deadline():
    handle = Handle(iter([Response(DIED), Response("answer")]))
    assert asyncio.run(backend(handle).generate("plan", "sampling", timeout_s=30.0)) == "answer"
    (_, first), (_, second) = handle.calls
    assert first[2] == pytest.approx(30.0, abs=0.5) and 0 < second[2] <= first[2]


def test_only_a_replica_death_is_retried_and_only_once():
    other = Handle(iter([Response(ValueError("bad plan")), Response("answer")]))
    with pytest.raises(ValueError):
        asyncio.run(backend(other).generate("plan", "sampling"))
    assert len(other.calls) == 1  # negative control: an ordinary error is the answer
    twice = Handle(iter([Response(DIED), Response(DIED), Response("answer")]))
    with pytest.raises(ActorDiedError) as raised:
        asyncio.run(backend(twice).route("request", None, frozenset({"public"})))
    assert len(twice.calls) == 2
    assert api_error(raised.value) == (503, "a serving replica failed during this request (ActorDiedError); retry it")


def test_a_stream_is_retried_before_its_first_event_and_ends_in_the_error_after_it():
    unstarted = Handle(iter([Response(DIED), Response(None, ["a", "b", "done"])]))
    assert collect(backend(unstarted).stream("plan", "sampling")) == ["a", "b", "done"]
    assert len(unstarted.calls) == 2
    started_responses = [Response(DIED, ["a"]), Response(None, ["x"])]
    started = Handle(iter(started_responses))
    events: list[object] = []

    async def read() -> None:
        async for event in backend(started).stream("plan", "sampling"):
            events.append(event)

    with pytest.raises(ActorDiedError):
        asyncio.run(read())
    assert events == ["a"] and len(started.calls) == 1  # the client had text: no second answer after it
    assert started_responses[0].cancelled


def retries(call: str) -> float:
    """`qvpic_replica_retries_total` of this process (0 before its first increment)."""
    from serve.metrics import serve_metrics

    return serve_metrics().registry.get_sample_value("qvpic_replica_retries_total", {"call": call}) or 0.0


def test_each_retry_is_counted_by_call_and_nothing_else_is():
    before = {call: retries(call) for call in ("generate", "stream", "route")}
    asyncio.run(backend(Handle(iter([Response(DIED), Response("answer")]))).generate("plan", "sampling"))
    collect(backend(Handle(iter([Response(DIED), Response(None, ["a", "done"])]))).stream("plan", "sampling"))
    with pytest.raises(ValueError):  # not a replica's death: no retry, no count
        asyncio.run(backend(Handle(iter([Response(ValueError("bad"))]))).route("request", None, frozenset({"public"})))
    with pytest.raises(ActorDiedError):  # died after its first event: no retry, no count
        collect(backend(Handle(iter([Response(DIED, ["a"])]))).stream("plan", "sampling"))
    assert {call: retries(call) - before[call] for call in before} == {"generate": 1.0, "stream": 1.0, "route": 0.0}
