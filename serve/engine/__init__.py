"""The generator and its engine: one thread owns the model and batches every request's forward passes
(scheduler, sequences), the generator deployment builds each request's context, and the detokenizer
streams its text."""

from pipeline.facade import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "detokenizer": ["Detokenizer"],
    "generator": ["Generator"],
})
