"""Evaluation harness: QA items through serving modes, in-process or over HTTP, scored and timed.

How a LongBench prompt becomes a qvpic request. Each task template is split at `{context}`
(`pipeline.eval.longbench.split_prompt`), and the pieces go where LongBench's own prompt puts them:
- the text before it (the task instruction) is the request's `instruction`: prompt text prefilled
  online right after the chat-template prefix, before the chunks. It is never ingested, never
  rendered, never scored by the router and never promoted: instructions are prompt, not evidence;
- the item's context is ingested as the document `<task>/<_id>` and chunked by the ingest chunker;
  its chunks are the request's `chunk_ids`, in document order;
- the text after it, question filled in and ending with the answer cue, is the request's
  `query_prompt`, prefilled online after the chunks;
- the bare question is the request's `query`: the one thing the router embeds and scores chunks by.
Every mode therefore sees `[chat prefix][instruction][context chunks][question + cue][assistant header]`;
modes differ only in how the chunks are represented (see `MODE_CONTEXT`). An online-prefilled
instruction rather than a stored text chunk: its KV is computed at its true positions with full
attention to the template, as in the official prompt, in every mode alike (the generator keeps it per
distinct instruction); changing an instruction needs no ingest; and the router never sees it. Chunks
are stripped of surrounding whitespace by the chunker, so the blank lines around `{context}` are not
in the token stream; that is the only textual difference from the prompt LongBench's `pred.py` builds.
An item over the model's context is truncated in the middle as `pred.py` does, by whole chunks
(`pipeline/eval/runner.py`), and counted.

How the items run, cold and warm, in a shuffled order: `pipeline/eval/runner.py`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import httpx

from pipeline.eval.longbench import QAItem
from pipeline.store import Store
from schemas.api import AnswerRequest
from schemas.errors import ApiError
from schemas.modes import Mode, Variant
from schemas.render import RenderSpec
from schemas.report import AnswerReport, AnswerResponse, StreamEventType

MODE_CONTEXT: dict[Mode, str] = {
    Mode.FULL_TEXT: "every chunk's source text, prefilled online with the query in one forward pass",
    Mode.FULL_IMAGE: "every chunk's page images at the tier qvpic routes it to, encoded and prefilled online",
    Mode.TEXT_PIC: "every chunk's text KV, compiled offline under the template prefix, re-anchored",
    Mode.TEXT_PIC_PLAIN: "every chunk's text KV, compiled offline with no prefix (base text PIC), re-anchored",
    Mode.IMAGE_PIC: "every chunk's page KV at one tier (lowest unless set), compiled with no prefix, re-anchored",
    Mode.IMAGE_PIC_DUMMY: "every chunk's page KV at one tier (lowest unless set), compiled after a seeded dummy "
                          "prefix of the template's length, re-anchored",
    Mode.UNIFORM: "every chunk's page KV at one tier (highest unless set), compiled under the template prefix",
    Mode.UNIFORM_HIGH: "every chunk's high-tier page KV, compiled under the template prefix, re-anchored",
    Mode.QVPIC: "templated page KV, high tier for the chunks the relevance router promotes (τ, B), low otherwise",
    Mode.QVPIC_PLAIN: "qvpic's routing over prefix-free page KV (the ablation: no compile prefix)",
    Mode.QVPIC_DUMMY: "qvpic's routing over dummy-prefix page KV (the ablation: a prefix of the template's length)",
}


class EvalError(ValueError):
    """Items that cannot be evaluated against the store or service at hand."""


class RequestFailed(ApiError):
    """The service answered an error status (or an error event mid-stream)."""

    def __init__(self, status_code: int, detail: str):
        super().__init__(f"HTTP {status_code}: {detail}")
        self.status_code = status_code


def context_doc_id(item: QAItem) -> str:
    return f"{item.task.value}/{item.id}"


def corpus_documents(items: Sequence[QAItem]) -> dict[str, str]:
    """doc_id → text of every document the items need ingested: their contexts (instructions are prompt)."""
    documents: dict[str, str] = {}
    for item in items:
        if item.context is not None:
            documents[context_doc_id(item)] = item.context
    return documents


def write_corpus(documents: dict[str, str], path: str) -> str:
    """A JSONL corpus (`{doc_id, text}` per line) that `qvpic ingest` reads."""
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"doc_id": doc_id, "text": text}, ensure_ascii=False) + "\n"
                     for doc_id, text in documents.items())
    return path


class StoreView:
    """What the harness reads from the store the items were ingested into: chunk lists and texts,
    and the KV bytes of each current entry."""

    def __init__(self, store: Store):
        manifest = store.load_manifest_or_raise()
        self.render: RenderSpec = manifest.render
        self.high_tier = manifest.render.highest_tier.name
        rows = store.chunks().select(["chunk_id", "doc_id", "order", "chunk_key", "text", "image_path"]).to_pylist()
        self.text_of = {r["chunk_id"]: r["text"] for r in rows}
        self.image_path_of = {r["chunk_id"]: r["image_path"] for r in rows if r["image_path"]}
        self.key_of = {r["chunk_id"]: r["chunk_key"] for r in rows}
        self.chunks_of_doc: dict[str, list[str]] = {}
        for r in sorted(rows, key=lambda r: (r["doc_id"], r["order"])):
            self.chunks_of_doc.setdefault(r["doc_id"], []).append(r["chunk_id"])
        tiers = {t.name for t in manifest.tiers}
        self.nbytes: dict[tuple[str, str | None, Variant], int] = {}
        for r in store.index().select(["chunk_key", "tier", "variant", "fingerprint", "nbytes"]).to_pylist():
            variant = Variant(r["variant"])
            if (r["tier"] is None or r["tier"] in tiers) \
                    and r["fingerprint"] == manifest.entry_fingerprint(variant, r["tier"]):
                self.nbytes[(r["chunk_key"], r["tier"], variant)] = r["nbytes"]

    def chunk_ids(self, item: QAItem) -> list[str]:
        """The request's chunk list: the context's chunks, in order."""
        if item.chunk_ids is not None:
            return list(item.chunk_ids)
        return self.chunks_of_doc.get(context_doc_id(item), [])

    def check(self, items: Sequence[QAItem]) -> None:
        """Raise `EvalError` naming every document or chunk the items need that the store lacks."""
        missing = set()
        for item in items:
            if item.chunk_ids is not None:
                missing.update(c for c in item.chunk_ids if c not in self.text_of)
            elif context_doc_id(item) not in self.chunks_of_doc:
                missing.add(context_doc_id(item))
        if missing:
            shown = sorted(missing)
            raise EvalError(f"the store lacks {len(shown)} document(s)/chunk(s) the items need, e.g. {shown[:5]}; "
                            "ingest them first (`qvpic eval … --store S --ingest-only`, then serve S)")

    def linked_nbytes(self, report: AnswerReport) -> int:
        """KV bytes linked into the context (0 for the online modes, which compute their KV)."""
        return sum(self.nbytes.get((self.key_of.get(c.chunk_id, ""), c.tier, c.variant), 0)
                   for c in report.chunks if c.variant is not None)


@dataclass(frozen=True)
class Answered:
    text: str
    report: AnswerReport
    ttft_ms: float  # request to first token: the phases before decoding, or the first streamed event


class Answerer(Protocol):
    def __call__(self, request: AnswerRequest) -> Answered: ...


class HttpAnswerer:
    """Streams each request from a running service's `/v1/answer`; TTFT is the client's wait for the
    first event (HTTP, every Serve hop and the first token's detokenisation included)."""

    def __init__(self, url: str, timeout_s: float = 600.0, client: httpx.Client | None = None):
        self.url = url
        self.client = client or httpx.Client(timeout=timeout_s)

    def __call__(self, request: AnswerRequest) -> Answered:
        body = request.model_copy(update={"stream": True}).model_dump(mode="json", exclude_none=True)
        started, first_s, done = time.perf_counter(), None, None
        # TTFT is a measurement of the model path: never an answer from the server's response cache
        with self.client.stream("POST", self.url, json=body, headers={"Cache-Control": "no-cache"}) as response:
            if response.status_code != 200:
                response.read()
                raise RequestFailed(response.status_code, response.text[:500])
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                first_s = first_s or time.perf_counter()
                event = json.loads(line.removeprefix("data: "))  # deltas only time the first token
                if event["type"] == StreamEventType.ERROR.value:
                    raise RequestFailed(event["status_code"], event["detail"])
                if event["type"] == StreamEventType.DONE.value:
                    done = AnswerResponse.model_validate(event["response"])
        if done is None or first_s is None:
            raise RequestFailed(502, f"the stream from {self.url} ended without a done event")
        return Answered(done.answer, done, (first_s - started) * 1e3)


@dataclass(frozen=True)
class ServingSpec:
    """One way to serve the items: a mode and its routing (τ, B, tier; None = the server's defaults)."""

    name: str
    mode: Mode
    tau: float | None = None
    max_high_res: int | None = None
    tier: str | None = None

    @classmethod
    def of(cls, mode: Mode) -> ServingSpec:
        return cls(mode.value, mode)


def item_request(item: QAItem, view: StoreView, serving: ServingSpec,
                 max_new_tokens: int | None = None) -> AnswerRequest:
    """The request of one item: routed by the bare question, the LongBench prompt around the chunks."""
    return AnswerRequest(query=item.question, instruction=item.prompt_before_context,
                         query_prompt=item.query_after_context, chunk_ids=view.chunk_ids(item), mode=serving.mode,
                         tau=serving.tau, max_high_res=serving.max_high_res, tier=serving.tier,
                         max_new_tokens=min(item.max_new_tokens, max_new_tokens or item.max_new_tokens))
