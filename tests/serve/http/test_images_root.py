"""A chunk's stored `image_path` is opened only under the configured images root (docs/SECURITY.md).

The store's checksums prove integrity, not authenticity: a store entry naming `/etc/passwd`, `../../x.png` or a
link out of the root must not make a serving host open that file — the inspector returns no pixels (422), a
full_image answer is refused naming the chunk (422), and an entry that cannot be rebuilt from its refused page
is served from its lower-tier backup. A spy on `PIL.Image.open` proves nothing outside the root is opened.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import pytest
from PIL import Image
from pydantic import ValidationError

from pipeline.ingest.stages import compile_in_process
from pipeline.store import PageImageError, PageImageRefused, Store, page_image_file, publish_generation
from schemas.api import AnswerRequest
from schemas.corpus import ALL_COLLECTIONS, Chunk
from schemas.errors import PageImageRefusedError
from serve.app import api_spec
from serve.config import AppConfig, GeneratorConfig, RouterConfig
from serve.engine import Generator
from serve.http import make_api
from serve.kv import store_row
from serve.local import InProcessBackend
from serve.routing import Router
from serve.ui import Inspector, InspectorConfig
from tests.e2e.test_faults import SCAN_TEXT, add_scanned_page
from tests.serve.http.test_api import call
from tests.support.store_factory import MAX_CHUNKS, corrupt_entry, loader_of, serving_store  # noqa: F401  (fixture)

EVERY = frozenset({ALL_COLLECTIONS})  # the page tests read every collection: the root is what they test
HOSTILE = {"a-absolute": "/etc/passwd", "b-dotdot": "../../x.png", "c-link": "link.png"}  # doc id -> stored path


def png(path: Path, colour: str) -> Path:
    Image.new("RGB", (40, 20), colour).save(path)
    return path


@pytest.fixture()
def opened(monkeypatch) -> list[str]:
    """Every path `PIL.Image.open` is called with while the test runs."""
    calls: list[str] = []
    real = Image.open

    def spy(fp, *args, **kwargs):
        calls.append(str(fp))
        return real(fp, *args, **kwargs)

    monkeypatch.setattr(Image, "open", spy)
    return calls


@pytest.fixture()
def tree(tmp_path: Path) -> Path:
    """tmp/a/images is the root: scan-free files inside it, and real PNGs outside it that a hostile path names."""
    root = tmp_path / "a" / "images"
    root.mkdir(parents=True)
    png(root / "inside.png", "white")
    png(tmp_path / "x.png", "red")  # where root/../../x.png resolves
    (root / "link.png").symlink_to(png(tmp_path / "secret.png", "blue"))  # a link out of the root
    (root / "inner-link.png").symlink_to(root / "inside.png")  # a link that stays inside
    return root


def test_only_regular_files_under_the_root_resolve(tree: Path) -> None:
    root = str(tree)
    assert page_image_file(str(tree / "inside.png"), root) == str(tree / "inside.png")
    assert page_image_file("inside.png", root) == str(tree / "inside.png")  # relative: to the root
    assert page_image_file(str(tree / "inner-link.png"), root) == str(tree / "inside.png")
    for path, reason in [("/etc/passwd", "outside images_root"), ("../../x.png", "outside images_root"),
                         (str(tree / "link.png"), "outside images_root"), (str(tree / ".." / "images" / ".." / "x"),
                                                                           "outside images_root"),
                         ("a\x00b.png", "NUL")]:
        with pytest.raises(PageImageRefused, match=reason):
            page_image_file(path, root)
    os.mkfifo(tree / "pipe.png")  # opening it would block until a writer came: refused before any open
    with pytest.raises(PageImageRefused, match="not a regular file"):
        page_image_file(str(tree / "pipe.png"), root)
    with pytest.raises(PageImageRefused, match="no images_root is configured"):
        page_image_file(str(tree / "inside.png"), None)
    with pytest.raises(PageImageError, match="not readable") as missing:
        page_image_file(str(tree / "gone.png"), root)
    assert not isinstance(missing.value, PageImageRefused)  # inside the root but absent: unreadable, not refused


def test_ingest_and_recompile_stages_read_no_page_outside_their_root(serving_store, tmp_path: Path, tree: Path,
                                                                     opened: list[str]) -> None:
    root = tmp_path / "store"
    shutil.copytree(serving_store.uri, root)
    store = Store.open(str(root))
    chunk = Chunk.build("secret.png", 0, SCAN_TEXT, 5)
    source = [(chunk.chunk_key, chunk.text, str(tree.parent.parent / "secret.png"))]
    for images_root, reason in [(str(tree), "outside images_root"), (None, "no images_root is configured")]:
        errors = compile_in_process(store, store.load_manifest_or_raise(), serving_store.vlm, source,
                                    images_root=images_root)
        assert errors[chunk.chunk_key].startswith("render_failed: ") and reason in errors[chunk.chunk_key]
    assert opened == []


def test_images_root_is_an_absolute_path_set_once_for_generator_and_inspector(serving_store) -> None:
    base = {"store": serving_store.uri, "model": serving_store.model.model_dump(mode="json")}
    assert AppConfig(**base).generator.images_root is None
    assert AppConfig(**base, images_root="/srv/pages").generator.images_root == "/srv/pages"
    with pytest.raises(ValidationError, match="images_root must be an absolute path"):
        AppConfig(**base, images_root="pages")
    with pytest.raises(ValidationError, match=r"generator: set \['images_root'\] once"):
        AppConfig(**base, generator={"images_root": "/srv/pages"})


@pytest.fixture()
def hostile_store(serving_store, tmp_path: Path, tree: Path) -> Path:
    """The serving store plus one scanned page compiled from tree/scan.png, and three more occurrences of the same
    chunk (so they share its KV entries) whose rows name a hostile `image_path`."""
    root = tmp_path / "store"
    shutil.copytree(serving_store.uri, root)
    add_scanned_page(root, serving_store, tree / "scan.png")
    store = Store.open(str(root))
    chunks = [Chunk.build(doc, 0, SCAN_TEXT, len(serving_store.vlm.adapter.encode(SCAN_TEXT))) for doc in HOSTILE]
    vector = serving_store.embedder.embed([SCAN_TEXT])[0].tolist()
    store.publish_chunks([dict(c.model_dump(), embedding=vector, source=c.doc_id, image_path=HOSTILE[c.doc_id])
                          for c in chunks])
    publish_generation(store, "tests")
    return root


def app_over(root: Path, serving, images_root: str | None):
    router = Router(RouterConfig(store=str(root), model=serving.model, max_chunks=MAX_CHUNKS))
    generator = Generator(GeneratorConfig(store=str(root), model=serving.model, images_root=images_root))
    args = AppConfig(store={"uri": str(root)}, model=serving.model, router={"max_chunks": MAX_CHUNKS},
                     ingress={"default_top_k": 2})
    return make_api(InProcessBackend(router, loader_of(str(root)), generator), api_spec(args)), router


def test_the_inspector_returns_no_pixels_from_outside_the_root(hostile_store: Path, tree: Path,
                                                                 opened: list[str]) -> None:
    inspector = Inspector(InspectorConfig(store=str(hostile_store), images_root=str(tree)))
    assert inspector.page_png("scan.png#00000", "low", 0, EVERY).startswith(b"\x89PNG")  # the control: inside the root
    assert opened == [str(tree / "scan.png")]
    for doc in HOSTILE:
        with pytest.raises(PageImageRefusedError, match="outside images_root") as refused:
            inspector.page_png(f"{doc}#00000", "low", 0, EVERY)
        assert refused.value.status_code == 422 and doc in str(refused.value)
        # the stored path and the root are the server's: the answer names the chunk and a stable code instead
        assert HOSTILE[doc] not in str(refused.value) and str(tree) not in str(refused.value)
        assert "[outside_images_root]" in str(refused.value)
    assert opened == [str(tree / "scan.png")]  # nothing more was opened
    unset = Inspector(InspectorConfig(store=str(hostile_store)))
    with pytest.raises(PageImageRefusedError, match="no images_root is configured"):
        unset.page_png("scan.png#00000", "low", 0, EVERY)
    assert len(opened) == 1


def test_the_answer_path_refuses_cleanly_and_serves_what_remains(serving_store, hostile_store: Path, tree: Path,
                                                                 opened: list[str]) -> None:
    app, router = app_over(hostile_store, serving_store, str(tree))
    body = {"query": "When does the Glacier order ship?", "mode": "full_image", "max_new_tokens": 2}
    assert call(app, "POST", "/v1/answer", json={**body, "chunk_ids": ["scan.png#00000"]}).status_code == 200
    assert set(opened) == {str(tree / "scan.png")}
    for doc in HOSTILE:
        reply = call(app, "POST", "/v1/answer", json={**body, "chunk_ids": [f"{doc}#00000"]})
        assert reply.status_code == 422, reply.text
        assert f"{doc}#00000" in reply.json()["detail"] and "outside images_root" in reply.json()["detail"]
        assert HOSTILE[doc] not in reply.text and str(tree) not in reply.text  # no host path: a code instead
        assert "[outside_images_root]" in reply.json()["detail"]
    assert set(opened) == {str(tree / "scan.png")}

    # a corrupt high entry is rebuilt from the source the store names first by chunk id: a-absolute's
    # /etc/passwd. Refused, so the low backup serves it and the fallback says why.
    linked = {"query": "When does the Glacier order ship?", "chunk_ids": ["scan.png#00000"], "mode": "qvpic",
              "tau": 1.0, "max_new_tokens": 2}
    high = asyncio.run(router.plan(AnswerRequest(**linked))).chunks[0].entry
    assert high.tier == "high"
    corrupt_entry(hostile_store, store_row(high.row))
    app, _ = app_over(hostile_store, serving_store, str(tree))
    reply = call(app, "POST", "/v1/answer", json=linked)
    assert reply.status_code == 200, reply.text
    (fallback,) = reply.json()["fallbacks"]
    assert (fallback["served_tier"], "outside images_root" in fallback["reason"]) == ("low", True)
    assert "/etc/passwd" not in reply.text and "[outside_images_root]" in fallback["reason"]
    assert set(opened) == {str(tree / "scan.png")}


def test_no_images_root_reads_no_page_image(serving_store, hostile_store: Path, tree: Path,
                                            opened: list[str]) -> None:
    app, _ = app_over(hostile_store, serving_store, None)
    reply = call(app, "POST", "/v1/answer", json={"query": "Glacier?", "chunk_ids": ["scan.png#00000"],
                                                  "mode": "full_image", "max_new_tokens": 2})
    assert reply.status_code == 422 and "no images_root is configured" in reply.json()["detail"]
    assert opened == []
