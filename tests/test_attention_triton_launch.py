"""How the Triton attention is launched on a GPU, checked in the interpreter: every kernel's
first-choice tile (the config a GPU runs without autotuning, BLOCK_M != BLOCK_N for most) against
the reference, forward and backward; causal query tiles launched heaviest first; int64 offsets
where an offset inside one head can pass 2**31; the fp32 dot
precision the host passes (tf32 only where torch allows it); the CUDA device guard of every
Triton host function."""
import contextlib
import math
import types

import pytest
import torch

from utils import assert_close, assert_close_lowp, kernel_backends, torch_setting

pytestmark = list(kernel_backends("triton")[0].marks)  # skipped, with the reason, where triton cannot run
A = pytest.importorskip("fastformer.triton_kernels.attention", reason="triton is not installed")

from test_attention_triton import LOWP_FACTOR, _check_fp32, _inputs, _kernels, _reference  # noqa: E402


# the padded backward's kernels: dK/dV making dQ too (FUSED_DQ, the default), or dK/dV then dQ
# (FASTFORMER_TRITON_FUSED_DQ=0)
BWD = ("dkdv_dq",) if A.FUSED_DQ else ("dkdv", "dq")


def _first_choice_tiles(dtype, D, heavy):
    elt = torch.empty((), dtype=dtype).element_size()
    return {kind: A._configs(kind, A._block_d(D), elt, heavy)[0].kwargs for kind in ("fwd", "dkdv", "dq")}


# One head dim per BLOCK_D bucket, off the power-of-two grid (the padded-D path).
@pytest.mark.parametrize("heavy", [False, True], ids=["light", "heavy"])
@pytest.mark.parametrize("D", [20, 40, 100, 200])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_first_choice_tiles_against_reference(monkeypatch, dtype, D, heavy):
    """The interpreter runs each kernel's first-choice GPU config (attention._first_config: _configs(...)[0]) on
    odd lengths: causal with a padding mask ("light"), plus an additive mask and dropout
    ("heavy"). Sq < Sk and lengths that end mid-tile for every tile shape in use."""
    if not A.INTERPRET:
        pytest.skip("the interpreter alone runs a fixed config; a GPU autotunes")
    monkeypatch.setattr(A, "INTERPRET_FIRST_CHOICE", True)
    used = []
    first = A._first_config  # the launch keywords of _configs(...)[0], cached per configuration
    monkeypatch.setattr(A, "_first_config", lambda kind, *a: used.append(kind) or first(kind, *a))
    B, H, Sq, Sk = 1, 1, 37, 53
    q, k, v, kpm, am, dout = _inputs(B, H, Sq, Sk, D, dtype=dtype, kpm_frac=0.2,
                                     mask="full" if heavy else None, seed=D)
    p, seed, offset = (0.2, 2**35 + 7, 2**32 - 11) if heavy else (0.0, 0, 0)
    scale = 1.0 / math.sqrt(D)
    got = _kernels(q, k, v, kpm, am, dout, True, scale, p, seed, offset)
    assert used == ["fwd", *BWD], used  # each kernel asked for its first choice
    want32 = _reference(q, k, v, kpm, am, dout, True, scale, p, seed, offset, dtype=torch.float32)
    if dtype == torch.float32:
        _check_fp32(got, want32)
        return
    wantlp = _reference(q, k, v, kpm, am, dout, True, scale, p, seed, offset, dtype=dtype)
    for i, name in enumerate(("out", "lse", "dq", "dk", "dv")):
        if name == "lse":
            assert_close(name, got[i], want32[i], atol=1e-2, rtol=1e-2)
        else:
            assert_close_lowp(name, got[i].float(), want32[i], wantlp[i].float(), factor=LOWP_FACTOR)


def test_first_choice_tiles_are_not_all_square():
    """The reason for the test above: the GPU's first choices are mostly non-square tiles."""
    tiles = [(t["BLOCK_M"], t["BLOCK_N"]) for dtype in (torch.float32, torch.float16) for D in (20, 40, 100, 200)
             for heavy in (False, True) for t in _first_choice_tiles(dtype, D, heavy).values()]
    assert sum(m != n for m, n in tiles) > len(tiles) // 2, tiles


@pytest.mark.parametrize("Sq, Sk", [(40, 29), (29, 40)])
def test_causal_heaviest_query_tiles_first(monkeypatch, Sq, Sk):
    """Causal forward and dQ map program 0 to the last query tile (it sees the most keys);
    every tile still lands on its own rows, masks and dropout counters: results equal the
    reference with 16 x 16 tiles (3 and 2 query tiles, each at its own causal bound)."""
    if A.INTERPRET:
        monkeypatch.setitem(A.INTERPRET_BLOCKS, "BLOCK_M", 16)
        monkeypatch.setitem(A.INTERPRET_BLOCKS, "BLOCK_N", 16)
    q, k, v, kpm, am, dout = _inputs(1, 1, Sq, Sk, 24, kpm_frac=0.1, mask="broadcast", seed=Sq)
    p, seed, offset = 0.3, 5, 2**31 + 3
    got = _kernels(q, k, v, kpm, am, dout, True, 0.2, p, seed, offset)
    _check_fp32(got, _reference(q, k, v, kpm, am, dout, True, 0.2, p, seed, offset))


def test_large_offsets_detects_spans_past_2_31():
    """int64 offsets exactly where an offset inside one head can reach 2**31: a long row-strided
    tensor, a transposed (B, S, H, D) layout, a big additive mask; int32 otherwise."""
    small = ((64, 64), (64, 64), (0, 0, 64, 1), (64, 1))
    assert not A._large_offsets(64, 64, *small)
    assert A._large_offsets(2**16, 8, (2**15 + 1,), (64,), (0, 0, 0, 0), (0, 0))  # q rows
    assert A._large_offsets(8, 2**20, (64,), (2**11 + 64,), (0, 0, 0, 0), (0, 0))  # k rows, (B, S, H, D)
    assert A._large_offsets(2**16, 2**15 + 1, (64,), (64,), (0, 0, 2**15 + 1, 1), (0, 0))  # the mask
    assert not A._large_offsets(2**15, 2**15, (64,), (64,), (0, 0, 2**15, 1), (2**15, 1))  # 2**30 mask


def test_large_offset_kernels_against_reference(monkeypatch):
    """The int64-offset variant (LARGE_OFFSETS, forced here) computes what the int32 one does."""
    monkeypatch.setattr(A, "_large_offsets", lambda *args: True)
    if A.INTERPRET:
        monkeypatch.setitem(A.INTERPRET_BLOCKS, "BLOCK_M", 16)
    q, k, v, kpm, am, dout = _inputs(1, 1, 21, 19, 24, kpm_frac=0.2, mask="full", seed=3)
    got = _kernels(q, k, v, kpm, am, dout, True, 0.3, 0.25, 9, 77)
    _check_fp32(got, _reference(q, k, v, kpm, am, dout, True, 0.3, 0.25, 9, 77))


def _float32_matmul_precision(precision):
    return torch_setting(torch.get_float32_matmul_precision, torch.set_float32_matmul_precision, precision)


@pytest.mark.parametrize("precision, want", [("highest", "ieee"), ("high", "tf32"), ("medium", "tf32")])
def test_fp32_dot_precision_follows_torch(monkeypatch, precision, want):
    """fp32 attention asks for tf32 dots exactly where torch's fp32 matmuls may use tf32
    (torch.get_float32_matmul_precision / torch.backends.cuda.matmul.allow_tf32), as the matmul
    kernel does; fp16 always passes "ieee" (its dots run on tensor cores either way)."""
    seen = []
    launch = A._launch
    monkeypatch.setattr(A, "_launch", lambda kind, fn, grid, bd, elt, args, meta, *rest:
                        seen.append((kind, meta["INPUT_PRECISION"])) or launch(kind, fn, grid, bd, elt, args, meta,
                                                                              *rest))
    q, k, v, kpm, am, dout = _inputs(1, 1, 9, 11, 16)
    with _float32_matmul_precision(precision):
        assert torch.backends.cuda.matmul.allow_tf32 == (want == "tf32")
        got = _kernels(q, k, v, kpm, am, dout, False, 0.25)
        _kernels(q.half(), k.half(), v.half(), kpm, am, dout.half(), False, 0.25)
    assert seen == [(kind, want) for kind in ("fwd", *BWD)] + [(kind, "ieee") for kind in ("fwd", *BWD)]
    _check_fp32(got, _reference(q, k, v, kpm, am, dout, False, 0.25))  # the interpreter computes in fp32


def test_every_triton_host_function_guards_the_cuda_device():
    """Each host function runs under torch.cuda.device of its tensors (a launch otherwise goes to
    the current device); feed_forward's host functions have their own guard."""
    from fastformer.triton_kernels import add_layer_norm as aln
    from fastformer.triton_kernels import cross_entropy as ce
    from fastformer.triton_kernels import feed_forward as ff
    hosts = (A._attention_fwd_host, A._attention_bwd_host, aln._add_layer_norm_fwd_impl,
             aln._add_layer_norm_bwd_impl, ce._cross_entropy_fwd_impl, ce._linear_cross_entropy_fwd_impl,
             ce._linear_cross_entropy_bwd_impl)
    assert all(getattr(fn, "device_guarded", False) for fn in hosts), [fn.__name__ for fn in hosts]
    for fn in (ff._feed_forward_fwd, ff._feed_forward_bwd):
        assert "_device_guard" in fn.__code__.co_names, fn.__name__


def test_device_guard_enters_the_first_tensors_cuda_device(monkeypatch):
    """The guard enters torch.cuda.device(t.device) for a CUDA tensor (stood in for here by an
    object with a CUDA device) off the current device; on the current device, and for CPU
    tensors, it calls the host function directly (no context manager on the hot path)."""
    from fastformer.triton_kernels.utils import on_device_of_first_tensor
    entered = []

    @contextlib.contextmanager
    def fake_device(device):
        entered.append(device)
        yield

    monkeypatch.setattr(torch.cuda, "device", fake_device)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    host = on_device_of_first_tensor(lambda t, x: (list(entered), x))
    assert host(types.SimpleNamespace(device=torch.device("cuda", 1)), 5) == ([torch.device("cuda", 1)], 5)
    entered.clear()
    assert host(types.SimpleNamespace(device=torch.device("cuda", 0)), 4) == ([], 4)
    assert host(torch.zeros(1), 3) == ([], 3)
    assert entered == []


@pytest.mark.parametrize("kind", ["fwd", "dkdv_dq", "dq"])
def test_the_autotuner_times_each_mask_combination_apart(monkeypatch, kind):
    """On a GPU a causal (or padding-masked, grouped-query) launch gets its own timed tile, never
    the one an unmasked launch of the same lengths won: Triton's autotuner keys on the launch's
    keywords that _tuned names. Its benchmark and the kernel are stubbed: only its cache is read."""
    fn = {"fwd": A._attention_fwd, "dkdv_dq": A.kernels._attention_bwd_dkdv, "dq": A.kernels._attention_bwd_dq}[kind]
    monkeypatch.setattr(A, "_TUNERS", {})
    tuner = A._tuned(kind, fn, 64, 2, False, arch=90)
    assert len(tuner.configs) > 1  # else nothing is timed and the test proves nothing
    monkeypatch.setattr(tuner, "_bench", lambda *a, config, **kw: [float(config.kwargs["BLOCK_N"])])
    monkeypatch.setattr(tuner, "fn", types.SimpleNamespace(run=lambda *a, **kw: None))
    base = dict(TUNE_SQ=512, TUNE_SK=512, D=64, IS_CAUSAL=False, HAS_KPM=False, HAS_MASK=False,
                HAS_DROPOUT=False, KV_GROUP=1, **{name: torch.zeros(1) for name in tuner.reset_to_zero})
    variants = [base, dict(base, IS_CAUSAL=True), dict(base, HAS_KPM=True), dict(base, KV_GROUP=2),
                dict(base, TUNE_SQ=1024), base]
    for launch in variants:
        tuner.run(**launch)
    assert len(tuner.cache) == 5  # the last launch repeats the first: served from the cache
