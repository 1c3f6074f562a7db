"""The whole system on a local Ray: a corpus ingested by the real pipeline, then served —
HTTP → ingress → router → loader → generator — to the native API and the official OpenAI client."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
from PIL import Image, ImageDraw, ImageFont

from pipeline.ingest import IngestConfig, ingest
from pipeline.runtime.render import resolve_font
from schemas.config import ModelSpec
from schemas.modes import Mode
from schemas.store import StoreSpec
from tests.support.ray_fixtures import free_port, ray_session  # noqa: F401  (fixture)
from tests.support.store_factory import DOCUMENTS

pytestmark = pytest.mark.e2e
QUERY = "When does part XK-4471-B ship?"
SCAN_CHUNK = "scan.png#00000"  # a page-image document: compiled from its own pixels, not rendered text
MAX_CHUNKS = 4
MAX_CONTEXT_TOKENS = 1024
MODEL = ModelSpec(path="tiny-qwen", device="cpu")
GENERATOR_CPUS = 1.5  # the generator replica's reservation: its forwards run ceil(1.5) = 2 torch threads


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return tmp_path_factory.mktemp("corpus")  # also the app's images_root: scan.png is read from here


@pytest.fixture(scope="module")
def store_uri(ray_session, corpus, tmp_path_factory) -> str:
    from ray.data import DataContext

    DataContext.get_current().enable_progress_bars = False
    lines = [json.dumps({"doc_id": doc_id, "text": "\n\n".join(texts)}) for doc_id, texts in DOCUMENTS.items()]
    (corpus / "docs.jsonl").write_text("\n".join(lines) + "\n")
    page = Image.new("RGB", (900, 260), "white")
    font = ImageFont.truetype(str(resolve_font("DejaVuSans.ttf")), 40)
    ImageDraw.Draw(page).text((20, 40), "Glacier order 5521 ships Friday.", fill="black", font=font)
    page.save(corpus / "scan.png")
    uri = str(tmp_path_factory.mktemp("store"))
    # 50 tokens per chunk: each DOCUMENTS paragraph becomes one chunk, as in the unit-test store
    summary = ingest(IngestConfig(corpus=str(corpus), store=StoreSpec(uri=uri), model=MODEL, chunk_tokens=50))
    assert summary.num_chunks == 6 and not summary.quarantined
    return uri


@pytest.fixture(scope="module")
def base_url(store_uri, corpus):
    from ray import serve

    from serve.app import build_app

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port},
                logging_config={"log_level": "WARNING", "enable_access_log": False})
    args = {"store": {"uri": store_uri}, "model": MODEL.model_dump(mode="json"), "images_root": str(corpus),
            "router": {"max_chunks": MAX_CHUNKS, "max_context_tokens": MAX_CONTEXT_TOKENS},
            "ingress": {"default_top_k": 2},
            # placed on the (logical) GPU; the model stays on MODEL.device. 1.5 CPUs: Ray's OMP_NUM_THREADS would be 1
            "generator_deployment": {"num_gpus": 1, "num_cpus": GENERATOR_CPUS}}
    serve.run(build_app(args), name="qvpic", route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()


@pytest.fixture(scope="module")
def client(base_url):
    with httpx.Client(base_url=base_url, timeout=120) as http:
        yield http


def ask(client, **fields) -> dict:
    response = client.post("/v1/answer", json={"query": QUERY, "max_new_tokens": 8, **fields})
    assert response.status_code == 200, response.text
    return response.json()


def test_every_mode_answers(client):
    for mode in Mode:
        reply = ask(client, doc_ids=["invoices", "manual"], mode=mode.value, tau=0.6, max_high_res=2)
        assert reply["mode"] == mode.value and reply["usage"]["completion_tokens"] > 0
        assert [c["chunk_id"] for c in reply["chunks"]] == [
            "invoices#00000", "invoices#00001", "manual#00000", "manual#00001"]


@pytest.mark.parametrize("chunk_id", ["invoices#00000", SCAN_CHUNK])
@pytest.mark.parametrize("tau", [0.0, 1.0])
def test_qvpic_is_token_identical_to_full_image_through_the_stack(client, tau, chunk_id):
    linked = ask(client, chunk_ids=[chunk_id], mode="qvpic", tau=tau, max_new_tokens=16)
    online = ask(client, chunk_ids=[chunk_id], mode="full_image", tau=tau, max_new_tokens=16)
    assert linked["chunks"][0]["tier"] == online["chunks"][0]["tier"] == ("high" if tau else "low")
    assert linked["answer"] == online["answer"] and linked["usage"]["completion_tokens"] > 0
    assert linked["usage"]["context_tokens"] == online["usage"]["context_tokens"]


def test_the_generator_runs_its_reservation_rounded_up_in_torch_threads(client):
    """Ray sets OMP_NUM_THREADS to a replica's CPUs rounded down (1 for 1.5): a generator reserving 1.5 CPUs of a
    2-core node ran every forward on one thread. It sets torch's threads to the reservation rounded up."""
    assert generator_stats().forward_threads == 2


def test_streaming_arrives_incrementally(client):
    body = {"query": f"{QUERY} Stream it.", "chunk_ids": ["invoices#00000"], "max_new_tokens": 12}
    events = []  # streamed first: the plain request after it may come from the response cache
    with client.stream("POST", "/v1/answer", json={**body, "stream": True}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line.removeprefix("data: ")))
    *deltas, done = events
    assert len(deltas) > 1 and done["type"] == "done"
    assert done["response"]["response_cache"]["level"] is None  # the model streamed it, not the cache
    plain = ask(client, **body)
    assert "".join(d["text"] for d in deltas) == done["response"]["answer"] == plain["answer"]


def test_openai_client(base_url, client):
    native = ask(client, chunk_ids=["invoices#00000"], max_new_tokens=8)
    api = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    assert [m.id for m in api.models.list()] == ["qvpic", "qvpic-chat"]  # the second never retrieves
    messages = [{"role": "user", "content": QUERY}]
    extra = {"qvpic": {"chunk_ids": ["invoices#00000"]}}
    completion = api.chat.completions.create(model="qvpic", messages=messages, max_tokens=8, temperature=0,
                                             extra_body=extra)
    assert completion.choices[0].message.content == native["answer"]
    assert completion.usage.prompt_tokens == native["usage"]["context_tokens"] + native["usage"]["query_tokens"]
    # the native request just prefilled this same prompt: the prefix cache holds all of it and the logits after it
    assert completion.usage.prompt_tokens_details.cached_tokens == completion.usage.prompt_tokens
    stream = api.chat.completions.create(model="qvpic", messages=messages, max_tokens=8, temperature=0,
                                         extra_body=extra, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == native["answer"]
    assert chunks[-1].usage.completion_tokens == completion.usage.completion_tokens
    with pytest.raises(openai.NotFoundError, match="not served here"):
        api.chat.completions.create(model="gpt-4", messages=messages)
    legacy = api.completions.create(model="qvpic", prompt=QUERY, max_tokens=8, temperature=0, extra_body=extra)
    assert legacy.choices[0].text == completion.choices[0].message.content  # the chat of one user message
    vectors = api.embeddings.create(model="qvpic", input=[QUERY, "another"])  # through the router's Serve handle
    assert len(vectors.data) == 2 and abs(sum(v * v for v in vectors.data[0].embedding) - 1) < 1e-5
    systems = [api.chat.completions.create(model="qvpic", max_tokens=4, extra_body=extra,
                                           messages=[{"role": "system", "content": text}, *messages])
               for text in ("Be brief.", "Be brief. " * 9 + "Quote the part number.")]
    assert systems[1].usage.prompt_tokens > systems[0].usage.prompt_tokens  # the system message is in the prompt
    assert all(s.choices[0].message.content for s in systems)
    with pytest.raises(openai.BadRequestError) as refused:
        api.chat.completions.create(model="qvpic", messages=[{"role": "user", "content": [
            {"type": "text", "text": "what is this?"},
            {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}])
    assert refused.value.param == "messages[0].content[1].image_url" and "data:" in refused.value.message  # off: a 400


def test_the_ingress_reads_the_bind_of_serves_proxies(client):
    """The open-bind check of `serve run`/`serve deploy` (serve/http/ingress.py) asks Serve's controller for
    http_options.host through a Ray-internal call: this fails if a Ray upgrade takes it away."""
    from serve.http.ingress import serve_http_host

    assert serve_http_host() == "127.0.0.1"


def test_bad_requests_get_their_codes(client):
    cases = [
        ({"query": QUERY, "chunk_ids": ["nope"]}, 404, "unknown chunk_ids: ['nope']"),
        ({"query": QUERY, "top_k": MAX_CHUNKS + 1}, 413, f"at most {MAX_CHUNKS}"),
        ({"query": QUERY, "top_k": 2, "max_new_tokens": 4000}, 413, f"the context holds {MAX_CONTEXT_TOKENS}"),
        ({"query": QUERY, "top_k": 2, "path": "/etc/passwd"}, 422, "Extra inputs"),
        ({"query": QUERY}, 422, "exactly one of"),
    ]
    for body, status, fragment in cases:
        response = client.post("/v1/answer", json=body)
        assert response.status_code == status and fragment in response.text, (body, response.text)
    response = client.post("/v1/answer", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 422


def test_concurrent_requests_all_succeed(base_url):
    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=base_url, timeout=120) as http:
            return await asyncio.gather(*[
                http.post("/v1/answer", json={"query": f"question {i} about invoices", "top_k": 2, "max_new_tokens": 4})
                for i in range(8)])

    responses = asyncio.run(burst())
    assert [r.status_code for r in responses] == [200] * 8, [r.text for r in responses]
    store = httpx.get(f"{base_url}/v1/store").json()
    assert store["num_chunks"] == 6 and store["device_cache"]["hits"] > 0  # chunks shared by the questions
    assert store["device_cache"]["misses"] == store["cache"]["misses"] + store["cache"]["hits"]  # fetched once


LONG = 900  # tokens: seconds of decoding, so only a cancellation ends these requests early
LONG_ANSWER = {"query": "Tell me everything about the recipes", "chunk_ids": ["recipes#00000"], "mode": "text_pic",
               "max_new_tokens": LONG}
LONG_CHAT = {"model": "qvpic", "messages": [{"role": "user", "content": LONG_ANSWER["query"]}], "max_tokens": LONG,
             "temperature": 0, "qvpic": {"chunk_ids": ["recipes#00000"], "mode": "text_pic"}}


def generator_stats():
    from ray import serve

    return serve.get_deployment_handle("Generator", app_name="qvpic").stats.remote().result()


def wait_idle(seconds: float) -> None:
    until = time.monotonic() + seconds
    while (stats := generator_stats()).running or stats.waiting:
        assert time.monotonic() < until, f"the generator is still decoding for nobody: {stats}"
        time.sleep(0.02)


@pytest.mark.parametrize("path, body", [("/v1/answer", LONG_ANSWER), ("/v1/chat/completions", LONG_CHAT)])
def test_abandoned_streams_through_serve_stop_within_a_second(base_url, path, body):
    """Issue 14's attack, scaled down: clients read one event and close the socket."""
    before = generator_stats()

    async def read_one_and_leave() -> None:
        async with httpx.AsyncClient(base_url=base_url, timeout=120) as http:
            async with http.stream("POST", path, json={**body, "stream": True}) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if line.startswith("data:") and "content\": \"\"" not in line:  # a real delta
                        return  # leaving the block closes the connection mid-stream

    async def clients() -> None:
        await asyncio.gather(*[read_one_and_leave() for _ in range(6)])

    asyncio.run(clients())
    wait_idle(1.0)
    after = generator_stats()
    assert after.ended.get("cancelled", 0) - before.ended.get("cancelled", 0) == 6
    assert after.decoded_tokens - before.decoded_tokens < 6 * LONG // 2 and after.kv_nbytes == 0


@pytest.mark.parametrize("path, body", [("/v1/answer", LONG_ANSWER), ("/v1/chat/completions", LONG_CHAT)])
def test_a_plain_request_abandoned_through_serve_stops(base_url, path, body):
    before = generator_stats()

    async def leave_once_decoding() -> None:
        async with httpx.AsyncClient(base_url=base_url, timeout=120) as http:
            request = asyncio.create_task(http.post(path, json=body))
            from ray import serve

            stats = serve.get_deployment_handle("Generator", app_name="qvpic").stats
            while not (await stats.remote()).running:
                await asyncio.sleep(0.02)
            request.cancel()  # the client gives up: its connection closes
            with pytest.raises(asyncio.CancelledError):
                await request

    asyncio.run(leave_once_decoding())
    wait_idle(1.0)
    after = generator_stats()
    assert after.ended.get("cancelled", 0) - before.ended.get("cancelled", 0) == 1


def test_a_deadline_through_serve_is_504(client):
    response = client.post("/v1/answer", json={**LONG_ANSWER, "timeout_s": 0.5})
    assert response.status_code == 504 and "deadline" in response.json()["detail"]
    wait_idle(1.0)
