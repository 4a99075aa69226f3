"""The one table of fastformer's fused ops. Every other list of ops derives from it or is held to it
by ``tests/test_op_table.py``.

Derived here or read from here: the ops the backends bind kernels for and their optional C++
overloads (``backends.declaration``), the Triton module of each op (``backends.builtin``,
``fastformer.triton_kernels.MODULES``), the tests' list of ops (``tests/utils.py``).
Held to it by the test, because each lives with code that cannot live here: the public functions
(``fastformer.ops`` and ``fastformer.ops.reference``), the C++ schemas and kernels
(``csrc/schemas.h``, ``csrc/cpu``), the fakes (``fastformer/fake_ops.py``), the Triton host
functions, ``python -m fastformer check`` (``jobs/check.py``) and ``bench`` (``jobs/bench/ops.py``),
and each op's test file (``tests/test_<op>.py``).

Adding an op starts with a row here; ``pytest tests/test_op_table.py`` then names every list it
is still missing from (CONTRIBUTING.md walks through the rest).
"""
from dataclasses import dataclass
from typing import Dict, Tuple


@dataclass(frozen=True)
class Op:
    """One fused op.

    ``kernels``: the kernel functions every kernel backend provides as ``<name>_<fn>``, the C++
    schemas' names (``fwd``, and ``bwd`` where the backward is a kernel of its own; cross_entropy
    writes its gradient in the forward). ``overloads``: optional variants a C++ backend may add as
    ``<name>_<fn>.<overload>`` (``fn.overload``). ``triton_module``: the module of
    ``fastformer.triton_kernels`` with its Triton host functions. ``bench``: it has a
    ``python -m fastformer bench --ops`` entry of its own."""
    name: str
    kernels: Tuple[str, ...] = ("fwd", "bwd")
    overloads: Tuple[str, ...] = ()
    triton_module: str = ""
    bench: bool = True

    def __post_init__(self):
        if not self.triton_module:  # by default the op's own module
            object.__setattr__(self, "triton_module", self.name)

    @property
    def functions(self) -> Tuple[str, ...]:
        """The kernel functions' names: ``attention_fwd``, ``attention_bwd``, ..."""
        return tuple(f"{self.name}_{fn}" for fn in self.kernels)

    @property
    def overload_names(self) -> Tuple[str, ...]:
        """The optional overloads as torch names them: ``attention_varlen_bwd.into``, ..."""
        return tuple(f"{self.name}_{overload}" for overload in self.overloads)


TABLE: Tuple[Op, ...] = (
    Op("attention"),
    # attention_varlen's backward may write into given gradients (bwd.into: the packed q/k/v's views)
    Op("attention_varlen", overloads=("bwd.into",)),
    # add_layer_norm with the producing linear layer's bias fused in (x_bias)
    Op("add_layer_norm", overloads=("fwd.x_bias", "bwd.x_bias")),
    Op("feed_forward"),
    Op("cross_entropy", kernels=("fwd",)),
    Op("linear_cross_entropy", triton_module="cross_entropy"),
    Op("embedding"),
)

BY_NAME: Dict[str, Op] = {op.name: op for op in TABLE}
NAMES: Tuple[str, ...] = tuple(BY_NAME)
