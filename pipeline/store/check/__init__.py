"""`qvpic verify` and `--repair`: is a store consistent (manifest, generation, table parts, index rows,
shards), and the safe fixes, under the store's write lease."""

from pipeline.facade import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "repairs": ["repair"],
    "checks": ["verify"],
})
