"""embedding: the reference against torch, then every kernel backend against the reference
(forward, the weight's and the positional table's gradients), dropout bits equal across
backends, padding_idx, packed positions, determinism, opcheck, bad input."""
import pytest
import torch
import torch.nn.functional as F

import fastformer
from fastformer import _ext, backends, philox
from fastformer.ops import embedding, reference
from utils import assert_close, assert_close_lowp, device_for, kernel_backends, skip_without_kernels

BACKENDS = kernel_backends("cpu", "triton", "cuda")
CPU = kernel_backends("cpu")

# (ids shape, V, D): one id, odd counts of ids, round ones; D 1, 7, 256, 1023.
SHAPES = [((1, 1), 5, 1), ((3, 1023), 50, 7), ((2, 9), 11, 256), ((37,), 1000, 1023), ((4, 8, 3), 7, 64)]
# The Triton interpreter and the SIMT harness are slow: a subset keeps their part short.
SLOW_SHAPES = [((1, 1), 5, 1), ((3, 33), 50, 7), ((2, 9), 11, 256), ((5,), 4, 1023)]

# fp32 (atol, rtol) per backend: out is one rounding (or an fma) away; a gradient row sums a few rows.
FP32_TOL = {
    "cpu": {"out": (1e-6, 1e-6), "grad": (1e-5, 1e-5)},
    "triton": {"out": (1e-6, 1e-6), "grad": (1e-5, 1e-5)},
    "cuda": {"out": (1e-6, 1e-6), "grad": (1e-5, 1e-5)},
}
# bf16: FlashAttention's rule (kernel error <= factor x the bf16 reference's error + atol). The
# Triton interpreter truncates fp32 -> bf16 (a whole ulp): twice the factor there.
LOWP_FACTOR = {"cpu": 2.0, "triton": 2.0 if torch.cuda.is_available() else 4.0, "cuda": 2.0}


def _lowp_atol(backend, ref):
    """A gradient row sums up to a hundred rows here: where the interpreter truncates that sum to
    bf16, its error is up to one ulp of the largest value (2**-7 of it), which the reference's own
    rounding (half an ulp, often less) does not bound by a fixed factor."""
    if backend == "triton" and not torch.cuda.is_available():
        return 2.0 ** -7 * ref.abs().max().item()
    return 1e-5

# name: (scale, positional table, explicit positions, requires_grad on the table, dropout_p, padding_idx)
CONFIGS = {
    "plain": (1.0, False, False, False, 0.0, None),
    "scaled_sinusoidal": (16.0, True, False, False, 0.0, None),
    "scaled_sinusoidal_dropout": (16.0, True, False, False, 0.1, None),
    "learned_packed_dropout": (0.5, True, True, True, 0.3, None),
    "learned_padding_idx": (2.0, True, True, True, 0.0, 1),
    "padding_idx_dropout": (3.0, False, False, False, 0.2, -1),
}


SLOW = ("triton", "cuda")
# On the slow backends every config runs on one shape, the others on the configs with the most paths.
SLOW_FULL_SHAPE = ((3, 33), 50, 7)
SLOW_CONFIGS = ("learned_packed_dropout", "padding_idx_dropout")


def _shapes(backend):
    return SLOW_SHAPES if backend in SLOW else SHAPES


def _cases():
    for backend in BACKENDS:
        name = backend.values[0]
        for shape, V, D in _shapes(name):
            full = name not in SLOW or (shape, V, D) == SLOW_FULL_SHAPE
            for config in (CONFIGS if full else SLOW_CONFIGS):
                yield pytest.param(backend.values[0], shape, V, D, config, marks=backend.marks,
                                   id=f"{backend.id}-{'x'.join(map(str, shape))}-V{V}-D{D}-{config}")


def _make_inputs(shape, V, D, config, device, gen_seed=0):
    """ids (hitting some rows many times, the padding row too), weight, positional, positions."""
    _, has_pos, explicit, _, _, padding_idx = CONFIGS[config]
    g = torch.Generator().manual_seed(gen_seed)
    ids = torch.randint(0, V, shape, generator=g)
    ids.view(-1)[::3] = ids.view(-1)[0]  # a repeated id: a gradient row sums many rows
    if padding_idx is not None:
        ids.view(-1)[1::4] = padding_idx % V
    weight = torch.randn(V, D, generator=g)
    positional = positions = None
    if has_pos:
        S = shape[-1]
        P = S + 3
        positional = torch.randn(P, D, generator=g)
        if explicit:  # packed rows: positions restart within the row, any in [0, P)
            positions = torch.randint(0, P, shape, generator=g)
            positions.view(-1)[::2] = 0
    to = (lambda t: None if t is None else t.to(device))
    return to(ids), to(weight), to(positional), to(positions)


def _forward_backward(fn, ids, weight, positional, positions, grad_table, upstream):
    w = weight.detach().clone().requires_grad_()
    pt = None if positional is None else positional.detach().clone().requires_grad_(grad_table)
    out = fn(ids, w, pt, positions)
    wrt = [w] + ([pt] if grad_table else [])
    grads = torch.autograd.grad(out, wrt, upstream)
    named = {"weight": grads[0]}
    if grad_table:
        named["positional"] = grads[1]
    return out.detach(), named


def _run_case(backend, shape, V, D, config, dtype, inputs):
    """(kernel, reference in dtype, reference in fp32) output and gradients, same dropout mask."""
    scale, _, _, grad_table, p, padding_idx = CONFIGS[config]
    ids, weight, positional, positions = inputs
    upstream = torch.randn(*shape, D, generator=torch.Generator().manual_seed(5)).to(weight.device)
    torch.manual_seed(1234)
    rng = philox.next_seed()

    def kernel(i, w, pt, pos):
        torch.manual_seed(1234)  # the Function draws the same (seed, offset) as rng
        with fastformer.use_backend(backend):
            return embedding(i, w, scale=scale, positional=pt, positions=pos, dropout_p=p, padding_idx=padding_idx)

    def ref(i, w, pt, pos):
        return reference.embedding(i, w, scale=scale, positional=pt, positions=pos, dropout_p=p,
                                   padding_idx=padding_idx, rng=rng)

    cast = lambda t, dt: None if t is None else t.to(dt)  # noqa: E731
    args = lambda dt: (ids, cast(weight, dt), cast(positional, dt), positions)  # noqa: E731
    out = _forward_backward(kernel, *args(dtype), grad_table, upstream.to(dtype))
    ref_lowp = _forward_backward(ref, *args(dtype), grad_table, upstream.to(dtype))
    ref_fp32 = _forward_backward(ref, *args(torch.float32), grad_table, upstream.to(dtype).float())
    return out, ref_lowp, ref_fp32


# ---------------------------------------------------------------- the reference against torch


@pytest.mark.parametrize("padding_idx", [None, 2, -1])
def test_reference_matches_torch_composition(padding_idx):
    """F.embedding x scale + the positional rows + the shared Philox mask, by hand."""
    ids = torch.tensor([[3, 2, 2, 9], [0, 9, 2, 1]])
    weight, table = torch.randn(10, 6, requires_grad=True), torch.randn(7, 6, requires_grad=True)
    positions = torch.tensor([[0, 1, 2, 0], [1, 0, 6, 2]])
    up = torch.randn(2, 4, 6)
    p, rng = 0.3, (77, 5)
    want = F.embedding(ids, weight, padding_idx=padding_idx) * 2.5 + F.embedding(positions, table)
    want = want * philox.keep_mask(want.shape, p, *rng).float() / (1 - p)
    got = reference.embedding(ids, weight, scale=2.5, positional=table, positions=positions, dropout_p=p,
                              padding_idx=padding_idx, rng=rng)
    assert_close("out", got, want, atol=1e-6, rtol=1e-6)
    g_want = torch.autograd.grad(want, (weight, table), up)
    g_got = torch.autograd.grad(got, (weight, table), up)
    for name, a, b in zip(("dweight", "dpositional"), g_got, g_want):
        assert_close(name, a, b, atol=1e-5, rtol=1e-5)


def test_reference_default_positions_are_arange_along_the_last_dim():
    ids = torch.randint(0, 10, (3, 5))
    weight, table = torch.randn(10, 4), torch.randn(8, 4)
    got = reference.embedding(ids, weight, positional=table)
    assert_close("out", got, weight[ids] + table[:5], atol=0, rtol=0)


# ---------------------------------------------------------------- kernels against the reference


@pytest.mark.parametrize("backend,shape,V,D,config", list(_cases()))
def test_fp32_forward_and_every_gradient(backend, shape, V, D, config):
    inputs = _make_inputs(shape, V, D, config, device_for(backend))
    (out, grads), _, (ref_out, ref_grads) = _run_case(backend, shape, V, D, config, torch.float32, inputs)
    assert_close("out", out, ref_out, *FP32_TOL[backend]["out"])
    assert set(grads) == set(ref_grads)
    for name in ref_grads:
        assert_close(f"d{name}", grads[name], ref_grads[name], *FP32_TOL[backend]["grad"])


@pytest.mark.parametrize("backend,shape,V,D,config", list(_cases()))
def test_bf16_forward_and_every_gradient(backend, shape, V, D, config):
    inputs = _make_inputs(shape, V, D, config, device_for(backend))
    (out, grads), (lp_out, lp_grads), (ref_out, ref_grads) = _run_case(
        backend, shape, V, D, config, torch.bfloat16, inputs)
    factor = LOWP_FACTOR[backend]
    assert out.dtype == torch.bfloat16
    assert_close_lowp("out", out, ref_out, lp_out, factor=factor)
    for name in ref_grads:
        assert grads[name].dtype == torch.bfloat16
        assert_close_lowp(f"d{name}", grads[name], ref_grads[name], lp_grads[name], factor=factor,
                          atol=_lowp_atol(backend, ref_grads[name]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_bits_are_the_reference_mask(backend):
    """Same (seed, offset): the kernel drops exactly philox.keep_mask((N, D)) (rows of D columns,
    one per id), for rows of any width, offsets whose low word wraps, thresholds at both ends; the
    backward regenerates the same mask (with one id per row, dweight's rows are keep x scale)."""
    device = device_for(backend)
    kern = backends.Kernels(backend)
    for D in ((7, 65) if backend in SLOW else (1, 7, 8, 65, 300)):
        N = 13
        ids = torch.arange(N, device=device)
        weight = torch.ones(N, D, device=device)
        for p, seed, offset in ((0.1, 3, 0), (0.5, 2**40 + 9, 2**32 - 5), (1e-6, 4, 5), (0.999995, 4, 5)):
            rng = philox.pack(seed, offset)
            out = kern.embedding_fwd(ids, weight, None, None, 1.0, p, rng)
            keep = philox.keep_mask((N, D), p, seed, offset, device=device)
            assert torch.equal(out != 0, keep), f"forward mask D={D} p={p}"
            assert torch.equal(out[keep], torch.full_like(out[keep], 1 / (1 - p)))
            dw, _ = kern.embedding_bwd(torch.ones(N, D, device=device), ids, None, N, 0, True, False, -1, 1.0, p, rng)
            assert torch.equal(dw, out), f"backward mask D={D} p={p}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_statistics_and_seed(backend):
    device = device_for(backend)
    kern = backends.Kernels(backend)
    N, D, p = 200, 300, 0.25
    ids = torch.zeros(N, dtype=torch.long, device=device)
    weight = torch.ones(1, D, device=device)
    out = kern.embedding_fwd(ids, weight, None, None, 1.0, p, philox.pack(11, 0))
    rate = (out != 0).double().mean().item()
    assert abs(rate - (1 - p)) < 5 * (p * (1 - p) / out.numel()) ** 0.5
    assert torch.equal(kern.embedding_fwd(ids, weight, None, None, 1.0, p, philox.pack(11, 0)), out)
    assert not torch.equal(kern.embedding_fwd(ids, weight, None, None, 1.0, p, philox.pack(12, 0)), out)
    assert not torch.equal(kern.embedding_fwd(ids, weight, None, None, 1.0, p, philox.pack(11, 1)), out)


def test_dropout_bits_equal_across_backends():
    """Every backend here gives the reference's output bit for bit in fp32 where the sum is exact
    (integers: w x 2 + pe rounds nowhere): the same elements dropped everywhere."""
    ids = torch.tensor([[4, 1, 1, 0, 3], [2, 2, 4, 0, 1]])
    weight = torch.randint(-8, 8, (5, 19)).float()
    table = torch.randint(-8, 8, (6, 19)).float()
    outs = {}
    for backend in ["reference"] + [b.values[0] for b in BACKENDS]:
        if backend != "reference" and not backends.availability(backend, device_for(backend)):
            continue
        torch.manual_seed(9)
        with fastformer.use_backend(backend):
            outs[backend] = embedding(ids.to(device_for(backend)), weight.to(device_for(backend)), scale=2.0,
                                      positional=table.to(device_for(backend)), dropout_p=0.5).cpu()
    for backend, out in outs.items():
        assert torch.equal(out, outs["reference"]), backend


@pytest.mark.parametrize("backend", BACKENDS)
def test_padding_idx_row_gets_no_gradient_the_table_still_does(backend):
    device = device_for(backend)
    ids = torch.tensor([[0, 2, 0], [1, 0, 0]], device=device)
    w = torch.randn(3, 5, device=device, requires_grad=True)
    t = torch.randn(4, 5, device=device, requires_grad=True)
    with fastformer.use_backend(backend):
        out = embedding(ids, w, positional=t, padding_idx=0, scale=2.0)
    out.backward(torch.ones_like(out))
    assert torch.equal(w.grad[0], torch.zeros(5, device=device))
    assert torch.equal(w.grad[1:], torch.full((2, 5), 2.0, device=device))
    assert torch.equal(t.grad, torch.tensor([2.0, 2.0, 2.0, 0.0], device=device)[:, None].expand(4, 5))


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("backend", CPU)
def test_cpu_gradient_is_the_same_bits_for_any_thread_count(backend, threads):
    """Each gradient row is summed in a fixed order (increasing id position), whoever sums it."""
    shape, V, D, config = (3, 1023), 50, 7, "learned_packed_dropout"
    inputs = _make_inputs(shape, V, D, config, "cpu")
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        (_, one), _, _ = _run_case(backend, shape, V, D, config, torch.float32, inputs)
        torch.set_num_threads(threads)
        (_, many), _, _ = _run_case(backend, shape, V, D, config, torch.float32, inputs)
    finally:
        torch.set_num_threads(previous)
    for name in one:
        assert torch.equal(one[name], many[name]), name


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_input(backend):
    device = device_for(backend)
    w = torch.randn(6, 4, device=device, requires_grad=True)
    with fastformer.use_backend(backend):
        out = embedding(torch.zeros(2, 0, dtype=torch.long, device=device), w, dropout_p=0.1)
    assert out.shape == (2, 0, 4)
    out.sum().backward()
    assert torch.equal(w.grad, torch.zeros(6, 4, device=device))


@pytest.mark.parametrize("backend", BACKENDS)
def test_int32_ids_and_a_scalar_id(backend):
    device = device_for(backend)
    w, t = torch.randn(6, 4, device=device), torch.randn(3, 4, device=device)
    with fastformer.use_backend(backend):
        got = embedding(torch.tensor([[5, 1]], dtype=torch.int32, device=device), w, positional=t)
        one = embedding(torch.tensor(4, device=device), w, positional=t)
    assert_close("int32", got, (w[[5, 1]] + t[:2])[None], atol=1e-6, rtol=1e-6)
    assert one.shape == (4,)
    assert_close("0-d", one, w[4] + t[0], atol=1e-6, rtol=1e-6)


def test_functional_op_draws_its_seed_from_torch_generator():
    ids = torch.randint(0, 20, (4, 9))
    w = torch.randn(20, 16)
    torch.manual_seed(3)
    a = embedding(ids, w, dropout_p=0.5)
    torch.manual_seed(3)
    b = embedding(ids, w, dropout_p=0.5)
    torch.manual_seed(3)
    rng = philox.next_seed()
    assert torch.equal(a, b)
    assert_close("out", a, reference.embedding(ids, w, dropout_p=0.5, rng=rng), atol=1e-6, rtol=1e-6)
    assert not torch.equal(embedding(ids, w, dropout_p=0.5), a)


# ---------------------------------------------------------------- gradcheck, opcheck, C++ checks


@pytest.mark.parametrize("p", [0.0, 0.3])
@pytest.mark.parametrize("backend", CPU)
def test_gradcheck_float64(backend, p):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(5, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    t = torch.randn(4, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    ids = torch.tensor([[1, 4, 1], [0, 1, 3]])
    pos = torch.tensor([[0, 3, 1], [0, 0, 2]])

    def fn(w, t):
        torch.manual_seed(42)  # the same dropout mask on every evaluation
        with fastformer.use_backend(backend):
            return embedding(ids, w, scale=1.7, positional=t, positions=pos, dropout_p=p)  # padding_idx: not a true gradient

    assert torch.autograd.gradcheck(fn, (w, t), eps=1e-6, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", CPU)
def test_opcheck(backend, dtype):
    assert _ext.load_error() is None
    ops = torch.ops.fastformer
    ids = torch.tensor([3, 0, 3, 6, 1])
    pos = torch.tensor([0, 1, 2, 0, 1])
    w, t = torch.randn(7, 9, dtype=dtype), torch.randn(3, 9, dtype=dtype)
    for table, positions, p in ((t, pos, 0.2), (None, None, 0.0), (t, pos, 0.0)):
        torch.library.opcheck(ops.embedding_fwd.default, (ids, w, table, positions, 2.0, p, philox.pack(7, 3)))
        for weight_grad, table_grad in ((True, table is not None), (True, False), (False, table is not None)):
            args = (torch.randn(5, 9, dtype=dtype), ids, positions, 7, 3, weight_grad, table_grad, 3, 2.0, p,
                    philox.pack(7, 3))
            torch.library.opcheck(ops.embedding_bwd.default, args)


@pytest.mark.parametrize("backend", kernel_backends("cpu", "cuda"))
def test_kernel_checks_name_the_argument(backend):
    """Called directly (past the functional op's checks), the C++ glue still refuses bad ids."""
    device = device_for(backend)
    kern = backends.Kernels(backend)
    w, t = torch.randn(4, 3, device=device), torch.randn(2, 3, device=device)
    ids, rng = torch.tensor([0, 3, 1], device=device), philox.pack(1, 0)
    if backend == "cpu":  # the CUDA glue reads no id (a device sync): the functional op checks them
        with pytest.raises(RuntimeError, match=r"input\[1\] = 9 is outside \[0, 4\)"):
            kern.embedding_fwd(torch.tensor([0, 9, 1]), w, None, None, 1.0, 0.0, rng)
        with pytest.raises(RuntimeError, match=r"positions\[2\] = 2 is outside \[0, 2\)"):
            kern.embedding_fwd(ids, w, t, torch.tensor([0, 1, 2]), 1.0, 0.0, rng)
    with pytest.raises(RuntimeError, match="input must be int64"):
        kern.embedding_fwd(ids.int(), w, None, None, 1.0, 0.0, rng)
    with pytest.raises(RuntimeError, match="positional and positions must be given together"):
        kern.embedding_fwd(ids, w, t, None, 1.0, 0.0, rng)
    with pytest.raises(RuntimeError, match="positions must have the length of input"):
        kern.embedding_fwd(ids, w, t, torch.tensor([0, 1], device=device), 1.0, 0.0, rng)
    with pytest.raises(RuntimeError, match="grad must have shape"):
        kern.embedding_bwd(torch.randn(2, 3, device=device), ids, None, 4, 0, True, False, -1, 1.0, 0.0, rng)


# ---------------------------------------------------------------- bad input to the functional op
# (test_embedding_hostile.py runs more of these with every backend forced)


@pytest.mark.parametrize("call, exc, match", [
    (lambda: embedding(torch.zeros(3), torch.randn(4, 2)), TypeError, "input must hold integer ids"),
    (lambda: embedding(torch.tensor([0, 4]), torch.randn(4, 2)), ValueError, r"input must be in \[0, 4\)"),
    (lambda: embedding(torch.tensor([-1]), torch.randn(4, 2)), ValueError, r"input must be in \[0, 4\)"),
    (lambda: embedding(torch.tensor([0]), torch.randn(4)), ValueError, "weight must have 2 dimensions"),
    (lambda: embedding(torch.tensor([0]), torch.zeros(4, 2, dtype=torch.long)), TypeError, "weight must be a floating"),
    (lambda: embedding(torch.tensor([0, 1, 2]), torch.randn(4, 2), positional=torch.randn(2, 2)), ValueError,
     "positional has 2 rows but input's last dimension needs positions 0 .. 2"),
    (lambda: embedding(torch.tensor([0, 1]), torch.randn(4, 2), positional=torch.randn(2, 3)), ValueError,
     "positional must have shape"),
    (lambda: embedding(torch.tensor([0, 1]), torch.randn(4, 2), positional=torch.randn(2, 2).double()), TypeError,
     "positional has dtype"),
    (lambda: embedding(torch.tensor([0, 1]), torch.randn(4, 2), positional=torch.randn(3, 2),
                       positions=torch.tensor([0])), ValueError, "positions must have shape"),
    (lambda: embedding(torch.tensor([0, 1]), torch.randn(4, 2), positional=torch.randn(3, 2),
                       positions=torch.tensor([0, 3])), ValueError, r"positions must be in \[0, 3\)"),
    (lambda: embedding(torch.tensor([0, 1]), torch.randn(4, 2), positional=torch.randn(3, 2),
                       positions=torch.tensor([0.0, 1.0])), TypeError, "positions must hold integer ids"),
    (lambda: embedding(torch.tensor([0, 1]), torch.randn(4, 2), positions=torch.tensor([0, 1])), ValueError,
     "positions were given without a positional table"),
    (lambda: embedding(torch.tensor([0]), torch.randn(4, 2), padding_idx=4), ValueError, "padding_idx must be in"),
    (lambda: embedding(torch.tensor([0]), torch.randn(4, 2), padding_idx=1.0), TypeError, "padding_idx must be an int"),
    (lambda: embedding(torch.tensor([0]), torch.randn(4, 2), dropout_p=1.0), ValueError, "dropout_p"),
    (lambda: embedding(torch.tensor([0]), torch.randn(4, 2), scale=float("inf")), ValueError, "scale must be"),
])
def test_bad_input_raises_naming_the_argument(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


@pytest.mark.parametrize("shape", [(4, 1), (1, 5), (3, 2, 1), (6,), ()])
def test_default_positions_at_every_shape(shape):
    """The default positions (arange(S) along the last dimension, kept per shape for eager calls)
    for every kind of shape, a length-1 S included (its expansion has stride 0), twice (the kept
    tensor is reused)."""
    skip_without_kernels("cpu", "embedding")
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 7, shape, generator=g)
    w, table = torch.randn(7, 5, generator=g), torch.randn(6, 5, generator=g)
    want = reference.embedding(ids, w, scale=2.0, positional=table)
    with fastformer.use_backend("cpu"):
        for _ in range(2):
            torch.testing.assert_close(embedding(ids, w, scale=2.0, positional=table), want)
