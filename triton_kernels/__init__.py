"""Triton kernels for fastformer's ops, one module per op.

Each module exposes host functions with the C++ ops' signatures (csrc/ops.cpp):
``attention_fwd``/``attention_bwd``, ``add_layer_norm_fwd``/``_bwd``, ``feed_forward_fwd``/``_bwd``,
``cross_entropy_fwd``, ``linear_cross_entropy_fwd``/``_bwd``. They are imported lazily, on
first use, so importing this package never imports triton by itself.
"""
import importlib

_MODULE_OF = {
    "attention": "attention",
    "add_layer_norm": "add_layer_norm",
    "feed_forward": "feed_forward",
    "cross_entropy": "cross_entropy",
    "linear_cross_entropy": "cross_entropy",
}
MODULES = tuple(sorted(set(_MODULE_OF.values())))


def __getattr__(name):
    op = name.rsplit("_", 1)[0]
    if op not in _MODULE_OF or not name.endswith(("_fwd", "_bwd")):
        raise AttributeError(f"module 'triton_kernels' has no attribute {name!r}")
    try:
        module = importlib.import_module(f".{_MODULE_OF[op]}", __name__)
    except ImportError as exc:
        raise AttributeError(f"triton_kernels.{_MODULE_OF[op]} cannot be imported: {exc}") from exc
    return getattr(module, name)
