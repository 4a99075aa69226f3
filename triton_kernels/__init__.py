"""Triton kernels for fastformer's ops, one module per op, installed as ``fastformer.triton_kernels``.

The source lives in the repository's top-level ``triton_kernels/`` folder; setup.py maps it into
fastformer's namespace (``package_dir``), so a top-level ``import triton_kernels`` keeps meaning
the Triton project's own package. Import it as ``fastformer.triton_kernels`` only.

Each module of ``MODULES`` defines the host functions of its ops, with the C++ ops' signatures
(csrc/ops.cpp), as plain module attributes registered as ``fastformer_triton::<name>`` torch ops:
``attention.attention_fwd`` / ``attention_bwd``, ``attention_varlen.attention_varlen_fwd`` / ``_bwd``,
``add_layer_norm.add_layer_norm_fwd`` / ``_bwd``,
``feed_forward.feed_forward_fwd`` / ``_bwd``, ``embedding.embedding_fwd`` / ``_bwd``, ``cross_entropy.cross_entropy_fwd`` and
``cross_entropy.linear_cross_entropy_fwd`` / ``_bwd``. Importing this package imports neither
triton nor any of them; importing a module imports triton.
"""

MODULES = ("add_layer_norm", "attention", "attention_varlen", "cross_entropy", "embedding", "feed_forward")
