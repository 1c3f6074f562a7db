"""No import cycles among qvpic's modules: a reader can follow the layers one way."""

from __future__ import annotations

from tests.support.import_graph import cycles, import_graph, write


def test_no_import_cycles():
    graph = import_graph()
    assert len(graph) > 150 and any(graph.values())  # the scan sees the project
    assert cycles(graph) == []


def test_negative_control_a_planted_cycle_is_found(tmp_path):
    """A cycle through a lazy import inside a function is found; one through a TYPE_CHECKING import is not."""
    write(tmp_path, {"serve/__init__.py": "", "serve/a.py": "def f():\n    from serve.b import g\n",
                     "serve/b.py": "import serve.c\n", "serve/c.py": "from serve import a\n",
                     "serve/d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from serve.e import x\n",
                     "serve/e.py": "from serve.d import y\n"})
    assert cycles(import_graph(tmp_path, ("serve",))) == [["serve.a", "serve.b", "serve.c"]]


def test_negative_control_a_cycle_through_a_facade_is_found(tmp_path):
    """`from pipeline.store import Store` runs the module the facade names: the scan follows it there."""
    facade = ('from pipeline.facade import lazy_exports\n'
              '__getattr__, __dir__, __all__ = lazy_exports(__name__, {"store": ["Store"]})\n')
    write(tmp_path, {"pipeline/__init__.py": "", "pipeline/store/__init__.py": facade,
                     "pipeline/store/store.py": "from pipeline.runtime.model import VLM\nclass Store: ...\n",
                     "pipeline/runtime/__init__.py": "",
                     "pipeline/runtime/model.py": "from pipeline.store import Store\nclass VLM: ...\n"})
    assert cycles(import_graph(tmp_path, ("pipeline",))) == [["pipeline.runtime.model", "pipeline.store.store"]]
