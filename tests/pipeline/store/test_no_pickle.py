"""No code runs from data: stored data is safetensors, Parquet, JSON, and (serving generations) Arrow IPC,
numeric .npy and a faiss index only; no load path unpickles;
`torch.load` only with `weights_only=True`; remote model code only when the operator turns it on; no
`eval`/`exec`. Checked two ways: our source, parsed, and the load paths, run under an audit hook.
"""

from __future__ import annotations

import ast
import asyncio
import json
import pickle
import sys
import threading
from pathlib import Path

import numpy as np

from pipeline.runtime import VLM
from pipeline.store import Store
from schemas.api import AnswerRequest
from schemas.config import ModelSpec
from schemas.modes import Mode
from schemas.sampling import Sampling
from serve.config import GeneratorConfig, RouterConfig
from serve.engine import Generator
from serve.kv import LocalLoader
from serve.routing import Router
from tests.support.paths import REPO
from tests.support.store_factory import MAX_CHUNKS, loader_of, serving_store  # noqa: F401  (pytest fixture)

PACKAGES = ("schemas", "pipeline", "serve", "jobs", "benchmarks")
UNSAFE_MODULES = {"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "shelve", "marshal", "joblib"}
UNSAFE_CALLS = {"eval", "exec", "compile", "__import__"}
SAFE_KEYWORD = {"torch": ("weights_only", True), "np": ("allow_pickle", False), "numpy": ("allow_pickle", False)}
UNSAFE_ATTRIBUTE_CALLS = {("pd", "read_pickle"), ("pandas", "read_pickle"), ("yaml", "load"), ("yaml", "unsafe_load"),
                          ("np", "load"), ("numpy", "load"), ("torch", "load")}


def source_files() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (REPO / package).rglob("*.py"))


def findings(path: Path) -> list[str]:
    """Every unsafe import, call or keyword in one file, as `path:line: what`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        where = f"{path.relative_to(REPO)}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            found += [f"{where}: import {a.name}" for a in node.names if a.name.split(".")[0] in UNSAFE_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in UNSAFE_MODULES:
            found.append(f"{where}: from {node.module} import")
        elif isinstance(node, ast.Call):
            func = node.func
            keywords = {k.arg: k.value for k in node.keywords}
            if isinstance(func, ast.Name) and func.id in UNSAFE_CALLS:
                found.append(f"{where}: {func.id}()")
            elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) \
                    and (func.value.id, func.attr) in UNSAFE_ATTRIBUTE_CALLS:
                name, value = SAFE_KEYWORD.get(func.value.id, (None, None))
                given = keywords.get(name)
                if name is None or not (isinstance(given, ast.Constant) and given.value is value):
                    found.append(f"{where}: {func.value.id}.{func.attr}() without {name}={value}")
            trust = keywords.get("trust_remote_code")
            if isinstance(trust, ast.Constant) and trust.value is True:
                found.append(f"{where}: trust_remote_code=True")
    return found


def test_our_source_has_no_unpickling_no_eval_no_forced_remote_code():
    files = source_files()
    assert len(files) > 40 and REPO / "pipeline" / "store" / "store.py" in files
    assert [f for path in files for f in findings(path)] == []


def test_the_scan_would_catch_each_pattern(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import pickle\nfrom dill import loads\nimport torch, numpy as np, yaml\n"
                     "torch.load('w.pt')\ntorch.load('w.pt', weights_only=True)\nnp.load('a.npy', allow_pickle=True)\n"
                     "yaml.load(s)\neval('1')\nexec('x = 1')\nf(trust_remote_code=True)\nf(trust_remote_code=flag)\n")
    global REPO
    repo, REPO = REPO, tmp_path
    try:
        lines = [int(f.split(":")[1]) for f in findings(probe)]
    finally:
        REPO = repo
    assert lines == [1, 2, 4, 6, 7, 8, 9, 10]


class Unpickling:
    """Records every unpickle in this process while active: the `pickle.find_class` audit event (C and
    Python unpicklers resolving a global) and calls of pickle's entry points."""

    hooked = False
    events: list[str] = []
    active = threading.Event()

    def __enter__(self) -> Unpickling:
        if not Unpickling.hooked:
            sys.addaudithook(self._audit)  # hooks cannot be removed: gated by `active`
            Unpickling.hooked = True
        Unpickling.events = []
        self._originals = {name: getattr(pickle, name) for name in ("load", "loads", "Unpickler")}
        for name, original in self._originals.items():
            setattr(pickle, name, self._recording(name, original))
        Unpickling.active.set()
        return self

    def __exit__(self, *exc: object) -> None:
        Unpickling.active.clear()
        for name, original in self._originals.items():
            setattr(pickle, name, original)

    @staticmethod
    def _audit(event: str, args: tuple) -> None:
        if event == "pickle.find_class" and Unpickling.active.is_set():
            Unpickling.events.append(f"find_class {args}")

    @staticmethod
    def _recording(name: str, original):
        def recorded(*args, **kwargs):
            Unpickling.events.append(f"pickle.{name}")
            return original(*args, **kwargs)
        return recorded


def test_store_files_are_safetensors_parquet_or_json(serving_store):
    files = [p for p in Path(serving_store.uri).rglob("*") if p.is_file()]
    # serving generations add Arrow IPC files, plain numeric .npy arrays and a faiss index
    assert {p.suffix for p in files} == {".safetensors", ".parquet", ".json", ".arrow", ".npy", ".faiss"}
    for path in files:
        head = path.read_bytes()[:16]
        if path.suffix == ".safetensors":  # u64 little-endian header size, then the JSON header
            assert path.read_bytes()[8:9] == b"{"
        elif path.suffix == ".parquet":
            assert head[:4] == b"PAR1" and path.read_bytes()[-4:] == b"PAR1"
        elif path.suffix == ".arrow":
            assert head[:6] == b"ARROW1" and path.read_bytes()[-6:] == b"ARROW1"
        elif path.suffix == ".npy":  # no object dtype: loads with allow_pickle=False
            assert head[:6] == b"\x93NUMPY" and np.load(path, allow_pickle=False).dtype.hasobject is False
        elif path.suffix == ".faiss":  # faiss's own binary format, a fourcc first
            assert head[:4] in (b"IxSQ", b"IwSq")
        else:
            json.loads(path.read_text())
        assert not head.startswith(b"\x80")  # a pickle's PROTO opcode


def test_load_paths_never_unpickle(serving_store):
    with Unpickling() as seen:
        store = Store.open(serving_store.uri)
        store.load_manifest_or_raise()
        store.load_many(store.index())
        store.chunks(), store.quarantined()
        model = ModelSpec(path=serving_store.model.path, device="cpu")
        VLM(model)
        router = Router(RouterConfig(store=serving_store.uri, model=model, max_chunks=MAX_CHUNKS))
        loader = loader_of(serving_store.uri)
        generator = Generator(GeneratorConfig(store=serving_store.uri, model=model))
        for mode in (Mode.QVPIC, Mode.TEXT_PIC, Mode.FULL_IMAGE):
            plan = asyncio.run(router.plan(AnswerRequest(query="When does part XK-4471-B ship?", top_k=2, mode=mode,
                                                         max_new_tokens=2)))
            generator.generate_blocking(plan, Sampling(max_new_tokens=2), source=LocalLoader(loader))
    assert seen.events == []


def test_the_audit_would_catch_an_unpickle():
    with Unpickling() as seen:
        pickle.loads(pickle.dumps(Path("x")))
    assert seen.events[:1] == ["pickle.loads"] and any(e.startswith("find_class") for e in seen.events)


def test_remote_code_is_off_unless_the_operator_sets_it():
    assert ModelSpec().trust_remote_code is False  # and no call in our source forces it (scan above)
