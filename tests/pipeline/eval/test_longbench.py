"""LongBench-format loading, prompt splitting and record validation, on the shipped fixture."""

from __future__ import annotations

import json
import zipfile

import pytest

from pipeline.eval import LONGBENCH_QA_TASKS, QAItem, QATask, load_generic, load_tasks
from pipeline.eval.longbench import MAX_NEW_TOKENS, PROMPT_TEMPLATES, DatasetError, split_prompt
from pipeline.eval.scoring import score
from tests.support.paths import REPO

FIXTURE = REPO / "jobs" / "data" / "longbench_fixture"


def full_prompt(item: QAItem) -> str:
    """The whole prompt for full-text serving (what LongBench's pred.py feeds the model)."""
    assert item.context is not None
    return item.prompt_before_context + item.context + item.query_after_context


def _records(task: QATask) -> list[dict]:
    return [json.loads(line) for line in (FIXTURE / f"{task.value}.jsonl").read_text(encoding="utf-8").splitlines()]


def test_fixture_loads_every_task_with_official_prompt_and_length():
    items = load_tasks(str(FIXTURE))
    assert [i.task for i in items] == [t for t in LONGBENCH_QA_TASKS for _ in _records(t)]
    by_id = {(r["dataset"], r["_id"]): r for t in LONGBENCH_QA_TASKS for r in _records(t)}
    for item in items:
        record = by_id[(item.task.value, item.id)]
        assert (item.question, item.context, list(item.answers)) == \
            (record["input"], record["context"], record["answers"])
        # What LongBench's pred.py feeds the model: the template formatted with the whole record.
        assert full_prompt(item) == PROMPT_TEMPLATES[item.task].format(**record)
        assert item.query_after_context.endswith(f"Question: {item.question}\n\nAnswer:"
                                                 if item.task in (QATask.NARRATIVEQA, QATask.QASPER)
                                                 else f"Question: {item.question}\nAnswer:")
        assert item.question not in item.prompt_before_context
        assert item.max_new_tokens == MAX_NEW_TOKENS[item.task]
        assert item.length_words == len(item.context.split())
        assert item.chunk_ids is None


def test_official_answer_lengths_and_template_anchors():
    assert {t.value: MAX_NEW_TOKENS[t] for t in LONGBENCH_QA_TASKS} == {
        "narrativeqa": 128, "qasper": 128, "multifieldqa_en": 64, "hotpotqa": 32, "2wikimqa": 32, "musique": 32}
    before, after = split_prompt(QATask.HOTPOTQA, "Who?")
    assert before.endswith("\n\nThe following are given passages.\n")
    assert after == ("\n\nAnswer the question based on the given passages. Only give me the answer and do not "
                     "output any other words.\n\nQuestion: Who?\nAnswer:")
    before, after = split_prompt(QATask.QASPER, "Why?")
    assert before.endswith("Do not provide any explanation.\n\nArticle: ")
    assert after.startswith("\n\n Answer the question based on the above article")  # the space is LongBench's
    before, _ = split_prompt(QATask.NARRATIVEQA, "What?")
    assert "as concisely" in before and before.endswith("\n\nStory: ")
    for task in QATask:
        assert PROMPT_TEMPLATES[task].count("{context}") == 1 and PROMPT_TEMPLATES[task].count("{input}") == 1


def test_braces_in_question_are_kept_literally():
    _, after = split_prompt(QATask.MUSIQUE, "What does {input} mean in {x}?")
    assert after.endswith("Question: What does {input} mean in {x}?\nAnswer:")


def test_zip_archive_gives_the_same_items(tmp_path):
    archive = tmp_path / "data.zip"
    with zipfile.ZipFile(archive, "w") as z:
        for task in LONGBENCH_QA_TASKS:
            z.write(FIXTURE / f"{task.value}.jsonl", f"data/{task.value}.jsonl")
    tasks = [QATask.MUSIQUE, QATask.QASPER]
    assert load_tasks(str(archive), tasks) == load_tasks(str(FIXTURE), tasks)
    assert {i.task for i in load_tasks(str(archive), tasks)} == set(tasks)


def test_missing_task_file_and_wrong_paths(tmp_path):
    (tmp_path / "hotpotqa.jsonl").write_text((FIXTURE / "hotpotqa.jsonl").read_text())
    assert len(load_tasks(str(tmp_path), [QATask.HOTPOTQA])) == 3
    with pytest.raises(DatasetError, match=r"task 'musique': no file .*musique\.jsonl"):
        load_tasks(str(tmp_path), [QATask.HOTPOTQA, QATask.MUSIQUE])
    archive = tmp_path / "data.zip"
    with zipfile.ZipFile(archive, "w") as z:
        z.write(FIXTURE / "hotpotqa.jsonl", "hotpotqa.jsonl")  # not under data/
    with pytest.raises(DatasetError, match="has no member 'data/hotpotqa.jsonl'"):
        load_tasks(str(archive), [QATask.HOTPOTQA])
    with pytest.raises(DatasetError, match="neither a folder"):
        load_tasks(str(tmp_path / "hotpotqa.jsonl"), [QATask.HOTPOTQA])
    with pytest.raises(DatasetError, match="load_generic"):
        load_tasks(str(tmp_path), [QATask.GENERIC])


def test_bad_records_are_all_reported_with_line_numbers(tmp_path):
    good = _records(QATask.HOTPOTQA)[0]
    lines = [
        json.dumps(good),
        "{not json",
        json.dumps({**good, "_id": "b", "answers": []}),
        "",  # blank lines are skipped, not errors
        json.dumps({**good, "_id": "c", "answers": "Velona"}),
        json.dumps({**good, "_id": "d", "input": "  "}),
        json.dumps({**good, "_id": "e", "dataset": "musique"}),
        json.dumps({**good, "_id": "f", "length": -3}),
        json.dumps(good),  # duplicate _id
        json.dumps(["a", "list"]),
        json.dumps({k: v for k, v in good.items() if k != "context"} | {"_id": "g"}),
        json.dumps({**good, "_id": "h", "answers": ["ok", 7]}),
    ]
    (tmp_path / "hotpotqa.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(DatasetError) as err:
        load_tasks(str(tmp_path), [QATask.HOTPOTQA])
    message = str(err.value)
    assert "10 bad record(s)" in message
    for expected in ["line 2:", "line 3: 'answers' must be a non-empty list", "line 5: 'answers'",
                     "line 6: 'input' must be a non-empty string", "line 7: 'dataset' is 'musique'",
                     "line 8: 'length' must be", f"line 9: id {good['_id']!r} already used on line 1",
                     "line 10: a record must be a JSON object", "line 11: 'context'", "line 12: 'answers'"]:
        assert expected in message
    assert "line 1:" not in message and "line 4:" not in message


def test_many_bad_records_are_summarised_and_non_utf8_is_named(tmp_path):
    (tmp_path / "musique.jsonl").write_text("[]\n" * 25)
    with pytest.raises(DatasetError, match=r"25 bad record\(s\)(.|\n)*and 5 more"):
        load_tasks(str(tmp_path), [QATask.MUSIQUE])
    (tmp_path / "qasper.jsonl").write_bytes(b'{"input": "\xff"}\n')
    with pytest.raises(DatasetError, match="not UTF-8"):
        load_tasks(str(tmp_path), [QATask.QASPER])
    (tmp_path / "narrativeqa.jsonl").write_text("\n\n")
    with pytest.raises(DatasetError, match="no records"):
        load_tasks(str(tmp_path), [QATask.NARRATIVEQA])


def test_generic_records_with_context_or_chunk_ids(tmp_path):
    path = tmp_path / "qa.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"id": "one", "question": "Who?", "context": "Ada did it.", "answers": ["Ada"]},
        {"question": "When?", "chunk_ids": ["k1", "k2"], "answers": ["1873", "in 1873"]},
    ]) + "\n")
    first, second = load_generic(str(path))
    assert (first.task, first.id, first.chunk_ids) == (QATask.GENERIC, "one", None)
    assert full_prompt(first) == PROMPT_TEMPLATES[QATask.GENERIC].format(context="Ada did it.", input="Who?")
    assert (second.id, second.context, second.chunk_ids) == ("L2", None, ("k1", "k2"))
    assert second.answers == ("1873", "in 1873")


def test_generic_rejects_ambiguous_or_empty_sources(tmp_path):
    path = tmp_path / "qa.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"question": "Q", "context": "c", "chunk_ids": ["k"], "answers": ["a"]},
        {"question": "Q", "answers": ["a"]},
        {"question": "Q", "chunk_ids": [], "answers": ["a"]},
        {"question": "Q", "chunk_ids": ["k", ""], "answers": ["a"]},
        {"id": 5, "question": "Q", "context": "c", "answers": ["a"]},
    ]) + "\n")
    with pytest.raises(DatasetError) as err:
        load_generic(str(path))
    message = str(err.value)
    assert "line 1: give exactly one" in message and "line 2: give exactly one" in message
    assert "line 3: 'chunk_ids'" in message and "line 4: 'chunk_ids'" in message and "line 5: 'id'" in message
    with pytest.raises(DatasetError, match="no file"):
        load_generic(str(tmp_path / "absent.jsonl"))


def test_gold_answers_score_full_marks_per_task():
    items = load_tasks(str(FIXTURE))
    scores = score([item.answers[0] for item in items], items)
    assert set(scores) == set(LONGBENCH_QA_TASKS)
    assert all(s.f1_percent == 100.0 and s.num_items == 3 for s in scores.values())
    assert all(s.f1_percent == 0.0 for s in score(["" for _ in items], items).values())
