"""fake_ops against the C++ library's schemas: register() skips a fake whose op a loaded library lacks
(a stale build keeps loading), so a misspelt name there would be skipped silently; this build must
define every faked op, and every traced op of the library must have its fake."""
import torch

from fastformer import _ext, fake_ops

NOT_TRACED = {"cpu_capability", "dropout_fill"}  # a host query and a test hook, never in a compiled graph
PYTHON_FAKED = {"next_seed"}  # defined with its fake in fastformer/philox.py


def _library_ops():
    assert _ext.load_error() is None
    return {n.split("::", 1)[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("fastformer::")}


def test_every_fake_names_an_op_of_the_library():
    assert set(fake_ops.FAKES) - _library_ops() == set()


def _composite_ops():
    """The differentiable ops (csrc/autograd/<op>.cpp): CompositeImplicitAutograd, so a tracer sees
    the kernels they call (which have fakes), never the op itself."""
    return {n for n in _library_ops()
            if torch._C._dispatch_has_kernel_for_dispatch_key(f"fastformer::{n}", "CompositeImplicitAutograd")}


def test_every_traced_op_of_the_library_has_a_fake():
    assert _library_ops() - NOT_TRACED - PYTHON_FAKED - _composite_ops() - set(fake_ops.FAKES) == set()


def test_every_op_of_the_table_has_its_differentiable_op():
    """Each op of fastformer/op_table.py has its C++ differentiable op (and only those are composite)."""
    from fastformer import op_table

    assert _composite_ops() - NOT_TRACED == set(op_table.NAMES)


def test_defined_reads_overload_names():
    assert fake_ops.defined("fastformer", "attention_varlen_bwd.into")
    assert not fake_ops.defined("fastformer", "attention_varlen_bwd.nope")
    assert not fake_ops.defined("fastformer", "attention_varlen_bwdd")
