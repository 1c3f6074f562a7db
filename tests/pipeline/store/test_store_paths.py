"""Paths a store's records name are checked: a generation's `chunks_dir` / `entries_dir` must stay inside the
store (relative, no `.`/`..` segment), refused with the reason when a record is published and when it is opened
(issue 37: they were joined unchecked, so a record could point readers — and the sweep's deletions — anywhere)."""

from __future__ import annotations

import json
import shutil

import pytest

from pipeline.store import Store, current_generation_number
from pipeline.store.generations import read_generation
from schemas.generation import Generation, generation_path
from tests.support.store_factory import serving_store  # noqa: F401  (fixture)

HOSTILE = ["../../../etc", "/etc", "chunks/../../x", "chunks/./x", "chunks//x", "c:\\x", "~root/x", "chunks/x/",
           ".."]


@pytest.fixture(scope="module")
def copied(serving_store, tmp_path_factory):
    root = tmp_path_factory.mktemp("store-paths") / "store"
    shutil.copytree(serving_store.uri, root)
    store = Store.open(str(root))
    return store, current_generation_number(store)


@pytest.mark.parametrize("field", ["chunks_dir", "entries_dir"])
@pytest.mark.parametrize("path", HOSTILE)
def test_a_record_pointing_outside_the_store_is_refused_at_open(copied, field, path):
    store, number = copied
    record = json.loads(store.blobs.get(generation_path(number)))
    good = record[field]
    try:
        store.blobs.put(generation_path(number), json.dumps({**record, field: path}).encode())
        with pytest.raises(ValueError, match=f"generation {number}'s record is refused.*{field}"):
            read_generation(store, number)
    finally:
        store.blobs.put(generation_path(number), json.dumps({**record, field: good}).encode())
    assert getattr(read_generation(store, number), field) == good  # the control: the real record opens


def test_publishing_such_a_record_is_refused(copied):
    store, number = copied
    record = read_generation(store, number).model_dump()
    with pytest.raises(ValueError, match="chunks_dir"):
        Generation.model_validate({**record, "chunks_dir": "../elsewhere"})
