"""`qvpic eval`: prompt split, store view, every mode in-process and over HTTP, scoring aggregation,
evidence legibility, report files, and the whole job end to end on the bundled fixtures."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from PIL import Image

from jobs import eval_items
from jobs import evaluate as evaluate_job
from jobs.eval_serving import InProcessAnswerer, ServedTraces, planner
from jobs.ingest import parse_tiers
from pipeline.eval import (
    LONGBENCH_QA_TASKS,
    PAPER_TIERS,
    REFERENCE_MODE,
    REPORT_MD,
    SWEEP_PNG,
    HttpAnswerer,
    OcrJudge,
    QAItem,
    QATask,
    ServingSpec,
    StoreView,
    answer_token_ids,
    corpus_documents,
    item_request,
    judge_items,
    load_tasks,
    middle_cut,
    paper_grid,
    run,
    run_fidelity,
    serving_configs,
    summarize,
    summarize_evidence,
    summarize_fidelity,
    synthetic,
    write_report,
)
from pipeline.eval.evaluation import EvalError, RequestFailed, context_doc_id
from pipeline.eval.evidence import find_evidence
from pipeline.eval.report import PREDICTIONS_JSONL, REPORT_JSON, SCATTER_PNG
from pipeline.eval.runner import ItemResult
from pipeline.eval.scoring import qa_f1, score
from pipeline.ingest import Chunker
from pipeline.store import Store
from schemas.api import AnswerRequest
from schemas.config import ModelSpec, RouterSpec
from schemas.corpus import Document
from schemas.errors import TooLargeError, UnservableError
from schemas.modes import Mode, Variant
from schemas.store import StoreSpec
from serve.app import api_spec
from serve.config import AppConfig
from serve.http import make_api
from serve.local import InProcessBackend
from tests.support.ray_fixtures import ray_session  # noqa: F401  (fixture)
from tests.support.store_factory import build_store, entries_read_each_time

FIXTURES = eval_items.FIXTURES
CHUNK_TOKENS = 64


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Tiny models on a shared 2-core box: one thread beats two, which spin-wait for each other
    (up to 100× slower) whenever another process holds a core."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def fixture_items() -> list[QAItem]:
    return load_tasks(str(FIXTURES), LONGBENCH_QA_TASKS)


def test_instruction_context_and_query_rebuild_the_longbench_prompt():
    items = fixture_items()
    documents = corpus_documents(items)
    assert set(documents) == {context_doc_id(item) for item in items}  # contexts only: instructions are prompt
    for item in items:
        request = item_request(item, FakeView(), ServingSpec.of(Mode.QVPIC))
        rebuilt = request.instruction + documents[context_doc_id(item)] + request.query_prompt
        assert (rebuilt == item.prompt_before_context + item.context + item.query_after_context
                and request.query == item.question)
        assert item.question in item.query_after_context and "{" not in item.query_after_context
        assert request.query_prompt.rstrip().endswith("Answer:")  # the answer cue after the question


class FakeView:
    def chunk_ids(self, item: QAItem) -> list[str]:
        return [f"{context_doc_id(item)}#00000"]


def test_routing_query_is_the_bare_question_and_no_instruction_is_promoted(tmp_path):
    """On the LongBench fixture with the real MiniLM: the router embeds the question alone, scores only
    the context's chunks, and neither the instruction nor the answer cue is anywhere among them."""
    from pipeline.runtime import VLM, Embedder
    from schemas.modes import Variant
    from serve.config import RouterConfig
    from serve.routing import Router

    items = fixture_items()
    model, embedder = ModelSpec(path="tiny-qwen", device="cpu"), Embedder()
    vlm = VLM(model)
    chunker = Chunker(lambda text: len(vlm.adapter.encode(text)), CHUNK_TOKENS)
    documents = {doc_id: [c.text for c in chunker.chunk(Document(doc_id=doc_id, text=text, source="tests"))]
                 for doc_id, text in corpus_documents(items).items()}
    build_store(tmp_path, vlm, embedder, documents, variants=(Variant.TEMPLATE,))
    view = StoreView(Store.open(str(tmp_path)))
    router = Router(RouterConfig(store=str(tmp_path), model=model, max_chunks=256))
    embedded: list[str] = []
    embed_query = router.embed_query

    async def recording(query: str):
        embedded.append(query)
        return await embed_query(query)

    router.embed_query = recording
    for item in items:
        request = item_request(item, view, ServingSpec("qvpic", Mode.QVPIC, tau=1.0, max_high_res=2))
        planned = asyncio.run(router.plan(request))
        assert embedded[-1] == item.question  # the bare question, not "…Question: X\nAnswer:"
        assert [c.chunk_id for c in planned.chunks] == view.chunks_of_doc[context_doc_id(item)]
        question, tail = embedder.embed([item.question, item.query_after_context])
        chunk_vectors = embedder.embed([view.text_of[c.chunk_id] for c in planned.chunks])
        # the catalog stores embeddings as float16: cosines within 2e-3 of the float32 ones
        assert [c.relevance for c in planned.chunks] == pytest.approx((chunk_vectors @ question).tolist(), abs=2e-3)
        assert not np.allclose(chunk_vectors @ tail, chunk_vectors @ question, atol=1e-2)  # the old query scored apart
        promoted = [c for c in planned.chunks if c.tier == view.high_tier]
        assert 0 < len(promoted) <= 2
        instruction = item.prompt_before_context.strip().split("\n")[0]
        for chunk in planned.chunks:
            assert instruction not in view.text_of[chunk.chunk_id] and "Answer:" not in view.text_of[chunk.chunk_id]
    assert not any(doc_id.startswith("instruction") for doc_id in view.chunks_of_doc)


# ---- a small store shaped like the one `qvpic eval` ingests --------------------------------------
@pytest.fixture(scope="module")
def eval_store(tmp_path_factory, request):
    """Two synthetic items and one "unanswerable" qasper item, chunked at 64 tokens, every variant."""
    from pipeline.runtime import VLM, Embedder

    folder = tmp_path_factory.mktemp("synthetic-items")
    synthetic.write_jsonl(synthetic.generate(2, context_words=150, num_distractors=1, seed=3), str(folder))
    items = load_tasks(str(folder), [QATask.SYNTHETIC])
    items += [i for i in load_tasks(str(FIXTURES), [QATask.QASPER]) if i.answers == ("unanswerable",)]
    model = ModelSpec(path="tiny-qwen", device="cpu")
    vlm = VLM(model)
    chunker = Chunker(lambda text: len(vlm.adapter.encode(text)), CHUNK_TOKENS)
    documents = {doc_id: [c.text for c in chunker.chunk(Document(doc_id=doc_id, text=text, source="tests"))]
                 for doc_id, text in corpus_documents(items).items()}
    root = tmp_path_factory.mktemp("eval-store")
    build_store(root, vlm, Embedder(), documents)
    answerer = InProcessAnswerer.open(str(root), model, RouterSpec())
    return str(root), items, StoreView(Store.open(str(root))), answerer


def test_store_view_lists_the_context_chunks_in_order(eval_store):
    _, items, view, _ = eval_store
    for item in items:
        ids = view.chunk_ids(item)
        assert ids and all(c.startswith(context_doc_id(item) + "#") for c in ids)
        assert [int(c.rsplit("#", 1)[1]) for c in ids] == list(range(len(ids)))
    view.check(items)
    other = fixture_items()[0]  # a narrativeqa item this store never ingested
    with pytest.raises(EvalError, match="narrativeqa"):
        view.check(items + [other])


def test_every_mode_runs_and_is_scored(eval_store):
    _, items, view, answerer = eval_store
    results = run(items, list(Mode), answerer, view, max_new_tokens=3, progress=False)
    assert len(results) == len(items) * len(Mode) and not any(r.error for r in results)
    by = {(r.item_id, r.mode): r for r in results}
    for item in items:
        num_chunks = len(view.chunk_ids(item))
        for mode in Mode:
            r = by[(item.id, mode)]
            assert r.f1 == qa_f1(r.prediction, item.answers) and r.ttft_ms > 0
            assert (r.kv_nbytes > 0) == (mode not in (Mode.FULL_TEXT, Mode.FULL_IMAGE))
        assert by[(item.id, Mode.FULL_TEXT)].context_tokens == by[(item.id, Mode.TEXT_PIC)].context_tokens
        assert by[(item.id, Mode.UNIFORM_HIGH)].num_high == num_chunks and by[(item.id, Mode.IMAGE_PIC)].num_high == 0
        assert by[(item.id, Mode.IMAGE_PIC)].vision_tokens < by[(item.id, Mode.UNIFORM_HIGH)].vision_tokens
        # full_image prefills exactly the pages qvpic links
        assert by[(item.id, Mode.FULL_IMAGE)].context_tokens == by[(item.id, Mode.QVPIC)].context_tokens


def test_http_client_matches_in_process_and_records_errors(eval_store):
    uri, items, view, answerer = eval_store
    app = make_api(InProcessBackend(answerer.router, answerer.loader, answerer.generator),
                   api_spec(AppConfig(store=StoreSpec(uri=uri))))
    with TestClient(app, base_url="http://localhost") as client:  # the keyless mode answers loopback Hosts only
        http = HttpAnswerer("/v1/answer", client=client)
        local = run(items[:1], list(Mode), answerer, view, max_new_tokens=4, progress=False)
        remote = run(items[:1], list(Mode), http, view, max_new_tokens=4, progress=False)
        assert [r.prediction for r in remote] == [r.prediction for r in local]  # greedy: same tokens
        assert [r.context_tokens for r in remote] == [r.context_tokens for r in local]
        with pytest.raises(RequestFailed) as failure:
            http(AnswerRequest(query="q?", chunk_ids=["no-such-chunk"], max_new_tokens=2))
    assert failure.value.status_code == 404 and "no-such-chunk" in str(failure.value)


def test_a_failed_request_is_recorded_and_scored_zero(eval_store):
    _, items, view, _ = eval_store

    def too_large(request):
        raise TooLargeError("request needs 99999 tokens")

    results = run(items[:2], [Mode.QVPIC], too_large, view, progress=False)
    assert [r.f1 for r in results] == [0.0, 0.0] and all("TooLargeError" in r.error for r in results)


def test_cold_runs_find_no_cached_kv_whatever_ran_before(eval_store):
    """qvpic's cold request finds nothing in the device hot tier or the host cache, whether it runs first or
    right after uniform_high (which links the same high-tier entries); the warm one finds all on the device."""
    _, items, view, answerer = eval_store
    configs = [Mode.UNIFORM_HIGH, Mode.QVPIC]
    results = run(items, configs, answerer, view, clear_caches=answerer.clear_caches, seed=0, max_new_tokens=2,
                  progress=False)
    qvpic = [r for r in results if r.mode is Mode.QVPIC]
    assert [r.position for r in qvpic] == [0, 1, 0]  # seed 0: first, after uniform_high, first
    for r in results:
        num_chunks = len(view.chunk_ids(next(i for i in items if i.id == r.item_id)))
        assert (r.cache["device_hits"], r.cache["hits"], r.cache["misses"]) == (0, 0, num_chunks), r
        assert (r.cache_warm["device_hits"], r.cache_warm["misses"]) == (num_chunks, 0), r
        assert r.ttft_ms > 0 and r.ttft_warm_ms > 0
    # negative control: the runner without clearing (the old order-dependent state) finds qvpic's KV hot
    uncleared = run(items, configs, answerer, view, seed=0, max_new_tokens=2, progress=False)
    assert all(r.cache["device_hits"] > 0 for r in uncleared if r.mode is Mode.QVPIC)


def test_over_length_contexts_are_cut_in_the_middle(eval_store):
    assert middle_cut(list("abcdefg"), 4) == ["a", "b", "f", "g"] and middle_cut(list("abcde"), 3) == ["a", "b", "e"]
    _, items, view, answerer = eval_store
    item = max(items, key=lambda i: len(view.chunk_ids(i)))
    ids = view.chunk_ids(item)
    assert len(ids) >= 3
    seen: list[list[str]] = []

    def two_chunks_fit(request):
        seen.append(request.chunk_ids)
        if len(request.chunk_ids) > 2:
            raise TooLargeError("request needs more tokens than the context holds")
        return answerer(request)

    (result,) = run([item], [Mode.QVPIC], two_chunks_fit, view, max_new_tokens=2, progress=False)
    assert result.error is None and result.num_chunks_dropped == len(ids) - 2
    assert seen[-1] == [ids[0], ids[-1]] and result.context_tokens > 0  # the warm request: the same cut
    assert summarize([item], [result])[-1].num_truncated == 1

    def unservable(request):  # negative control: only an over-length refusal is truncated
        raise UnservableError("entries missing")

    (failed,) = run([item], [Mode.QVPIC], unservable, view, progress=False)
    assert "UnservableError" in failed.error and failed.num_chunks_dropped == 0


def test_fallbacks_and_full_image_phases_are_recorded(eval_store, monkeypatch):
    _, items, view, answerer = eval_store
    entries_read_each_time(answerer.router, monkeypatch)
    catalog = answerer.router.snapshot.catalog
    stored = catalog.entries_of
    high = ("high", Variant.TEMPLATE)  # as if never compiled: uniform_high falls back to the lowest tier
    monkeypatch.setattr(catalog, "entries_of", lambda rows: [{k: v for k, v in s.items() if k != high}
                                                             for s in stored(rows)])
    results = run(items[:1], [Mode.UNIFORM_HIGH, Mode.FULL_IMAGE], answerer, view, max_new_tokens=2, progress=False)
    uniform_high, full_image = results
    ids = view.chunk_ids(items[0])
    assert [(f["chunk_id"], f["requested_tier"], f["served_tier"]) for f in uniform_high.fallbacks] == [
        (c, "high", "low") for c in ids]
    rows = {s.config: s for s in summarize(items[:1], results) if s.task == "all"}
    assert rows["uniform_high"].num_fallbacks == len(ids)
    assert rows["full_image"].render_median_ms > 0 and rows["full_image"].prefill_median_ms > 0


def test_summary_matches_longbench_scoring_and_counts_errors():
    rng = random.Random(0)
    items = fixture_items()
    words = ["the", "Lund", "film", "academy", "Velona", "green", "four", "212", "km", "yes"]
    results = []
    for item in items:
        for mode in (Mode.QVPIC, Mode.TEXT_PIC):
            failed = rng.random() < 0.2
            prediction = "" if failed else " ".join(rng.sample(words, rng.randint(1, 4)))
            results.append(ItemResult(item.task, item.id, mode.value, mode, prediction, qa_f1(prediction, item.answers),
                                      None if failed else rng.uniform(1, 100), None if failed else 10, 0, 0, 0,
                                      None, "TooLargeError: no" if failed else None))
    summaries = summarize(items, results)
    for mode in (Mode.QVPIC, Mode.TEXT_PIC):
        mode_results = [r for r in results if r.mode is mode]
        expected = score([r.prediction for r in mode_results], items)
        rows = {s.task: s for s in summaries if s.mode is mode}
        for task, task_score in expected.items():
            assert rows[task.value].f1_percent == pytest.approx(task_score.f1_percent)
            assert rows[task.value].num_errors == sum(r.error is not None for r in mode_results if r.task is task)
        assert rows["all"].f1_percent == pytest.approx(sum(t.f1_percent for t in expected.values()) / len(expected))
        assert rows["all"].num_items == len(items)


def test_evidence_is_located_and_judged_per_served_tier(eval_store):
    _, items, view, answerer = eval_store
    synthetic_items = [i for i in items if i.task is QATask.SYNTHETIC]
    for item in synthetic_items:
        evidence = find_evidence(item, view)
        assert evidence and any(item.answers[0] in view.text_of[c] for c in evidence)
    unanswerable = next(i for i in items if i.task is QATask.QASPER)
    assert find_evidence(unanswerable, view) is None  # "unanswerable" is in the instruction, never searched

    configs = serving_configs([(1.0, 64)])
    results, num_unlocated = judge_items(items, view, planner(answerer.router), configs, OcrJudge(view),
                                         progress=False)
    assert num_unlocated == 1 and len(results) == len(synthetic_items) * len(configs)
    rows = {s.config: s for s in summarize_evidence(results, view.high_tier)}
    low, high, everything = rows["image_pic (uniform low)"], rows["uniform_high"], rows["qvpic τ=1 B=64"]
    assert low.evidence_high_percent == 0 and high.evidence_high_percent == 100
    assert high.char_accuracy_mean >= 0.9 and high.recovered_percent >= low.recovered_percent
    assert low.vision_tokens_median < high.vision_tokens_median
    # τ = 1 with a budget over the chunk count promotes every relevant chunk: the same pixels as uniform_high
    assert everything.recovered_percent <= high.recovered_percent
    assert everything.vision_tokens_median <= high.vision_tokens_median


def test_fidelity_of_every_cached_mode_through_the_serving_roles(eval_store):
    _, items, view, answerer = eval_store
    traces = ServedTraces(answerer, view, num_answer_tokens=4)
    configs = [ServingSpec.of(m) for m in Mode] + [ServingSpec("uniform low", Mode.UNIFORM, tier="low")]
    results = run_fidelity(items[:2], configs, traces, progress=False)
    cached = [c for c in configs if c.mode in REFERENCE_MODE]
    assert len(results) == 2 * len(cached) and not any(r.error for r in results)
    assert Mode.FULL_TEXT not in {r.mode for r in results}  # online modes are the references, not measured
    for r in results:
        f = r.fidelity
        item = next(i for i in items if i.id == r.item_id)
        assert f.num_tokens == len(answer_token_ids(answerer.generator.vlm, item, 4))
        assert f.kl > 0 and 0 < f.hidden_rel_l2 < 1 and 0 <= f.top1_agreement <= 1 and 0 <= f.top5_overlap <= 1
        assert r.reference is (Mode.FULL_TEXT if r.mode in (Mode.TEXT_PIC, Mode.TEXT_PIC_PLAIN) else Mode.FULL_IMAGE)
    # references are shared by configurations serving the same tiers: text, low (×3: plain, dummy, uniform
    # low), high (uniform_high, uniform) and qvpic's routed mix — at most 4 full prefills per item
    assert len(traces._references) <= 2 * 4
    by = {(r.item_id, r.config): r.fidelity for r in results}
    for item in items[:2]:  # uniform at the highest tier is uniform_high: the same plan, the same numbers
        assert by[(item.id, "uniform")] == by[(item.id, "uniform_high")]
    rows = summarize_fidelity(results)
    assert {(s.task, s.config) for s in rows} >= {("all", c.name) for c in cached}


def test_report_files(tmp_path, eval_store):
    _, items, view, answerer = eval_store
    results = run(items, [Mode.QVPIC, Mode.FULL_TEXT], answerer, view, max_new_tokens=2, progress=False)
    paths = write_report(str(tmp_path), {"data": "tests"}, summarize(items, results), results, [], [], 0)
    assert {Path(p).name for p in paths.values()} == {REPORT_MD, REPORT_JSON, SCATTER_PNG, PREDICTIONS_JSONL}
    with Image.open(paths[SCATTER_PNG]) as png:
        assert png.format == "PNG" and png.width > 100
    document = json.loads(Path(paths[REPORT_JSON]).read_text())
    assert {(s["task"], s["mode"]) for s in document["summary"]} == {
        (t, m) for t in ("synthetic", "qasper", "all") for m in ("qvpic", "full_text")}
    assert len(Path(paths[PREDICTIONS_JSONL]).read_text().splitlines()) == len(results)
    markdown = Path(paths[REPORT_MD]).read_text()
    assert "instruction" in markdown and "| qvpic |" in markdown


def test_item_sources_and_limit(tmp_path):
    parse = evaluate_job.parser().parse_args
    items, source = eval_items.load_items(parse(["--synthetic", "3", "--context-words", "80", "--seed", "5"]))
    assert [i.task for i in items] == [QATask.SYNTHETIC] * 3 and "synthetic" in source
    assert all(i.evidence and i.answers[0] in i.context for i in items)
    items, _ = eval_items.load_items(parse(["--limit", "2", "--tasks", "hotpotqa", "qasper"]))
    assert [i.task for i in items] == [QATask.HOTPOTQA] * 2 + [QATask.QASPER] * 2
    generic = tmp_path / "generic.jsonl"
    generic.write_text(json.dumps({"question": "Who?", "chunk_ids": ["d#00000"], "answers": ["Ann"]}) + "\n")
    items, _ = eval_items.load_items(parse(["--generic", str(generic)]))
    assert items[0].chunk_ids == ("d#00000",) and corpus_documents(items) == {}


def test_bad_data_is_a_clear_error(tmp_path, capsys):
    assert evaluate_job.main(["--data", str(tmp_path / "missing"), "--out", str(tmp_path / "out")]) == 2
    assert "missing" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        evaluate_job.main(["--legibility-grid", "1.5:2"])


@pytest.mark.e2e
def test_qvpic_eval_paper_end_to_end_on_the_fixtures(ray_session, tmp_path):  # noqa: F811
    """`qvpic eval --paper` on the bundled fixtures: the real ingest job, every configuration of the grid,
    fidelity of every cached one, the paper's tables and plots; the same command runs on real data."""
    out = tmp_path / "eval"
    argv = ["--paper", "--out", str(out), "--limit", "1", "--max-new-tokens", "4", "--tau-grid", "0.5", "1.0",
            "--budget-grid", "1", "2", "--fidelity-tokens", "4", "--quiet"]
    assert evaluate_job.main(argv) == 0
    document = json.loads((out / REPORT_JSON).read_text())
    grid = paper_grid(parse_tiers(list(PAPER_TIERS)), [0.5, 1.0], [1, 2])
    tasks = {t.value for t in LONGBENCH_QA_TASKS} | {"all"}
    assert {(s["task"], s["config"]) for s in document["summary"]} == {(t, c.name) for t in tasks for c in grid.configs}
    assert all(s["num_errors"] == 0 and 0 <= s["f1_percent"] <= 100 for s in document["summary"])
    assert {s["mode"] for s in document["summary"]} == {m.value for m in Mode} - {Mode.UNIFORM_HIGH.value}
    fidelity = {s["config"]: s for s in document["fidelity"]["summary"] if s["task"] == "all"}
    cached = {c.name for c in grid.main + tuple(grid.ablation.values()) + grid.dpi if c.mode in REFERENCE_MODE}
    assert set(fidelity) == cached and all(s["num_errors"] == 0 for s in fidelity.values())
    for name, summary in fidelity.items():  # linking multi-chunk contexts costs something, never nothing
        assert summary["median"]["kl"] > 0 and 0 < summary["median"]["hidden_rel_l2"] < 1, name
    markdown = (out / REPORT_MD).read_text()
    for heading in ("MuSiQue", "Avg", "TTFT ms", "vision tokens", "τ/B sweep", "DPI sweep", "hidden rel-L2",
                    "compile prefix", "qvpic_plain", "image_pic (prefix-free) high (120 DPI)", "TTFT ms warm",
                    "image_pic (dummy prefix)", "text_pic (prefix-free)", "uniform mid (96 DPI)", "qvpic → mid"):
        assert heading in markdown, heading
    for png in (SCATTER_PNG, SWEEP_PNG):
        with Image.open(out / png) as image:
            assert image.format == "PNG" and image.width > 100
    legibility = {s["config"]: s for s in document["legibility"]["summary"]}
    assert len(legibility) == len(serving_configs(evaluate_job.DEFAULT_GRID))
    assert legibility["uniform_high"]["recovered_percent"] >= legibility["image_pic (uniform low)"]["recovered_percent"]
    manifest = json.loads((out / "paper-store" / "manifest.json").read_text())
    assert [t["dpi"] for t in manifest["render"]["tiers"]] == [72, 96, 120] and len(manifest["variants"]) == 5
    assert manifest["ablation_tiers"] == "every"  # so the ablation's routed prefixes can promote
    overall = {s["config"]: s for s in document["summary"] if s["task"] == "all"}
    assert overall["qvpic_plain"]["num_high_median"] >= 1 and overall["qvpic_dummy"]["num_high_median"] >= 1
    # cold means cold: no answer from the response cache, every linked entry read from the store (none on the
    # device or in the loader's memory); control: the warm repeat does find them there
    results = [json.loads(line) for line in (out / PREDICTIONS_JSONL).read_text().splitlines()]
    linked = [r for r in results if r["cache"] and sum(r["cache"][k] for k in ("device_hits", "hits", "misses"))]
    assert linked and all(r["response_cache"] is None for r in results)
    assert all(r["cache"]["device_hits"] == 0 and r["cache"]["hits"] == 0 for r in linked)
    assert any(r["cache_warm"]["device_hits"] + r["cache_warm"]["hits"] > 0 for r in linked)
