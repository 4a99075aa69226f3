from typing import Optional, Tuple, Union

import torch

from .. import backends, philox
from ..autograd import AddLayerNormFunction
from ..internal import fast, validation
from ..internal.eager import eager
from ..internal.rows import as_rows, as_shape
from . import reference

# what the backend choice reads of a call: the hidden size bounds the Triton kernels; on a GPU the
# rest places the call in a class of the measured table (fastformer/backends/measured.py)
_FACTS = ("hidden_size",)
_GPU_FACTS = ("hidden_size", "rows", "dropout")
_CPU = torch.device("cpu")
# The CPU fast path's backend question, memoised: (the thread's request, FASTFORMER_BACKEND's raw
# value, dtype, C) -> the Kernels select_eager answered (None where none or an error: the checked
# path asks again). The key is what select_eager reads of such a call, read as it reads it (the
# thread's request only once any thread made one: backends.ASKED), so a tuple's dict lookup stands
# for its call (its 7-field key, the request decoded); cleared with its cache by the declarations'
# invalidate() (backends.memo).
_CPU_KERNELS = backends.memo()
_MISS = object()
_ASKED, _state, _env_raw, _ENV_KEY = backends.ASKED, backends._state, backends._env_raw, backends._ENV_KEY


def add_layer_norm(x: torch.Tensor, residual: Optional[torch.Tensor], weight: Optional[torch.Tensor],
                   bias: Optional[torch.Tensor], eps: float = 1e-5, dropout_p: float = 0.0, *,
                   prenorm: bool = False, x_bias: Optional[torch.Tensor] = None,
                   rms_norm: bool = False) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Fused dropout + residual add + LayerNorm (or RMSNorm) over the last dimension.

    Post-LN (default): returns ``LayerNorm(residual + dropout(x))``.
    Pre-LN (``prenorm=True``): returns ``(LayerNorm(h), h)`` with ``h = residual + dropout(x)``,
    so the block can carry ``h`` on as its next residual without a second pass.

    Args:
        x: ``(..., C)``, any hidden size C.
        residual: same shape as x, or None (then ``h = dropout(x)``).
        weight, bias: ``(C,)`` LayerNorm affine parameters, or None for no affine.
        eps: added to the variance.
        dropout_p: dropout probability applied to x before the add (pass 0 in eval).
        x_bias: ``(C,)`` or None: the bias of the linear layer that produced x, added to x before
            the dropout. Passing it instead of adding it in the layer spares the layer's own bias
            pass (``nn.Linear`` copies its bias over the output, and sums its gradient).
        rms_norm: RMSNorm instead of LayerNorm (T5LayerNorm, LlamaRMSNorm): ``y = weight *
            round(h * rstd) (+ bias)`` with ``rstd = 1 / sqrt(mean(h^2) + eps)``, no mean; ``round``
            is T5's cast of the normalised value to the input dtype (bf16 / fp16; a no-op in fp32).
            The bias is allowed (added after the weight multiply, as in FlashAttention's RMSNorm);
            T5 and LLaMA pass None.

    Statistics are computed in fp32 for every input dtype; under ``torch.autocast`` the
    inputs are cast to the autocast dtype.
    """
    if x.__class__ in fast.PLAIN and not fast.compiling():
        # the backend question (_kernels', its device branches inline: is_cpu / is_cuda are cheaper
        # than device, and the CPU's key holds one device object, compared by identity)
        shape = x.shape
        C = shape[-1] if shape else 0
        if x.is_cpu:
            key = (_state.__dict__.get("name") if _ASKED[0] else None, _env_raw(_ENV_KEY), x.dtype, C)
            kernels = _CPU_KERNELS.get(key, _MISS)
            if kernels is _MISS:
                kernels = _cpu_kernels(key, x.dtype, C)
        else:
            try:
                kernels = _kernels(x, x.device, x.dtype, C, dropout_p) if C and fast.number(dropout_p) else None
            except RuntimeError:
                kernels = None  # (the checked path raises it again)
        op = kernels.add_layer_norm if kernels is not None else None
        entry = fast.DIRECT.get(op)
        if entry is not None:
            # the direct entry checks the rest of the call itself (the rest of fast.ready(), the
            # arguments: csrc/autograd/add_layer_norm.cpp) and answers None where the call is the
            # checked path's (internal/fast.py)
            out = entry(x, residual, weight, bias, eps, dropout_p, prenorm, x_bias, rms_norm)
        else:  # a C++ op without an entry (another library's), or none: _fast checks, then fast.call
            out = None if op is None else fast.attempt(_fast, op, x, residual, weight, bias, eps, dropout_p,
                                                      prenorm, x_bias, rms_norm)
        if out is not None:
            return out
    return _checked(x, residual, weight, bias, eps, dropout_p, prenorm, x_bias, rms_norm)


def _cpu_kernels(key, dtype, C):
    """select_eager's answer for a CPU call (None for an error: the checked path raises it again),
    kept under ``key`` unless the declarations changed meanwhile (as select keeps its own)."""
    generation = backends.GENERATION[0]
    try:
        kernels = backends.select_eager("add_layer_norm", _CPU, dtype, _FACTS, (C,))
    except RuntimeError:
        kernels = None
    if backends.GENERATION[0] == generation:
        if len(_CPU_KERNELS) >= 64:  # (C and dtype as a model uses them: a few)
            _CPU_KERNELS.clear()
        _CPU_KERNELS[key] = kernels
    return kernels


def _kernels(x, device, dtype, C, dropout_p):
    """The backend's kernels for this call (both paths ask the same question)."""
    if device.type == "cuda":
        return backends.select_cached("add_layer_norm", device, dtype, None, _GPU_FACTS,
                                      (C, x.numel() // C, dropout_p > 0.0))
    return backends.select_cached("add_layer_norm", device, dtype, None, _FACTS, (C,))


def _fast(op, x, residual, weight, bias, eps, dropout_p, prenorm, x_bias, rms_norm):
    """The registered C++ op's call (no direct entry) without the checks it makes (internal/fast.py),
    or None where the call is the checked path's."""
    if not (fast.ready() and weight is not None and (bias is not None or rms_norm is True)
            and fast.plain(residual, weight, bias, x_bias) and fast.number(eps) and fast.number(dropout_p)
            and prenorm.__class__ is bool and rms_norm.__class__ is bool):
        return None
    dt, dev = x.dtype, x.device
    if (weight.dtype is not dt or (bias is not None and bias.dtype is not dt)
            or (x_bias is not None and x_bias.dtype is not dt)):
        return None  # (the checked path casts parameters to x's dtype)
    if bias is None:  # RMSNorm without a bias (T5, LLaMA): the kernels add zeros, as the checked path's
        if weight.dim() != 1:
            return None  # (the checked path words it)
        bias = torch.zeros(x.shape[-1], dtype=dt, device=dev)
    # x and residual as they are: the C++ op takes their rows and returns x's shape without a view node;
    # every tensor on x's device (fast.call's check)
    out = fast.call(op, (x, residual, weight, bias, eps, dropout_p, prenorm,
                         x_bias if x_bias is None else x_bias.contiguous(), rms_norm), 7, dropout_p, dev)
    return out if prenorm or out is None else out[0]


def _checked(x, residual, weight, bias, eps, dropout_p, prenorm, x_bias, rms_norm=False):
    validation.tensor("x", x, min_ndim=1, floating=True)
    validation.nonempty_dim("x", x, -1, "the hidden size C normalised over")
    C = x.shape[-1]
    if residual is not None:
        validation.tensor("residual", residual, floating=True)
        validation.shape("residual", residual, x.shape, "the shape of x")
    for name, p in (("weight", weight), ("bias", bias), ("x_bias", x_bias)):
        if p is not None:
            validation.tensor(name, p, ndim=1, floating=True)
            validation.shape(name, p, (C,), "(C,) with C = x.shape[-1]")
    validation.same_device(x=x, residual=residual, weight=weight, bias=bias, x_bias=x_bias)
    prenorm = validation.flag("prenorm", prenorm)
    rms_norm = validation.flag("rms_norm", rms_norm)
    dropout_p = validation.probability("dropout_p", dropout_p)
    eps = validation.positive("eps", eps)

    lowp = validation.autocast_dtype(x.device)
    x, residual = validation.cast(x, lowp), validation.cast(residual, lowp)
    validation.same_dtype(x=x, residual=residual)

    kernels = _kernels(x, x.device, x.dtype, C, dropout_p)
    if kernels is None:
        return reference.add_layer_norm(x, residual, weight, bias, eps, dropout_p, prenorm=prenorm, x_bias=x_bias,
                                        rms_norm=rms_norm)
    shape = x.shape
    w = weight if weight is not None else torch.ones(C, dtype=x.dtype, device=x.device)
    b = bias if bias is not None else torch.zeros(C, dtype=x.dtype, device=x.device)
    w, b, xb = validation.cast(w, x.dtype), validation.cast(b, x.dtype), validation.cast(x_bias, x.dtype)
    xb = xb.contiguous() if xb is not None else None
    with validation.autocast_off(x.device):
        if kernels.add_layer_norm is not None and eager():  # the backward in C++; it takes x's rows itself
            y, h = kernels.add_layer_norm(x, residual, w, b, eps, dropout_p, prenorm,
                                          philox.draw(dropout_p, x.device), xb, rms_norm)
        else:  # on (N, C) rows
            y, h = AddLayerNormFunction.apply(as_rows(x, C), as_rows(residual, C) if residual is not None else None,
                                              w, b, eps, dropout_p, bool(prenorm), kernels, xb, rms_norm)
    if prenorm:
        return as_shape(y, shape), as_shape(h, shape)
    return as_shape(y, shape)
