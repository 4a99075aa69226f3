"""The CPU kernels' ISA levels (csrc/cpu/isa.h): every level this CPU runs, forced with
ATEN_CPU_CAPABILITY in a fresh process, reports itself, matches the reference forward and every
gradient (dropout included, with exactly the reference's Philox masks), and gives what the other
levels give (the dropout masks bit for bit). A level the CPU lacks is never chosen, and the
DEFAULT level's code never touches a vector register wider than SSE."""
import json
import os
import platform
import re
import shutil
import subprocess
import sys

import pytest
import torch

from fastformer import _ext

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LEVELS = ("default", "avx2", "avx512")
# /proc/cpuinfo flags a level needs (the compiler flags of setup.py's ISA_FLAGS)
NEEDS = {"default": set(), "avx2": {"avx2", "fma", "f16c", "bmi2"},
         "avx512": {"avx2", "fma", "f16c", "bmi2", "avx512f", "avx512bw", "avx512vl", "avx512dq"}}

pytestmark = pytest.mark.skipif(_ext.load_error() is not None, reason=str(_ext.load_error()))


def _cpu_flags():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


FLAGS = _cpu_flags()
X86 = platform.machine().lower() in ("x86_64", "amd64")


def _supported(level):
    return level == "default" or (X86 and FLAGS is not None and NEEDS[level] <= FLAGS)


# The child: runs every op on the cpu backend at the forced level, checks it against the reference
# (in fp64, same Philox stream) and prints the results as JSON lists for the cross-level check.
CHILD = r"""
import json, sys
import torch
import fastformer
from fastformer import _ext, ops, philox
from fastformer.ops import reference

assert _ext.load_error() is None, _ext.load_error()

torch.set_num_threads(2)
P = 0.1
out = {"level": torch.ops.fastformer.cpu_capability()}
# the level is shown where a reader looks: available_backends()'s text, the bench's machine info
assert out["level"] in fastformer.available_backends()["cpu"].reason, fastformer.available_backends()["cpu"]
from fastformer.jobs.bench.report import machine_info
assert machine_info(torch.device("cpu"))["cpu_capability"] == out["level"]


def run(name, fn, ref, inputs, tol):
    # forward and every gradient of fn on the cpu backend against ref in fp64, same dropout draw
    torch.manual_seed(7)
    rng = philox.next_seed()
    leaves = [t.clone().requires_grad_(t.is_floating_point()) for t in inputs]
    torch.manual_seed(7)
    with fastformer.use_backend("cpu"):
        y = fn(*leaves, None)
    ref_leaves = [t.double().requires_grad_() if t.is_floating_point() else t for t in inputs]
    y_ref = ref(*ref_leaves, rng)
    g = torch.randn(y.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    grads = torch.autograd.grad(y, [t for t in leaves if t.requires_grad], g.to(y.dtype))
    grads_ref = torch.autograd.grad(y_ref, [t for t in ref_leaves if t.requires_grad], g)
    for what, a, b in [("out", y, y_ref)] + [(f"grad{i}", a, b) for i, (a, b) in enumerate(zip(grads, grads_ref))]:
        torch.testing.assert_close(a.double(), b, atol=tol, rtol=tol, msg=lambda m: f"{name} {what}: {m}")
        out[f"{name}.{what}"] = a.double().flatten().tolist()


def mask(name, kept, want):
    # the kernel's dropout mask, exactly the reference's (philox.keep_mask, attention_keep_mask)
    assert torch.equal(kept.reshape(want.shape), want), f"{name}: the dropout mask differs from the reference's"
    out[f"{name}.mask"] = kept.flatten().int().tolist()


g = torch.Generator().manual_seed(0)
r = lambda *s: torch.randn(*s, generator=g)
# two odd shapes per op: (B, H, Sq, Sk, D), (N, C), (N, E, F), (N, V), (N, D, V)
for i, (attn, ln, ff, ce, lce) in enumerate([((2, 3, 13, 17, 40), (7, 203), (9, 24, 37), (11, 103), (10, 24, 101)),
                                              ((1, 2, 1, 70, 59), (3, 1023), (5, 7, 131), (4, 1001), (3, 59, 9))]):
    B, H, Sq, Sk, D = attn
    kpm = torch.zeros(B, Sk, dtype=torch.bool)
    kpm[-1, -4:] = True
    run(f"attention{i}", lambda q, k, v, rng: ops.attention(q, k, v, key_padding_mask=kpm, is_causal=True, dropout_p=P),
        lambda q, k, v, rng: reference.attention(q, k, v, key_padding_mask=kpm, is_causal=True, dropout_p=P, rng=rng),
        [r(B, H, Sq, D), r(B, H, Sk, D), r(B, H, Sk, D)], 2e-5)
    N, C = ln
    run(f"add_layer_norm{i}", lambda x, res, w, b, rng: ops.add_layer_norm(x, res, w, b, 1e-5, P),
        lambda x, res, w, b, rng: reference.add_layer_norm(x, res, w, b, 1e-5, P, rng=rng),
        [r(N, C), r(N, C), 1 + r(C), r(C)], 2e-5)
    N, E, F = ff
    for act in ("gelu", "silu"):  # each level's vector code of both transcendental activations
        run(f"feed_forward{i}_{act}", lambda x, w1, b1, w2, b2, rng: ops.feed_forward(x, w1, b1, w2, b2, activation=act, dropout_p=P),
            lambda x, w1, b1, w2, b2, rng: reference.feed_forward(x, w1, b1, w2, b2, activation=act, dropout_p=P, rng=rng),
            [r(N, E), r(F, E) / 5, r(F), r(E, F) / 6, r(E)], 2e-5)
    N, V = ce
    t = torch.randint(0, V, (N,), generator=g)
    t[N // 2] = -100
    run(f"cross_entropy{i}", lambda x, rng: ops.cross_entropy(x, t, label_smoothing=0.1),
        lambda x, rng: reference.cross_entropy(x, t, label_smoothing=0.1), [3 * r(N, V)], 2e-5)
    N, D, V = lce
    t2 = torch.randint(0, V, (N,), generator=g)
    run(f"linear_cross_entropy{i}", lambda h, w, b, rng: ops.linear_cross_entropy(h, w, t2, linear_bias=b, label_smoothing=0.1, reduction="sum"),
        lambda h, w, b, rng: reference.linear_cross_entropy(h, w, t2, linear_bias=b, label_smoothing=0.1, reduction="sum"),
        [r(N, D), r(V, D) / 5, r(V)], 2e-5)

# attention at shapes of partial 16 x 32 dropout tiles: forward and gradients (the backward
# regenerates the forward's mask) against the reference
for i, (B, H, Sq, Sk, D) in enumerate([(1, 1, 1, 1023, 16), (2, 3, 37, 70, 24)]):
    run(f"attention_tiles{i}", lambda q, k, v, rng: ops.attention(q, k, v, dropout_p=P),
        lambda q, k, v, rng: reference.attention(q, k, v, dropout_p=P, rng=rng),
        [r(B, H, Sq, D), r(B, H, Sk, D), r(B, H, Sk, D)], 2e-5)

# The raw ops' masks, made visible: uniform attention over v = I, h = dropout(1), a = dropout(relu(1)) I.
seed, offset = 12345, 678
pk = philox.pack(seed, offset)
zq, eye = torch.zeros(1, 2, 5, 37), torch.eye(37).expand(1, 2, 37, 37)
o, _ = torch.ops.fastformer.attention_fwd(zq, torch.zeros(1, 2, 37, 37), eye, None, None, False, 1.0, P, pk)
mask("attention", o != 0, philox.attention_keep_mask((1, 2, 5, 37), P, seed, offset))
# attention's tiles at odd shapes: q = 0 gives every key 1 / Sk, and v[j, j // 8] = 2 ** (j % 8)
# sums each eight keys' keep bits into one exact integer of out
for B, H, Sq, Sk in [(1, 1, 1, 1023), (2, 3, 37, 70)]:
    G, j = (Sk + 7) // 8, torch.arange(Sk)
    v8 = torch.zeros(Sk, G)
    v8[j, j // 8] = 2.0 ** (j % 8)
    o, _ = torch.ops.fastformer.attention_fwd(torch.zeros(B, H, Sq, G), torch.zeros(B, H, Sk, G), v8.expand(B, H, Sk, G),
                                              None, None, False, 1.0, P, pk)
    sums = (o.double() * Sk / philox.attention_keep_scale(P)).round().long()
    kept = ((sums.repeat_interleave(8, dim=-1)[..., :Sk] >> (j % 8)) & 1).bool()
    mask(f"attention_{B}x{H}x{Sq}x{Sk}", kept, philox.attention_keep_mask((B, H, Sq, Sk), P, seed, offset))
_, h, _, _ = torch.ops.fastformer.add_layer_norm_fwd(torch.ones(6, 77), None, torch.ones(77), torch.zeros(77), 1e-5, P, pk)
mask("add_layer_norm", h != 0, philox.keep_mask((6, 77), P, seed, offset))
a, _ = torch.ops.fastformer.feed_forward_fwd(torch.zeros(4, 69), torch.zeros(69, 69), torch.ones(69), torch.eye(69),
                                             None, "relu", P, pk)
mask("feed_forward", a != 0, philox.keep_mask((4, 69), P, seed, offset))
json.dump(out, sys.stdout)
"""


def _child(level, code=CHILD):
    env = dict(os.environ, ATEN_CPU_CAPABILITY=level, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"ATEN_CPU_CAPABILITY={level}: the child failed:\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def results():
    return {level: _child(level) for level in LEVELS if _supported(level)}


@pytest.mark.parametrize("level", [pytest.param(lv, marks=pytest.mark.skipif(
    not _supported(lv), reason=f"this CPU lacks {lv} ({sorted(NEEDS[lv] - (FLAGS or set()))} missing)"))
    for lv in LEVELS])
@pytest.mark.slow
def test_forced_level_runs_and_matches_the_reference(results, level):
    # the child asserted the ops against the reference and the masks against philox's
    assert results[level]["level"] == level.upper()


def test_levels_agree(results):
    if len(results) < 2:
        pytest.skip(f"this CPU runs only the levels {sorted(results)}")
    base_level, base = next(iter(results.items()))
    for level, res in results.items():
        assert res.keys() == base.keys()
        for key, values in res.items():
            if key == "level":
                continue
            if key.endswith(".mask"):
                assert values == base[key], f"{key}: {level} and {base_level} drop different elements"
            else:
                torch.testing.assert_close(torch.tensor(values), torch.tensor(base[key]), atol=1e-5, rtol=1e-5,
                                           msg=lambda m: f"{key}: {level} against {base_level}: {m}")


@pytest.mark.skipif(not X86 or FLAGS is None, reason="needs an x86-64 CPU with /proc/cpuinfo")
@pytest.mark.slow
def test_a_level_the_cpu_lacks_is_never_chosen():
    code = "import torch, fastformer._ext as e; e.load_error(); print(torch.ops.fastformer.cpu_capability())"
    for level in LEVELS:
        env = dict(os.environ, ATEN_CPU_CAPABILITY=level, PYTHONPATH=ROOT)
        got = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                             timeout=120).stdout.strip().lower()
        assert _supported(got), f"ATEN_CPU_CAPABILITY={level} chose {got}, which this CPU lacks"
        # the widest supported level at or below the one asked for
        want = max((lv for lv in LEVELS[:LEVELS.index(level) + 1] if _supported(lv)), key=LEVELS.index)
        assert got == want, f"ATEN_CPU_CAPABILITY={level}: chose {got}, expected {want}"


def _library():
    path = os.environ.get("FASTFORMER_EXT_LIBRARY")
    if path:
        return path
    import importlib.util
    spec = importlib.util.find_spec("fastformer._C")
    return spec.origin if spec else None


# Instructions a baseline x86-64 CPU lacks: VEX / EVEX encoded (AVX, FMA, F16C, AVX-512) and BMI.
_BMI = {"andn", "bextr", "blsi", "blsmsk", "blsr", "bzhi", "mulx", "pdep", "pext", "rorx", "sarx", "shlx", "shrx"}


def _needs_avx(mnemonic, operands):
    return mnemonic.startswith("v") or mnemonic in _BMI or "%ymm" in operands or "%zmm" in operands


@pytest.mark.skipif(shutil.which("objdump") is None or not X86, reason="needs objdump and an x86-64 build")
def test_baseline_code_reaches_no_avx_instruction():
    # Everything the baseline code (the checks, the registration, fastformer::DEFAULT) can call
    # directly, transitively, runs on any x86-64 CPU: the AVX2 / AVX512 levels are reached only
    # through FF_ISA's function pointers, chosen by what the CPU has. Catches an inline function
    # (a std:: template, say) whose one linked copy came from an AVX object.
    lib = _library()
    assert lib and os.path.exists(lib), f"the extension library is not found ({lib})"
    dump = subprocess.run(["objdump", "-d", "-C", "--no-show-raw-insn", lib], capture_output=True,
                          text=True, timeout=300, check=True).stdout
    calls, avx, name = {}, set(), None
    for line in dump.splitlines():
        head = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
        if head:
            name = head.group(1)
            calls.setdefault(name, set())
            continue
        insn = re.match(r"^\s+[0-9a-f]+:\t(\S+)\s*(.*)$", line)
        if insn is None or name is None:
            continue
        mnemonic, operands = insn.groups()
        if _needs_avx(mnemonic, operands):
            avx.add(name)
        target = re.search(r"<(.*?)(?:@plt)?(?:\+0x[0-9a-f]+)?>$", operands)
        if mnemonic.startswith(("call", "jmp")) and target and target.group(1) != name:
            calls[name].add(target.group(1))
    level = re.compile(r"AVX2|AVX512")
    roots = [f for f in calls if "fastformer::" in f and not level.search(f)]
    assert any("fastformer::DEFAULT::" in f for f in roots), "no fastformer::DEFAULT:: code: not an ISA-dispatch build?"
    assert any(level.search(f) for f in avx), "no AVX code in the AVX2 / AVX512 levels: are they built?"
    seen, todo = set(roots), list(roots)
    while todo:
        for callee in calls.get(todo.pop(), ()):
            if callee not in seen and not level.search(callee):
                seen.add(callee)
                todo.append(callee)
    bad = sorted(f for f in seen if f in avx)
    assert not bad, f"baseline code reaches AVX instructions in: {bad[:10]}"
