"""Request log and `qvpic cost-report`: generated logs (local and S3), and attribution through the app with auth."""

from __future__ import annotations

import json
import random
from collections import defaultdict
from datetime import datetime, timedelta, timezone

import pyarrow.parquet as pq
import pytest
from PIL import Image

from jobs import cost_report
from schemas.store import StoreSpec
from serve.governance import key_digest
from serve.governance.config import AuthConfig, RequestLogConfig
from serve.governance.request_log import RequestLog, RequestRecord
from tests.serve.governance.test_budget import governed_app
from tests.serve.http.test_api import call
from tests.serve.http.test_metrics import metric
from tests.support.fixtures_s3 import S3Server, s3_bucket, s3_server  # noqa: F401  (fixtures)
from tests.support.store_factory import roles, serving_store  # noqa: F401  (fixtures)

START = datetime(2026, 3, 1, tzinfo=timezone.utc)
TENANTS = ("acme", "globex", "initech")
TASKS = (None, "qa", "summary")


def generated_records(num_rows: int, seed: int = 11) -> list[RequestRecord]:
    rng = random.Random(seed)
    records = []
    for i in range(num_rows):
        vision, text = rng.randrange(0, 4000), rng.randrange(20, 400)
        records.append(RequestRecord(
            time=START + timedelta(minutes=i), request_id=f"r{i}", tenant=rng.choice(TENANTS),
            task_type=rng.choice(TASKS), route=rng.choice(["answer", "chat", "estimate"]), mode="qvpic",
            status=rng.choice([200, 200, 200, 200, 413, 429]), cache_level=rng.choice([None, None, "l1", "l2"]),
            num_chunks=4, high_res_chunks=rng.randrange(0, 4), context_tokens=vision + text, vision_tokens=vision,
            text_tokens=text, query_tokens=rng.randrange(5, 40), completion_tokens=rng.randrange(1, 64),
            kv_loaded_bytes=rng.randrange(1 << 20), ttft_ms=rng.uniform(5, 500), total_ms=rng.uniform(5, 900)))
    return records


def write_log(spec: StoreSpec, records: list[RequestRecord], batch_rows: int) -> None:
    log = RequestLog(RequestLogConfig(location=spec, batch_rows=batch_rows))
    for record in records:
        log.append(record)
    log.close()


def expected_by_task(records: list[RequestRecord]) -> dict[tuple[str, str], dict[str, int]]:
    totals: dict[tuple[str, str], dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for r in records:
        row = totals[(r.tenant, r.task_type or cost_report.NO_TASK)]
        row["requests"] += 1
        row["errors"] += r.status >= 400
        served = r.status < 400 and r.route != "estimate"
        row["cache_hits"] += served and r.cache_level is not None
        tokens = r.context_tokens + r.query_tokens + r.completion_tokens
        if served and r.cache_level is None:
            row["computed_tokens"] += tokens
            row["vision_tokens"] += r.vision_tokens
        elif served:
            row["saved_tokens"] += tokens
    return totals


def test_cost_report_of_a_generated_log(tmp_path, capsys):
    records = generated_records(300)
    write_log(StoreSpec(uri=str(tmp_path / "log")), records, batch_rows=64)
    parts = sorted(p.name for p in (tmp_path / "log").iterdir())
    assert len(parts) == 5 and all(p.startswith("part-") and p.endswith(".parquet") for p in parts)
    chart = tmp_path / "out" / "cost.png"
    assert cost_report.main(["--log", str(tmp_path / "log"), "--chart", str(chart), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    expected = expected_by_task(records)
    assert {(r["tenant"], r["task_type"]): {k: r[k] for k in expected[(r["tenant"], r["task_type"])]}
            for r in rows} == {key: dict(value) for key, value in expected.items()}
    assert chart.stat().st_size > 10_000
    with Image.open(chart) as image:
        assert image.format == "PNG" and image.width >= 800 and len(image.getcolors(1 << 16) or []) > 4

    assert cost_report.main(["--log", str(tmp_path / "log"), "--chart", str(chart)]) == 0
    table = capsys.readouterr().out
    assert all(tenant in table for tenant in TENANTS) and "Cost by tenant and task type" in table
    since = (START + timedelta(minutes=250)).isoformat()
    assert cost_report.main(["--log", str(tmp_path / "log"), "--chart", str(chart), "--json", "--since", since]) == 0
    assert sum(r["requests"] for r in json.loads(capsys.readouterr().out)) == 50


def test_cost_report_errors_are_clear(tmp_path, capsys):
    assert cost_report.main(["--log", str(tmp_path / "nothing-here")]) == 2
    assert "qvpic cost-report:" in capsys.readouterr().err
    write_log(StoreSpec(uri=str(tmp_path / "log")), generated_records(3), batch_rows=10)
    assert cost_report.main(["--log", str(tmp_path / "log"), "--since", "2030-01-01", "--chart",
                             str(tmp_path / "c.png")]) == 2
    assert "no request-log rows" in capsys.readouterr().err


def test_log_on_s3(s3_server: S3Server, s3_bucket: str, tmp_path, capsys):
    spec = StoreSpec(uri=f"s3://{s3_bucket}/qvpic/requests", endpoint_url=s3_server.endpoint_url)
    records = generated_records(40, seed=5)
    write_log(spec, records, batch_rows=16)
    keys = [o["Key"] for o in s3_server.client().list_objects_v2(Bucket=s3_bucket)["Contents"]]
    assert len(keys) == 3 and all(k.startswith("qvpic/requests/part-") for k in keys)
    assert cost_report.main(["--log", spec.uri, "--endpoint-url", s3_server.endpoint_url, "--json",
                             "--chart", str(tmp_path / "c.png")]) == 0
    assert sum(r["requests"] for r in json.loads(capsys.readouterr().out)) == 40


def test_tenants_come_from_api_keys_and_every_request_is_logged(roles, serving_store, tmp_path):
    keys = {"key-acme-1": "acme", "key-globex-1": "globex"}
    app, governor = governed_app(roles, serving_store,
                                 auth={"api_key_sha256": {key_digest(k): t for k, t in keys.items()},
                                       "open_paths": ["/healthz", "/metrics"]},  # metric() reads /metrics keyless
                                 request_log={"location": {"uri": str(tmp_path / "log")}})
    body = {"query": "When does part XK-4471-B ship?", "chunk_ids": ["invoices#00000"], "max_new_tokens": 3}
    unauthorized = metric(app, "qvpic_errors_total", route="answer", status="401")
    missing = call(app, "POST", "/v1/answer", json=body)
    assert missing.status_code == 401 and missing.headers["WWW-Authenticate"] == "Bearer"
    assert call(app, "POST", "/v1/answer", json=body, headers={"Authorization": "Bearer nope"}).status_code == 401
    assert metric(app, "qvpic_errors_total", route="answer", status="401") - unauthorized == 2
    acme = {"Authorization": "Bearer key-acme-1", "X-Tenant": "globex"}  # the key decides, not X-Tenant
    assert call(app, "POST", "/v1/answer", json={**body, "task_type": "qa"}, headers=acme).status_code == 200
    assert call(app, "POST", "/v1/answer", json=body, headers={**acme, "X-Task-Type": "qa"}).status_code == 200
    chat = call(app, "POST", "/v1/chat/completions", headers={"Authorization": "Bearer key-globex-1"}, json={
        "model": "qvpic", "messages": [{"role": "user", "content": body["query"]}], "max_tokens": 3,
        "temperature": 0, "user": "end-user-7", "qvpic": {"chunk_ids": ["invoices#00000"], "task_type": "chat-qa"}})
    assert chat.status_code == 200
    assert call(app, "POST", "/v1/answer", json={**body, "chunk_ids": ["nope"]}, headers=acme).status_code == 404
    bad_task = call(app, "POST", "/v1/answer", json=body, headers={**acme, "X-Task-Type": "bad task!"})
    assert bad_task.status_code == 400 and "X-Task-Type" in bad_task.json()["detail"]
    governor.close()
    rows = pq.read_table(tmp_path / "log").sort_by("time").to_pylist()
    assert [(r["tenant"], r["task_type"], r["route"], r["status"], r["cache_level"]) for r in rows] == [
        ("acme", "qa", "answer", 200, None), ("acme", "qa", "answer", 200, "l1"),
        # a chat is keyed by its rendered conversation: not the native answer's entry
        ("globex", "chat-qa", "chat", 200, None), ("acme", None, "answer", 404, None)]
    assert [r["end_user"] for r in rows] == [None, None, "end-user-7", None]  # OpenAI's `user`: not the tenant
    assert rows[0]["context_tokens"] == rows[0]["vision_tokens"] + rows[0]["text_tokens"] > 0
    assert rows[0]["completion_tokens"] == 3 and rows[0]["kv_loaded_bytes"] >= 0 and rows[0]["ttft_ms"] > 0


def test_auth_config_takes_digests_only():
    with pytest.raises(ValueError, match="64 lowercase hex"):
        AuthConfig(api_key_sha256={"plain-key": "acme"})
