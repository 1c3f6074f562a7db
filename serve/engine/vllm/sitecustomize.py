"""Copied into the vLLM venvs' site-packages (`make install-vllm`, benchmarks/peer/setup_vllm.sh): Python imports
`sitecustomize` at start-up.

The only torchvision wheel the package index has for torch 2.13 is a CUDA build: its native library cannot
load next to torch+cpu, so none of its operators is defined, and its Python side then fails at import on
`register_fake("torchvision::nms")` ("operator torchvision::nms does not exist"), taking transformers' image
processors (and so vLLM's image path) with it. This defines the schemas of the operators it registers fake
kernels for unconditionally, once the native library has failed to load and before those registrations run, so the pure
Python parts (transforms, `io` decoders aside) import and work; calling one of these ops would still fail.
No file of site-packages is edited. In the project's tree this module does nothing (its name is not
`sitecustomize` there).
"""

import importlib.abc
import sys

# torchvision/csrc/ops/nms.cpp's schemas (torchvision 0.28): the two fake kernels _meta_registrations.py
# registers unconditionally (its others are skipped when `extension._has_ops()` is false).
SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}
TRIGGER = "torchvision._meta_registrations"  # imported by torchvision/__init__ after extension.py tried _C
_libraries = []  # torch.library.Library objects must stay alive for their definitions to stay


def define_missing() -> None:
    import torch

    library = None
    for name, schema in SCHEMAS.items():
        try:
            torch._C._dispatch_find_schema_or_throw(f"torchvision::{name}", "")
        except RuntimeError:  # not defined: the native library did not load
            library = library or torch.library.Library("torchvision", "DEF")
            library.define(schema)
    if library is not None:
        _libraries.append(library)


class _BeforeMetaRegistrations(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname == TRIGGER:
            sys.meta_path.remove(self)
            define_missing()
        return None  # the ordinary finders import the module itself


if __name__ == "sitecustomize":
    sys.meta_path.insert(0, _BeforeMetaRegistrations())
