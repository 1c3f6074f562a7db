"""The two tenants of the fairness benchmark (benchmarks/scale/fairness.py) and what they talk to: tenant a, who loops
every probe of benchmarks/scale/hostile_probes.py from a process of its own; tenant b, who asks ordinary questions one
at a time; the `/healthz` poller; the API keys and the one policy that govern both; the app served on loopback.
tests/serve/governance/test_hostile_tenant.py runs the same tenants, CI-sized.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import multiprocessing
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import httpx

from benchmarks.scale.hostile_probes import MODEL, PROBES, STREAM_READ_S, Probe
from pipeline.priority import lower_process_priority

KEY_A, KEY_B = "hostile-key-a", "victim-key-b"
KEY_BULK = "bulk-key-c"  # tenant c: a bulk client of its own (the CI check's embeddings test), under the same policy
# One policy for every tenant, as an operator would set it: generous for a person, a wall for a loop.
POLICY = {"requests_per_s": 20.0, "request_burst": 20, "tokens_per_s": 20_000.0, "max_in_flight": 4}
CLIENT_TIMEOUT_S = 30.0  # a request past this is a hang
HEALTH_EVERY_S = 0.05
# b starts a question at most every 0.1 s: half its policy's rate, as a client within its limits asks. Unpaced, a
# question answered in ~30 ms let b pass 20 requests/s on its own, and its own 429s counted as errors a caused
B_EVERY_S = 2 / POLICY["requests_per_s"]
A_CLIENT_NICE = 19  # tenant a's client process, the least favoured: see `Hostile.nice`
TARGET_P50, TARGET_P99, TARGET_HEALTH_MS = 1.5, 3.0, 100.0
QUESTION = "What does the report say about the schedule?"


def governance(policy: dict | None = POLICY) -> dict:
    """The ingress's governance keys: a, b (and c) by their keys' sha256, `policy` for each, no response cache (every
    question of b must reach the model)."""
    keys = ((KEY_A, "a"), (KEY_B, "b"), (KEY_BULK, "c"))
    digest = {hashlib.sha256(key.encode()).hexdigest(): tenant for key, tenant in keys}
    return {"auth": {"api_key_sha256": digest}, "limits": {"default": policy or {}},
            "response_cache": {"levels": []}}


@contextmanager
def serving(app) -> Iterator[str]:
    """`app` served by uvicorn on a free loopback port, in a thread; yields its base URL."""
    import socket

    import uvicorn

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


# ---- tenant a: every probe, `concurrency` in flight, in a process of its own -------------------------------------
async def _send(client: httpx.AsyncClient, probe: Probe) -> int | str:
    """The status a probe got, "hang" past CLIENT_TIMEOUT_S, or the transport error's name."""
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY_A}"}

    async def go() -> int:
        async with client.stream("POST", probe.path, content=probe.body, headers=headers) as response:
            ends = time.monotonic() + STREAM_READ_S  # an endless stream: read a while, then hang up
            async for _ in response.aiter_raw():
                if time.monotonic() > ends:
                    break
            return response.status_code

    try:
        return await asyncio.wait_for(go(), CLIENT_TIMEOUT_S)
    except TimeoutError:
        return "hang"
    except httpx.HTTPError as error:
        return type(error).__name__


async def hostile(base_url: str, concurrency: int, stop, answered, skip: tuple[str, ...] = ()) -> dict:
    """Loop the probes (but `skip`) in order (one shared cursor, so each is sent equally often) until `stop` is set;
    every request sent is awaited. `answered` (a shared integer) counts answers, for the caller to wait on. Returns
    `statuses` per probe, and the CPU seconds (`cpu_s`) this client used over `wall_s` of looping."""
    probes = [(name, build()) for name, build in PROBES.items() if name not in skip]
    statuses = {name: Counter() for name, _ in probes}
    cursor = 0
    cpu_s, wall_s = time.process_time(), time.monotonic()  # after the probes are built: the loop's cost alone

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal cursor
        while not stop.is_set():
            name, probe = probes[cursor % len(probes)]
            cursor += 1
            statuses[name][await _send(client, probe)] += 1
            with answered.get_lock():
                answered.value += 1

    async with httpx.AsyncClient(base_url=base_url, timeout=CLIENT_TIMEOUT_S) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return {"statuses": {name: dict(counts) for name, counts in statuses.items()},
            "cpu_s": time.process_time() - cpu_s, "wall_s": time.monotonic() - wall_s}


def _hostile_process(base_url: str, concurrency: int, stop, answered, results, skip: tuple[str, ...],
                     nice: int) -> None:
    if nice:
        lower_process_priority(nice)
    results.put(asyncio.run(hostile(base_url, concurrency, stop, answered, skip)))


@dataclass
class Hostile:
    """Tenant a's process; `statuses` per probe, summed over every time it ran."""

    base_url: str
    concurrency: int = 3
    skip: tuple[str, ...] = ()  # probes left out of the loop
    # a's client is a's machine's work, not the server's: on one box it takes the cores the server's roles would
    # have (a busy client at niceness 0 weighs as much as any of them). `A_CLIENT_NICE` leaves them the cores first
    nice: int = A_CLIENT_NICE
    statuses: dict[str, Counter] = field(default_factory=lambda: {name: Counter() for name in PROBES})
    cpu_s: float = 0.0  # a's client's CPU seconds, all runs: what it took of the box beside the server
    wall_s: float = 0.0

    def __post_init__(self) -> None:
        self.context = multiprocessing.get_context("spawn")  # no fork of a process holding a model and threads
        self.answered = self.context.Value("q", 0)

    @contextmanager
    def running(self) -> Iterator[None]:
        stop, results = self.context.Event(), self.context.Queue()
        process = self.context.Process(target=_hostile_process, daemon=True,
                                       args=(self.base_url, self.concurrency, stop, self.answered, results, self.skip,
                                             self.nice))
        start = self.answered.value
        process.start()
        try:
            while self.answered.value == start:  # a's loop is under way before b's phase counts
                if not process.is_alive():
                    raise RuntimeError("the hostile process died before its first answer")
                time.sleep(0.05)
            yield
        finally:
            stop.set()
            result = results.get(timeout=CLIENT_TIMEOUT_S + 30)
            for name, counts in result["statuses"].items():
                self.statuses[name].update(counts)
            self.cpu_s, self.wall_s = self.cpu_s + result["cpu_s"], self.wall_s + result["wall_s"]
            process.join(timeout=30)


# ---- tenant b and the liveness poller ----------------------------------------------------------------------------
@dataclass
class Victim:
    ttft_ms: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    async def ask(self, client: httpx.AsyncClient, i: int) -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"{QUESTION} (question {i})"}],
                "max_tokens": 8, "stream": True}
        headers = {"Authorization": f"Bearer {KEY_B}", "Cache-Control": "no-cache"}
        started, first = time.perf_counter(), None
        try:
            async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
                if response.status_code != 200:
                    self.errors.append(f"{response.status_code}: {(await response.aread())[:200]!r}")
                    return
                async for line in response.aiter_lines():
                    if first is None and line.startswith("data: {") and _has_content(line):
                        first = (time.perf_counter() - started) * 1e3
                    if line.startswith("data: ") and '"error"' in line:
                        self.errors.append(line[:200])
        except httpx.HTTPError as error:
            self.errors.append(type(error).__name__)
            return
        if first is None:
            self.errors.append("a stream with no content")
        else:
            self.ttft_ms.append(first)


def _has_content(line: str) -> bool:
    return any(choice.get("delta", {}).get("content") is not None
               for choice in json.loads(line.removeprefix("data: ")).get("choices", []))


@dataclass
class Health:
    latency_ms: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    async def poll(self, client: httpx.AsyncClient, stop: asyncio.Event) -> None:
        while not stop.is_set():
            started = time.perf_counter()
            try:
                response = await client.get("/healthz", timeout=CLIENT_TIMEOUT_S)
                if response.status_code != 200:
                    self.failures.append(str(response.status_code))
            except httpx.HTTPError as error:
                self.failures.append(type(error).__name__)
            self.latency_ms.append((time.perf_counter() - started) * 1e3)
            await asyncio.sleep(HEALTH_EVERY_S)


async def questions(base_url: str, victim: Victim, health: Health, count: int, start: int,
                    until=lambda: True) -> None:
    """b's `count` questions, one at a time, each started at least B_EVERY_S after the one before (and more until
    `until()` holds), with `/healthz` polled throughout."""
    async with httpx.AsyncClient(base_url=base_url, timeout=CLIENT_TIMEOUT_S) as client, \
            httpx.AsyncClient(base_url=base_url) as poller:
        stop = asyncio.Event()
        polling = asyncio.create_task(health.poll(poller, stop))
        i = start
        while i < start + count or not until():
            began = time.monotonic()
            await victim.ask(client, i)
            i += 1
            await asyncio.sleep(max(0.0, began + B_EVERY_S - time.monotonic()))
        stop.set()
        await polling
