"""Generation seals (docs/SECURITY.md): an HMAC, with a key the store does not hold, over the generation record
and every file of its snapshot dirs. `qvpic verify --hmac-key-file` and serving start refuse a generation whose
seal is missing or wrong; a router following the store refuses to switch to one; without a key nothing changes.
"""

from __future__ import annotations

import json
import re
import secrets
import shutil
from pathlib import Path

import pytest

from jobs import run_server, verify
from pipeline.store import SealError, Store, check_seal, hmac_key, publish_generation
from pipeline.store.generations import current_generation_number, read_generation
from schemas.generation import generation_path, seal_path
from serve.app import preflight
from serve.config import AppConfig, RouterConfig
from serve.routing import Router
from tests.support.store_factory import serving_store  # noqa: F401  (fixture)


@pytest.fixture(autouse=True)
def no_env_key(monkeypatch) -> None:
    monkeypatch.delenv("QVPIC_HMAC_KEY", raising=False)


def key_file(path: Path) -> Path:
    path.write_text(secrets.token_hex(32) + "\n")  # as `openssl rand -hex 32 > key` writes one
    return path


@pytest.fixture()
def sealed(serving_store, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the serving store whose current generation is published again, sealed; and its key file."""
    root = tmp_path / "store"
    shutil.copytree(serving_store.uri, root)
    key = key_file(tmp_path / "key")
    publish_generation(Store.open(str(root)), "sealed", hmac_key=hmac_key(key))
    return root, key


def texts_file(root: Path) -> Path:
    (path,) = (root / "serving" / "chunks").glob("*/texts.arrow")
    return path


def verify_exit(root: Path, key: Path | None, capsys) -> tuple[int, str]:
    code = verify.main(["--store", str(root), "--json", *(["--hmac-key-file", str(key)] if key else [])])
    return code, capsys.readouterr().out


def seal_findings(out: str) -> list[str]:
    return [f["detail"] for f in json.loads(out)["findings"] if f["check"] == "seal"]


class ServingStarted(Exception):
    pass


def serve_exit(root: Path, key: Path, capsys, monkeypatch) -> tuple[int, str]:
    """`qvpic serve` on the store: refused before Ray starts (a start would fail the test, not serve)."""
    import ray

    def started(*args, **kwargs):
        raise ServingStarted("qvpic serve went on to start Ray: the store was not refused")

    monkeypatch.setattr(ray, "init", started)
    code = run_server.main(["--store", str(root), "--model", "tiny-qwen", "--device", "cpu",
                            "--hmac-key-file", str(key)])
    return code, capsys.readouterr().err


def test_the_right_key_passes_verify_and_serving_start(sealed, capsys) -> None:
    root, key = sealed
    number = current_generation_number(Store.open(str(root)))
    code, out = verify_exit(root, key, capsys)
    assert code == 0 and seal_findings(out) == [] and json.loads(out)["counts"]["sealed generation"] == number
    seal = json.loads((root / seal_path(number)).read_text())
    assert key.read_text().strip() not in json.dumps(seal)  # the key is never written to the store
    assert any(p.endswith("/texts.arrow") for p in seal["files"]) and any(p.endswith("/entries.arrow")
                                                                          for p in seal["files"])
    args = AppConfig(store=str(root), model={"path": "tiny-qwen", "device": "cpu"}, hmac_key_file=key)
    assert args.router.hmac_key_file == key
    preflight(args)  # what `qvpic serve` and `serve deploy` run before any replica starts: no SealError


@pytest.mark.parametrize("tamper", ["chunk_text", "manifest", "seal_forged", "seal_removed", "wrong_key"])
def test_a_tampered_generation_fails_verify_and_serving_start(sealed, tamper: str, tmp_path: Path, capsys,
                                                              monkeypatch) -> None:
    root, key = sealed
    store = Store.open(str(root))
    number = current_generation_number(store)
    if tamper == "chunk_text":  # the text a chunk is answered and retrieved by, rewritten in place
        path = texts_file(root)
        path.write_bytes(path.read_bytes().replace(b"XK-4471-B", b"XK-9999-B"))
        reason = "changed since it was sealed"
    elif tamper == "manifest":  # the generation record's manifest, edited (still a valid record)
        record = json.loads((root / generation_path(number)).read_text())
        record["manifest"]["job_ids"].append("someone-else")
        (root / generation_path(number)).write_text(json.dumps(record))
        reason = "record .* changed after it was sealed"
    elif tamper == "seal_forged":  # the attacker re-seals everything, with a key of their own
        publish_generation(store, "forged", hmac_key=hmac_key(key_file(tmp_path / "their-key")))
        reason = "does not match the HMAC key"
    elif tamper == "seal_removed":
        (root / seal_path(number)).unlink()
        reason = "has no seal"
    else:  # the store is intact; the verifier holds another key
        key = key_file(tmp_path / "other-key")
        reason = "does not match the HMAC key"
    code, out = verify_exit(root, key, capsys)
    assert code == 1 and len(seal_findings(out)) == 1
    assert re.search(reason, seal_findings(out)[0]), seal_findings(out)
    code, err = serve_exit(root, key, capsys, monkeypatch)
    assert code == 2 and re.search(reason, err) and "not served" in err, err


def test_no_key_configured_changes_nothing(serving_store, tmp_path: Path, capsys) -> None:
    root = tmp_path / "store"
    shutil.copytree(serving_store.uri, root)
    assert not list((root / "serving").glob("seals/*"))  # published without a key: no seal written
    code, out = verify_exit(root, None, capsys)
    assert code == 0 and "sealed generation" not in json.loads(out)["counts"]
    preflight(AppConfig(store=str(root), model={"path": "tiny-qwen", "device": "cpu"}))


def test_a_router_refuses_to_switch_to_an_unsealed_generation(serving_store, sealed) -> None:
    root, key = sealed
    store = Store.open(str(root))
    config = {"store": str(root), "model": serving_store.model, "reload": {"enabled": False}}
    router = Router(RouterConfig(**config, hmac_key_file=key))
    open_router = Router(RouterConfig(**config))  # no key: follows whatever is published, as before
    first = router.generation
    unsealed = publish_generation(store, "no-key").generation  # e.g. a writer without the key
    assert not router.watcher.check() and router.generation == first
    assert "has no seal" in router.watcher.refused[unsealed]
    assert open_router.watcher.check() and open_router.generation == unsealed
    resealed = publish_generation(store, "with-key", hmac_key=hmac_key(key)).generation
    assert router.watcher.check() and router.generation == resealed
    publish_generation(store, "no-key-again")
    with pytest.raises(SealError, match="has no seal"):  # a router starting on an unsealed generation refuses to
        Router(RouterConfig(**config, hmac_key_file=key))
    router.watcher.close(), open_router.watcher.close()


def test_keys_are_read_from_a_file_or_the_environment_and_collected_seals_go_with_their_generation(
        sealed, tmp_path: Path, monkeypatch) -> None:
    root, key = sealed
    store = Store.open(str(root))
    record = read_generation(store, current_generation_number(store))
    monkeypatch.setenv("QVPIC_HMAC_KEY", key.read_text().strip())
    check_seal(store, record, hmac_key(None))  # the same key, from the environment
    short = tmp_path / "short"
    short.write_text("abc")
    with pytest.raises(SealError, match="needs at least 16"):
        hmac_key(short)
    with pytest.raises(SealError, match="not readable"):
        hmac_key(tmp_path / "absent")
    old = record.generation
    for lease in (root / "serving" / "leases").glob("*"):
        lease.unlink()  # no replica holds the old generation any more
    assert (root / seal_path(old)).exists()
    publish_generation(store, "next", hmac_key=hmac_key(key))  # ends by collecting what no one serves
    assert not (root / seal_path(old)).exists() and not (root / generation_path(old)).exists()
    assert (root / seal_path(old + 1)).exists()
