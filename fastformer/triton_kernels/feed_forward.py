"""Triton feed-forward: ``linear(dropout(act(linear(x, w1, b1))), w2, b2)`` as fused GEMMs.

The host functions keep the C++ schemas (csrc/ops.cpp) and are registered as the torch ops
``fastformer_triton::feed_forward_fwd`` / ``_bwd`` so that torch.compile traces them without a
graph break (``torch.library.triton_op`` + ``wrap_triton`` on a GPU; under ``TRITON_INTERPRET=1``
a ``custom_op`` with a fake, because triton_op traces its body into the graph and the
interpreter cannot run on fake tensors).

Forward, x (N, E), w1 (F, E), w2 (E, F):
    pre = x @ w1^T + b1, a = dropout(act(pre))   one GEMM, bias/activation/dropout in its epilogue
    out = a @ w2^T + b2                           one GEMM, bias in its epilogue
Backward, dout (N, E):
    dpre = (dout @ w2) * keep * scale * act'(pre), a recomputed   one GEMM, epilogue regenerates
                                                                 the dropout mask from (seed, offset)
    dw2 = dout^T @ a,  db2 = dout.sum(0)       one GEMM; its first column block's programs also
                                               sum their dout^T rows into db2
    dw1 = dpre^T @ x,  db1 = dpre.sum(0)       one GEMM, likewise
    dx  = dpre @ w1                            one GEMM
Only ``pre`` (N, F) is kept between forward and backward.

Gated (w3 (F, E), b3 given: ``linear(dropout(act(linear(x, w1, b1)) * linear(x, w3, b3)), w2, b2)``):
    [g | u] = x @ [w1; w3]^T + [b1; b3]          one GEMM (N x 2F, the weights concatenated: a copy
                                                 of 2FE elements), bias in its epilogue; kept (N, 2F)
    h = dropout(act(g) * u)                      one elementwise kernel (_glu_fwd)
    out = h @ w2^T + b2                          one GEMM
Backward: dh = dout @ w2 (one GEMM), then one elementwise kernel (_glu_bwd) writes
[dg | du] = [dh keep u act'(g) | dh keep act(g)] and h for dw2; dw2 = dout^T h (+ db2),
[dw1; dw3] = [dg | du]^T x (+ [db1; db3]) and dx = [dg | du] @ [w1; w3]: one GEMM each. The gate's
product stays out of the GEMM epilogue: an (M, N) tile there would need its partner tile of the
other half.

The weight-gradient GEMMs reduce over the N tokens into an (F, E) / (E, F) output that may hold
fewer 128 x 128 tiles than the GPU has SMs (E = 512, F = 2048: 64 tiles for 132 SMs). Every GEMM
above goes through ``matmul.launch``, which then splits K (split-K, see triton_kernels/matmul.py):
fp32 partials per K slice, summed in a fixed slice order by a second kernel that applies the same
epilogue, bias gradients included, so the results are deterministic. GEMMs whose tiles fill the
GPU, or whose K is short, keep the single fused kernel.
"""
import contextlib
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from . import matmul
from .matmul import _activation, _activation_grad, _cast
from .registration import launcher, register_op
from .utils import cdiv, dropout_keep_tile, dropout_threshold, load_philox, philox_args

ACTIVATIONS = ("relu", "gelu", "silu", "gelu_tanh")
GLU_BLOCK_R, GLU_BLOCK_C = 16, 64  # the gated elementwise kernels' tile (rows x columns; columns a multiple of 8)
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _device_guard(t: torch.Tensor):
    """torch.cuda.device of a CUDA tensor that is not on the current device, else no guard."""
    if t.is_cuda and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


def _check_inputs(x, w1, b1, w2, b2, activation, dropout_p, w3=None, b3=None):
    if x.dim() != 2:
        raise ValueError(f"feed_forward: x must be (N, E), got shape {tuple(x.shape)}")
    N, E = x.shape
    if w1.dim() != 2 or w1.shape[1] != E:
        raise ValueError(f"feed_forward: w1 must be (F, E) with E = {E}, got shape {tuple(w1.shape)}")
    F = w1.shape[0]
    if tuple(w2.shape) != (E, F):
        raise ValueError(f"feed_forward: w2 must be (E, F) = {(E, F)}, got shape {tuple(w2.shape)}")
    if b1 is not None and tuple(b1.shape) != (F,):
        raise ValueError(f"feed_forward: b1 must be ({F},), got shape {tuple(b1.shape)}")
    if b2 is not None and tuple(b2.shape) != (E,):
        raise ValueError(f"feed_forward: b2 must be ({E},), got shape {tuple(b2.shape)}")
    if x.dtype not in _DTYPES:
        raise TypeError(f"feed_forward: x must be float32, float16 or bfloat16, got {x.dtype}")
    if w3 is not None and tuple(w3.shape) != (F, E):
        raise ValueError(f"feed_forward: w3 must be (F, E) = {(F, E)}, the shape of w1, got shape {tuple(w3.shape)}")
    if b3 is not None and w3 is None:
        raise ValueError("feed_forward: b3 was given without w3 (b3 is the gated form's up-projection bias)")
    if b3 is not None and tuple(b3.shape) != (F,):
        raise ValueError(f"feed_forward: b3 must be ({F},), got shape {tuple(b3.shape)}")
    for name, t in (("w1", w1), ("b1", b1), ("w2", w2), ("b2", b2), ("w3", w3), ("b3", b3)):
        if t is not None and (t.dtype != x.dtype or t.device != x.device):
            raise TypeError(f"feed_forward: {name} is {t.dtype} on {t.device}, x is {x.dtype} on "
                            f"{x.device}; they must match")
    if activation not in ACTIVATIONS:
        raise ValueError(f"feed_forward: activation must be one of {ACTIVATIONS}, got {activation!r}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"feed_forward: dropout_p must be in [0, 1), got {dropout_p}")


@triton.jit
def _glu_tile(N, F, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """This program's rows (BLOCK_R,), first column c0, columns (BLOCK_C,) and in-range mask."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c0 = tl.program_id(1) * BLOCK_C
    cols = c0 + tl.arange(0, BLOCK_C)
    return rows, c0, cols, (rows < N)[:, None] & (cols < F)[None, :]


@triton.jit(do_not_specialize=["seed", "offset"])
def _glu_fwd(pre_ptr, h_ptr, N, F, philox_ptr, seed, offset, threshold, scale, ACTIVATION: tl.constexpr,
             DROPOUT: tl.constexpr, EMULATE_BF16: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """h (N, F) = dropout(act(g) * u) over pre (N, 2F) rows [g | u] (biases added by the GEMM);
    the product in fp32, rounded once; the dropout bits of h's (row, column) as the plain form's."""
    rows, c0, cols, mask = _glu_tile(N, F, BLOCK_R, BLOCK_C)
    g_ptrs = pre_ptr + rows.to(tl.int64)[:, None] * (2 * F) + cols[None, :]
    g = tl.load(g_ptrs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(g_ptrs + F, mask=mask, other=0.0).to(tl.float32)
    h = _activation(g, ACTIVATION) * u
    if DROPOUT:
        seed, offset = load_philox(philox_ptr, seed, offset)
        keep = dropout_keep_tile(seed, offset, rows, tl.cdiv(F, 8), c0, threshold, BLOCK_C)
        h = tl.where(keep, h * scale, 0.0)
    h_ptrs = h_ptr + rows.to(tl.int64)[:, None] * F + cols[None, :]
    tl.store(h_ptrs, _cast(h, h_ptr.dtype.element_ty, EMULATE_BF16), mask=mask)


@triton.jit(do_not_specialize=["seed", "offset"])
def _glu_bwd(pre_ptr, dh_ptr, dpre_ptr, h_ptr, N, F, philox_ptr, seed, offset, threshold, scale,
             ACTIVATION: tl.constexpr, DROPOUT: tl.constexpr, EMULATE_BF16: tl.constexpr, BLOCK_R: tl.constexpr,
             BLOCK_C: tl.constexpr):
    """From pre (N, 2F) [g | u] and dh (N, F): dpre (N, 2F) = [dh keep u act'(g) | dh keep act(g)]
    and h (N, F) = dropout(act(g) u) recomputed for dw2."""
    rows, c0, cols, mask = _glu_tile(N, F, BLOCK_R, BLOCK_C)
    r64 = rows.to(tl.int64)[:, None]
    g_ptrs = pre_ptr + r64 * (2 * F) + cols[None, :]
    g = tl.load(g_ptrs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(g_ptrs + F, mask=mask, other=0.0).to(tl.float32)
    dh = tl.load(dh_ptr + r64 * F + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    a = _activation(g, ACTIVATION)
    h = a * u
    if DROPOUT:
        seed, offset = load_philox(philox_ptr, seed, offset)
        keep = dropout_keep_tile(seed, offset, rows, tl.cdiv(F, 8), c0, threshold, BLOCK_C)
        h = tl.where(keep, h * scale, 0.0)
        dh = tl.where(keep, dh * scale, 0.0)
    dg = dh * u * _activation_grad(g, ACTIVATION)
    du = dh * a
    dt = dpre_ptr.dtype.element_ty
    d_ptrs = dpre_ptr + r64 * (2 * F) + cols[None, :]
    tl.store(d_ptrs, _cast(dg, dt, EMULATE_BF16), mask=mask)
    tl.store(d_ptrs + F, _cast(du, dt, EMULATE_BF16), mask=mask)
    tl.store(h_ptr + r64 * F + cols[None, :], _cast(h, dt, EMULATE_BF16), mask=mask)


def _glu_launch(kernel, wrap, N, F, tensors, activation, dropout_p, seed, offset, philox, dtype):
    """One of the gated elementwise kernels over (N, F)."""
    if N == 0 or F == 0:
        return
    dropout = dropout_p > 0.0
    if wrap is not None:
        kernel = wrap(kernel)
    grid = (cdiv(N, GLU_BLOCK_R), cdiv(F, GLU_BLOCK_C))
    kernel[grid](*tensors, N, F, philox if dropout else None, seed, offset,
                 dropout_threshold(dropout_p) if dropout else 0, 1.0 / (1.0 - dropout_p) if dropout else 1.0,
                 ACTIVATION=activation, DROPOUT=dropout, EMULATE_BF16=matmul.INTERPRET and dtype == torch.bfloat16,
                 BLOCK_R=GLU_BLOCK_R, BLOCK_C=GLU_BLOCK_C)


def _up_weights(w1, w3):
    """[w1; w3] (2F, E): the gated form's two up products as one GEMM."""
    return torch.cat([w1, w3])


def _up_bias(b1, b3, w1):
    """[b1; b3] (2F,), a zero half for the one not given; None without either."""
    if b1 is None and b3 is None:
        return None
    F = w1.shape[0]
    zeros = lambda: w1.new_zeros((F,))  # noqa: E731
    return torch.cat([b1 if b1 is not None else zeros(), b3 if b3 is not None else zeros()])


def _gated_fwd(x, w1, b1, w2, b2, activation, dropout_p, seed, offset, wrap, philox, w3, b3):
    N, E = x.shape
    F = w1.shape[0]
    pre = x.new_empty((N, 2 * F))
    h = x.new_empty((N, F))  # the second GEMM's input, freed on return
    out = x.new_empty((N, E))
    with _device_guard(x):
        matmul.launch(x, _up_weights(w1, w3).t(), pre, bias=_up_bias(b1, b3, w1), wrap=wrap)
        _glu_launch(_glu_fwd, wrap, N, F, (pre, h), activation, dropout_p, seed, offset, philox, x.dtype)
        matmul.launch(h, w2.t(), out, bias=b2.contiguous() if b2 is not None else None, wrap=wrap)
    return out, pre


def _gated_bwd(dout, x, w1, w2, pre, has_b1, has_b2, activation, dropout_p, seed, offset, wrap, philox, w3,
               has_b3):
    N, E = x.shape
    F = w1.shape[0]
    if tuple(pre.shape) != (N, 2 * F) or pre.dtype != x.dtype:
        raise ValueError(f"feed_forward_bwd: pre must be {x.dtype} of shape (N, 2F) = {(N, 2 * F)}, got "
                         f"{pre.dtype} {tuple(pre.shape)}")
    pre = pre.contiguous()
    dh = x.new_empty((N, F))
    dpre = x.new_empty((N, 2 * F))
    h = x.new_empty((N, F))
    dx = x.new_empty((N, E))
    dw13 = w1.new_empty((2 * F, E))
    dw2 = w2.new_empty((E, F))
    db13 = w1.new_empty((2 * F,) if has_b1 or has_b3 else (0,))
    db2 = w2.new_empty((E,) if has_b2 else (0,))
    with _device_guard(x):
        matmul.launch(dout, w2, dh, wrap=wrap)
        _glu_launch(_glu_bwd, wrap, N, F, (pre, dh, dpre, h), activation, dropout_p, seed, offset, philox,
                    x.dtype)
        matmul.launch(dout.t(), h, dw2, rowsum=db2 if has_b2 else None, wrap=wrap)
        matmul.launch(dpre.t(), x, dw13, rowsum=db13 if has_b1 or has_b3 else None, wrap=wrap)
        matmul.launch(dpre, _up_weights(w1, w3), dx, wrap=wrap)
    return dx, dw13, db13, dw2, db2


def _feed_forward_fwd(x: torch.Tensor, w1: torch.Tensor, b1: Optional[torch.Tensor], w2: torch.Tensor,
                      b2: Optional[torch.Tensor], activation: str, dropout_p: float, seed: int,
                      offset: int, wrap=None, philox=None, w3=None, b3=None) -> Tuple[torch.Tensor, torch.Tensor]:
    _check_inputs(x, w1, b1, w2, b2, activation, dropout_p, w3, b3)
    if w3 is not None:
        return _gated_fwd(x, w1, b1, w2, b2, activation, dropout_p, seed, offset, wrap, philox, w3, b3)
    N, E = x.shape
    F = w1.shape[0]
    b1 = b1.contiguous() if b1 is not None else None
    b2 = b2.contiguous() if b2 is not None else None
    pre = x.new_empty((N, F))
    a = x.new_empty((N, F))  # dropout(act(pre)): the second GEMM's input, freed on return
    out = x.new_empty((N, E))
    with _device_guard(x):
        matmul.launch(x, w1.t(), pre, d=a, bias=b1, epilogue="act_fwd", activation=activation,
                      dropout_p=dropout_p, seed=seed, offset=offset, philox=philox, wrap=wrap)
        matmul.launch(a, w2.t(), out, bias=b2, wrap=wrap)
    return out, pre


def _feed_forward_bwd(dout: torch.Tensor, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                      pre: torch.Tensor, has_b1: bool, has_b2: bool, activation: str, dropout_p: float,
                      seed: int, offset: int, wrap=None, philox=None, w3=None,
                      has_b3=False) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_inputs(x, w1, None, w2, None, activation, dropout_p, w3)
    if has_b3 and w3 is None:
        raise ValueError("feed_forward_bwd: has_b3 is true without w3 (b3 is the gated form's up-projection bias)")
    N, E = x.shape
    F = w1.shape[0]
    if tuple(dout.shape) != (N, E) or dout.dtype != x.dtype:
        raise ValueError(f"feed_forward_bwd: dout must be {x.dtype} of shape {(N, E)}, got "
                         f"{dout.dtype} {tuple(dout.shape)}")
    if w3 is not None:
        return _gated_bwd(dout, x, w1, w2, pre, has_b1, has_b2, activation, dropout_p, seed, offset, wrap, philox,
                          w3, has_b3)
    if tuple(pre.shape) != (N, F) or pre.dtype != x.dtype:
        raise ValueError(f"feed_forward_bwd: pre must be {x.dtype} of shape {(N, F)}, got "
                         f"{pre.dtype} {tuple(pre.shape)}")
    pre = pre.contiguous()
    dpre = x.new_empty((N, F))
    a = x.new_empty((N, F))  # dropout(act(pre)) recomputed for dw2
    dx = x.new_empty((N, E))
    dw1 = w1.new_empty((F, E))
    dw2 = w2.new_empty((E, F))
    db1 = w1.new_empty((F,) if has_b1 else (0,))
    db2 = w2.new_empty((E,) if has_b2 else (0,))
    with _device_guard(x):
        matmul.launch(dout, w2, dpre, d=a, pre=pre, epilogue="act_bwd", activation=activation,
                      dropout_p=dropout_p, seed=seed, offset=offset, philox=philox, wrap=wrap)
        matmul.launch(dout.t(), a, dw2, rowsum=db2 if has_b2 else None, wrap=wrap)
        matmul.launch(dpre.t(), x, dw1, rowsum=db1 if has_b1 else None, wrap=wrap)
        matmul.launch(dpre, w1, dx, wrap=wrap)
    return dx, dw1, db1, dw2, db2


# ---------------------------------------------------------------------------------------------
# torch op registration
# ---------------------------------------------------------------------------------------------
def _fwd_op(x: torch.Tensor, w1: torch.Tensor, b1: Optional[torch.Tensor], w2: torch.Tensor,
            b2: Optional[torch.Tensor], activation: str, dropout_p: float, philox: torch.Tensor,
            w3: Optional[torch.Tensor] = None, b3: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    ptr, seed, offset = philox_args(philox, x.device, "feed_forward_fwd", dropout_p > 0.0)
    return _feed_forward_fwd(x, w1, b1, w2, b2, activation, dropout_p, seed, offset, wrap=launcher(), philox=ptr,
                             w3=w3, b3=b3)


def _bwd_op(dout: torch.Tensor, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, pre: torch.Tensor,
            has_b1: bool, has_b2: bool, activation: str, dropout_p: float, philox: torch.Tensor,
            w3: Optional[torch.Tensor] = None,
            has_b3: bool = False) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    ptr, seed, offset = philox_args(philox, x.device, "feed_forward_bwd", dropout_p > 0.0)
    return _feed_forward_bwd(dout, x, w1, w2, pre, has_b1, has_b2, activation, dropout_p, seed, offset,
                             wrap=launcher(), philox=ptr, w3=w3, has_b3=has_b3)


feed_forward_fwd = register_op("feed_forward_fwd", _fwd_op)
feed_forward_bwd = register_op("feed_forward_bwd", _bwd_op)


# ---------------------------------------------------------------------------------------------
# Ahead-of-time specialisations
# ---------------------------------------------------------------------------------------------
def aot_specs():
    """The kernel specialisations these host functions launch on a GPU (triton_kernels.aot).

    The four kernels that differ in code: the first linear with its activation/dropout epilogue
    (gelu, bias and dropout: the most code), the activation-gradient GEMM (gelu, dropout), the
    second linear (bias) and the weight-gradient GEMM with the fused bias gradient, at every
    autotune config of bf16 and fp32; plus the input-gradient GEMM (both operands row-major) per
    dtype and the relu and silu epilogues in bf16, at the first config. fp16 compiles to the bf16
    code but for its conversions (same registers and shared memory), so it is built at the largest
    config only. Launches without bias or dropout only drop code from these.
    """
    specs = []
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        configs = matmul.CONFIGS_32BIT if dtype == torch.float32 else matmul.CONFIGS_16BIT
        if dtype == torch.float16:
            configs = configs[:1]
        for i, config in enumerate(configs):
            specs += [
                matmul.aot_spec("feed_forward_fwd.linear1_gelu", dtype, "nt", config, epilogue="act_fwd",
                                activation="gelu", has_bias=True, dropout=True),
                matmul.aot_spec("feed_forward_bwd.dpre_gelu", dtype, "nn", config, epilogue="act_bwd",
                                activation="gelu", dropout=True),
                matmul.aot_spec("feed_forward_fwd.linear2", dtype, "nt", config, has_bias=True),
                matmul.aot_spec("feed_forward_bwd.dweight_dbias", dtype, "tn", config, row_sum_a=True),
            ]
            if i == 0:
                specs.append(matmul.aot_spec("feed_forward_bwd.dx", dtype, "nn", config))
            if i == 0 and dtype == torch.bfloat16:
                for act in ("relu", "silu"):
                    specs += [
                        matmul.aot_spec(f"feed_forward_fwd.linear1_{act}", dtype, "nt", config,
                                        epilogue="act_fwd", activation=act, has_bias=True, dropout=True),
                        matmul.aot_spec(f"feed_forward_bwd.dpre_{act}", dtype, "nn", config,
                                        epilogue="act_bwd", activation=act, dropout=True),
                    ]
    specs += _split_k_aot_specs()
    specs += _gated_aot_specs()
    return specs


def _gated_aot_specs():
    """The gated form's two elementwise kernels (gelu_tanh with dropout: the most code) per dtype,
    and the tanh-gelu GEMM epilogues of the plain form in bf16 at the first config."""
    config = triton.Config({}, num_warps=4, num_stages=1)
    specs = []
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        dt = matmul._TRITON_DTYPE[dtype]
        for name, fn, ptrs in (("fwd", _glu_fwd, ("pre_ptr", "h_ptr")),
                               ("bwd", _glu_bwd, ("pre_ptr", "dh_ptr", "dpre_ptr", "h_ptr"))):
            signature = {p: "*" + dt for p in ptrs}
            signature.update(N="i32", F="i32", philox_ptr="*i64", seed="i64", offset="i64", threshold="i32",
                             scale="fp32")
            constexprs = dict(ACTIVATION="gelu_tanh", DROPOUT=True, EMULATE_BF16=False, BLOCK_R=GLU_BLOCK_R,
                              BLOCK_C=GLU_BLOCK_C)
            specs.append(matmul._spec(f"feed_forward_{name}.glu_gelu_tanh[{dt}]", fn, signature, constexprs, config,
                                      lambda sig: [a for a, ty in sig.items() if ty.startswith("*")] + ["N", "F"]))
    first = matmul.CONFIGS_16BIT[0]
    specs += [
        matmul.aot_spec("feed_forward_fwd.linear1_gelu_tanh", torch.bfloat16, "nt", first, epilogue="act_fwd",
                        activation="gelu_tanh", has_bias=True, dropout=True),
        matmul.aot_spec("feed_forward_bwd.dpre_gelu_tanh", torch.bfloat16, "nn", first, epilogue="act_bwd",
                        activation="gelu_tanh", dropout=True),
    ]
    return specs


def _split_k_aot_specs():
    """The split-K passes (matmul._launch_split_k) at their one config each: the first pass per
    operand layout (the weight gradients' TN with row sums; NT and NN for the other GEMMs when
    few tokens leave them short of tiles), the second pass per epilogue, in bf16 and fp32; fp16
    (bf16's code but for conversions) at the weight gradients' pair and the heaviest epilogue."""
    specs = []
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        config = matmul.SPLIT_K_CONFIG_32BIT if dtype == torch.float32 else matmul.SPLIT_K_CONFIG_16BIT
        specs += [
            matmul.aot_spec_split_k("feed_forward_bwd.dweight_dbias.split_k", dtype, "tn", config,
                                    row_sum_a=True),
            matmul.aot_spec_split_k_reduce("feed_forward_bwd.dweight_dbias.split_k_reduce", dtype,
                                           row_sum_a=True),
            matmul.aot_spec_split_k_reduce("feed_forward_fwd.linear1_gelu.split_k_reduce", dtype,
                                           epilogue="act_fwd", activation="gelu", has_bias=True,
                                           dropout=True),
        ]
        if dtype == torch.float16:
            continue
        specs += [
            matmul.aot_spec_split_k("feed_forward.nt.split_k", dtype, "nt", config),
            matmul.aot_spec_split_k("feed_forward.nn.split_k", dtype, "nn", config),
            matmul.aot_spec_split_k_reduce("feed_forward_fwd.linear2.split_k_reduce", dtype, has_bias=True),
            matmul.aot_spec_split_k_reduce("feed_forward_bwd.dpre_gelu.split_k_reduce", dtype,
                                           epilogue="act_bwd", activation="gelu", dropout=True),
        ]
        if dtype == torch.bfloat16:
            for act in ("relu", "silu"):
                specs += [
                    matmul.aot_spec_split_k_reduce(f"feed_forward_fwd.linear1_{act}.split_k_reduce", dtype,
                                                   epilogue="act_fwd", activation=act, has_bias=True,
                                                   dropout=True),
                    matmul.aot_spec_split_k_reduce(f"feed_forward_bwd.dpre_{act}.split_k_reduce", dtype,
                                                   epilogue="act_bwd", activation=act, dropout=True),
                ]
    return specs
