"""Triton kernels for fastformer's ops, one module per op: ``fastformer.triton_kernels``.

Never importable as a top-level ``triton_kernels``: that name is the Triton project's own package.

Each module of ``MODULES`` (an op's ``triton_module`` in ``fastformer/op_table.py``) defines the
host functions of its ops, ``<op>_fwd`` and ``<op>_bwd`` as the table lists them, with the C++
schemas' signatures (csrc/schemas.h), as plain module attributes registered as
``fastformer_triton::<name>`` torch ops. Importing this package imports neither triton nor any
of them; importing a module imports triton.
"""
from ..op_table import TABLE

MODULES = tuple(sorted({op.triton_module for op in TABLE}))
