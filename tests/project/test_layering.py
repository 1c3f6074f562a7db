"""Dependencies run one way, subpackage by subpackage (docs/ARCHITECTURE.md, "Layering and naming rules"):

    schemas ← pipeline.runtime ← pipeline.store ← pipeline.ingest, pipeline.eval
                                                ← serve.{config, plan, metrics, handles} ← serve.kv ← serve.routing
                                                                                          ← serve.engine
                                                                                          ← serve.dispatch
                                                  serve.governance ← serve.ui ← serve.http (the ingress: no model stack)
                                                ← serve.kv ← serve.ui.inspector (the /ui pages' store side)
    serve.app binds them all, serve.local builds them in-process; jobs wire everything; nothing imports jobs or
    benchmarks.
    pipeline.facade and pipeline.priority are leaves (no imports of ours) that every layer may use.
    serve.governance.config (schemas only) sits below serve.config, which nests it in the ingress's config.

Checked on the source (tests/support/import_graph.py: every import, lazy ones inside functions too, facade names
resolved to the module that defines them), so a new upward import fails here rather than in a reader's head.

`pipeline.eval` never imports `serve`: the evaluation harness reaches the serving path through its
`Answerer` seam (pipeline/eval/evaluation.py), answered over HTTP by a deployed service or in-process by
the roles `jobs/eval_serving.py` wires. That seam is the point, not a dodge: the same harness measures a
live deployment, which an import of the serving roles could not.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.support.import_graph import import_graph, write
from tests.support.paths import REPO

PRODUCT = ("schemas", "pipeline", "serve", "jobs")  # what users run (benchmarks and tests are not the product)

PIPELINE = {"schemas", "pipeline.facade", "pipeline.priority", "pipeline.runtime", "pipeline.store"}
SERVE_BASE = PIPELINE | {"serve.governance.config", "serve.deployment", "serve.config", "serve.plan", "serve.metrics",
                         "serve.handles"}
SERVE = SERVE_BASE | {"serve.kv", "serve.routing", "serve.engine", "serve.dispatch", "serve.governance", "serve.http",
                      "serve.ui", "serve.ui.inspector", "serve.app", "serve.local"}
# layer -> the layers it may import (its own always)
MAY_IMPORT = {
    "schemas": set(),
    "pipeline": set(),
    "pipeline.facade": set(),
    "pipeline.priority": set(),  # the CPU priority of client-sized work: os calls only, so the ingress may use it
    "pipeline.runtime": {"schemas", "pipeline.facade", "pipeline.priority"},
    "pipeline.store": {"schemas", "pipeline.facade", "pipeline.priority", "pipeline.runtime"},
    "pipeline.ingest": PIPELINE,
    "pipeline.eval": PIPELINE,
    "serve": {"pipeline.facade"},
    # the governance configs nest in the ingress's: typed beside governance, imported by serve.config, never back
    "serve.governance.config": {"schemas"},
    "serve.deployment": {"schemas"},  # one deployment's replicas and resources, nested in serve.config's
    "serve.config": {"schemas", "serve.governance.config", "serve.deployment"},
    "serve.plan": {"schemas"},
    "serve.metrics": set(),
    "serve.handles": set(),
    "serve.kv": SERVE_BASE,
    "serve.routing": SERVE_BASE | {"serve.kv"},
    "serve.engine": SERVE_BASE | {"serve.kv"},
    "serve.dispatch": SERVE_BASE | {"serve.kv"},  # reads the hot tier's reports
    "serve.governance": SERVE_BASE - {"pipeline.runtime"},
    "serve.http": SERVE_BASE - {"pipeline.runtime", "pipeline.store"} | {"serve.governance", "serve.ui"},
    # the /ui routes live in the ingress (no model stack); their store side is a deployment of its own
    "serve.ui": SERVE_BASE - {"pipeline.runtime", "pipeline.store"} | {"serve.governance"},
    "serve.ui.inspector": SERVE_BASE | {"serve.kv", "serve.ui"},
    "serve.app": SERVE - {"serve.local"},
    "serve.local": SERVE,
    "jobs": PIPELINE | {"pipeline.ingest", "pipeline.eval"} | SERVE,
    "benchmarks": PIPELINE | {"pipeline.ingest", "pipeline.eval", "jobs", "benchmarks"} | SERVE,
}


def layer(module: str) -> str:
    """The longest layer name that is `module` or a package above it."""
    return max((name for name in MAY_IMPORT if module == name or module.startswith(name + ".")), key=len)


def upward_imports(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    found = {}
    for module, targets in graph.items():
        allowed = MAY_IMPORT[layer(module)] | {layer(module)}
        wrong = sorted(t for t in targets if layer(t) not in allowed)
        if wrong:
            found[module] = wrong
    return found


def test_every_module_has_a_layer():
    assert {layer(module) for module in import_graph()} == set(MAY_IMPORT)


@pytest.mark.parametrize("package", ["schemas", "pipeline", "serve", "jobs", "benchmarks"])
def test_imports_point_down(package):
    graph = {m: t for m, t in import_graph().items() if m == package or m.startswith(package + ".")}
    assert upward_imports(graph) == {}


def test_negative_control_upward_imports_are_seen(tmp_path):
    """A lazy import inside a function, and a facade name whose module sits in a higher layer, are both seen."""
    facade = ('from pipeline.facade import lazy_exports\n'
              '__getattr__, __dir__, __all__ = lazy_exports(__name__, {"router": ["Router"]})\n')
    write(tmp_path, {"serve/__init__.py": "", "serve/routing/__init__.py": facade,
                     "serve/routing/router.py": "class Router: ...\n",
                     "serve/kv/__init__.py": "", "serve/kv/loader.py": "from serve.routing import Router\n",
                     "serve/http/__init__.py": "", "serve/http/ingress.py": "def f():\n    import serve.kv.loader\n"})
    graph = import_graph(tmp_path, ("serve",))
    assert upward_imports(graph) == {"serve.http.ingress": ["serve.kv.loader"],
                                     "serve.kv.loader": ["serve.routing.router"]}


def class_names(root: Path, packages: tuple[str, ...] = PRODUCT) -> dict[str, list[str]]:
    """Every class defined at a module's top level under `packages`, by name: where each is defined."""
    found: dict[str, list[str]] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            for node in ast.parse(path.read_text()).body:
                if isinstance(node, ast.ClassDef):
                    found.setdefault(node.name, []).append(str(path.relative_to(root)))
    return found


def test_no_class_name_is_defined_twice_in_the_product():
    """One word per concept (issue 57): a reader who meets `Choice` or `Selection` finds one class by that name."""
    assert {name: where for name, where in class_names(REPO).items() if len(where) > 1} == {}


def test_negative_control_a_second_class_of_a_name_is_seen(tmp_path):
    write(tmp_path, {"serve/__init__.py": "", "serve/plan.py": "class Choice: ...\n",
                     "serve/routing/hybrid.py": "from enum import Enum\nclass Choice(str, Enum): ...\n"})
    assert class_names(tmp_path, ("serve",))["Choice"] == ["serve/plan.py", "serve/routing/hybrid.py"]
