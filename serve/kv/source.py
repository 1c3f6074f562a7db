"""What a generator loads the KV its device tier lacks from: the loader's host and store tiers, a hop away or here.

`KVSource.load(plan)` reads every planned chunk that names an entry (the others go unread) and answers a
`LoadResult` aligned with `plan.chunks`: KV in the wire form, where each came from, what could not be read and its
backup. It is awaited on the generator's event loop and never blocks it. Two implementations:

    LoaderDeployment   the CacheLoader deployment through its Serve handle (`loader_placement: deployment`): one
                       host LRU shared by every generator replica; a caller that goes away cancels the call
    LocalLoader        a CacheLoader in this process, on a worker thread: each generator replica's own
                       (`loader_placement: in_generator`, built in the replica from its `LoaderConfig`), and every
                       in-process stack (serve/local.py `build_local`: eval, benchmarks, tests)

`GivenKV` stands in for both where a caller already holds what was loaded (a reference answer served from exactly
that KV, `Generator.generate(..., source=GivenKV(result))`).
"""

from __future__ import annotations

from typing import Protocol

from pipeline.runtime import off_loop
from serve.config import LoaderConfig
from serve.handles import cancelling
from serve.kv.loader import CacheLoader
from serve.plan import LoadResult, Plan


class KVSource(Protocol):
    """Where the KV a generator's device tier lacks comes from."""

    def opened(self) -> KVSource:
        """This source, ready in the process that uses it (a generator calls it once, at start: what Serve bound
        into the deployment is left as it was bound)."""
        ...

    async def load(self, plan: Plan) -> LoadResult:
        """The plan's entries (chunks with no entry are skipped), aligned with `plan.chunks`."""
        ...


class LoaderDeployment:
    """The CacheLoader deployment, through its handle (Serve hands the generator a `DeploymentHandle`)."""

    def __init__(self, handle):
        self.handle = handle  # ray.serve.handle.DeploymentHandle of CacheLoader

    def opened(self) -> LoaderDeployment:
        return self

    async def load(self, plan: Plan) -> LoadResult:
        return await cancelling(self.handle.load.remote(plan))


class LocalLoader:
    """A CacheLoader in this process. Given a `LoaderConfig` (what `build_app` binds for `in_generator`), the loader
    is built when the source is opened, in the replica: each generator replica opens its own store reader and host
    LRU (what Serve bound stays a config it can copy)."""

    def __init__(self, loader: CacheLoader | LoaderConfig):
        self.config = loader if isinstance(loader, LoaderConfig) else loader.config
        self._loader = None if isinstance(loader, LoaderConfig) else loader

    @property
    def loader(self) -> CacheLoader:
        if self._loader is None:
            raise RuntimeError("a LocalLoader over a config is opened first (`opened()`), in the process that uses it")
        return self._loader

    def opened(self) -> LocalLoader:
        return self if self._loader is not None else LocalLoader(CacheLoader(self.config))

    async def load(self, plan: Plan) -> LoadResult:
        return await off_loop(self.loader.load, plan)


class GivenKV:
    """KV already loaded: every `load` answers it (the plan must be the one it was loaded for)."""

    def __init__(self, result: LoadResult):
        self.result = result

    def opened(self) -> GivenKV:
        return self

    async def load(self, plan: Plan) -> LoadResult:
        if len(plan.chunks) != len(self.result.kvs):
            raise ValueError(f"given KV of {len(self.result.kvs)} chunks for a plan of {len(plan.chunks)}")
        return self.result
