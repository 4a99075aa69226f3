"""The benchmark tooling cannot rot: the timing helpers, one smallest-shape case of every
benchmark file, and ``bench --quick`` writing its JSON, table and plots."""
import json
import os
import subprocess
import sys
import time

import pytest
import torch

import fastformer
from fastformer.jobs.cli import main
from fastformer.jobs.bench import ops as bench_ops
from fastformer.jobs.bench import providers as registry
from fastformer.jobs.bench.timing import measure, peak_memory_bytes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH_FILES = ["bench_attention.py", "bench_attention_varlen.py", "bench_add_layer_norm.py", "bench_feed_forward.py",
               "bench_cross_entropy.py", "bench_embedding.py", "bench_train_step.py"]


def test_measure_reports_median_and_spread():
    calls = []

    def sleepy():
        calls.append(1)
        time.sleep(0.002)

    t = measure(sleepy, warmup=2, min_reps=7, max_reps=50, min_time=0.0)
    assert len(calls) == 1 + 2 + t.reps and t.reps >= 7
    assert t.q25_ms <= t.median_ms <= t.q75_ms and t.iqr_ms >= 0
    assert t.median_ms >= 2.0  # time.sleep never returns early


def test_cpu_peak_memory_sees_torch_allocations():
    def allocate():
        a = torch.ones(1024, 1024)  # 4 MiB
        b = a * 2  # another 4 MiB while a is alive
        return float(b.sum())

    peak = peak_memory_bytes(allocate, torch.device("cpu"))
    assert peak is not None and 8 * 2**20 <= peak < 64 * 2**20


def test_every_op_case_runs_each_mode():
    for op, spec in bench_ops.OPS.items():
        shape = spec.sweep("cpu", "smoke")[0]
        case = registry.build_case(op, "torch-eager", shape, torch.device("cpu"), torch.float32)
        assert set(case.calls) == {"fwd", "bwd", "fwd_bwd"}
        for call in case.calls.values():
            call()
        assert spec.throughput(shape, "fwd", 1e-3, 4) > 0 and spec.tokens(shape) > 0


def test_providers_listed_for_cpu():
    names = {p.name for p, _ in registry.providers_for("attention", torch.device("cpu"), torch.float32)}
    assert {"torch-eager", "torch-compile", "fastformer-reference", "fastformer-cpu"} <= names
    assert not names & {"fastformer-triton", "fastformer-cuda", "sdpa", "sdpa-flash"}  # not CPU timing providers
    with pytest.raises(ValueError, match="unknown provider"):
        registry.providers_for("attention", torch.device("cpu"), torch.float32, ["nope"])


TORCH_LCE = ["torch-linear-cross-entropy", "torch-linear-cross-entropy-chunked"]


@pytest.mark.skipif(not hasattr(torch.nn.functional, "linear_cross_entropy"),
                    reason="torch has no F.linear_cross_entropy before 2.13")
def test_torchs_linear_cross_entropy_is_a_provider_of_that_op_only():
    reasons = {p.name: r for p, r in registry.providers_for("linear_cross_entropy", torch.device("cpu"),
                                                            torch.float32)}
    assert {"torch-eager", "torch-compile", "fastformer-cpu", *TORCH_LCE} <= set(reasons)
    assert all(reasons[name] is None for name in TORCH_LCE)
    others = {p.name for op in bench_ops.OPS if op != "linear_cross_entropy"
              for p, _ in registry.providers_for(op, torch.device("cpu"), torch.float32)}
    assert not others & set(TORCH_LCE)


@pytest.mark.skipif(not hasattr(torch.nn.functional, "linear_cross_entropy"),
                    reason="torch has no F.linear_cross_entropy before 2.13")
@pytest.mark.parametrize("provider", TORCH_LCE)
def test_torchs_linear_cross_entropy_gives_fastformers_loss_and_gradients(provider):
    """Each provider times the same computation: torch's op and fastformer's, on the benchmark's
    own inputs (label smoothing, ignored rows, bias), agree on the loss and every gradient."""
    spec = bench_ops.OPS["linear_cross_entropy"]
    shape = spec.sweep("cpu", "smoke")[0]
    results = {}
    for name in (provider, "fastformer-cpu"):
        x = spec.make_inputs(shape, torch.device("cpu"), torch.float32)  # (N, D), (V, D), (V,), (N,)
        loss = registry.REGISTRY[name].factory(spec)(x, shape)
        loss.backward()
        results[name] = [loss.detach()] + [x[leaf].grad for leaf in spec.leaves]
    for what, got, want in zip(["loss"] + spec.leaves, results["fastformer-cpu"], results[provider]):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4, msg=lambda m: f"{what}: {m}")
    # the comparison means something: the inputs hold ignored rows and the loss is smoothed
    x = spec.make_inputs(shape, torch.device("cpu"), torch.float32)
    assert (x["target"] == -100).any() and (x["target"] >= 0).any()


def test_torch_compile_provider_runs_the_composition():
    spec = bench_ops.OPS["add_layer_norm"]
    shape = spec.sweep("cpu", "smoke")[0]
    x = {k: v.detach() for k, v in spec.make_inputs(shape, torch.device("cpu"), torch.float32).items()}
    out = registry.REGISTRY["torch-compile"].factory(spec)(x, shape)  # (N, C)
    assert out.shape == x["x"].shape and torch.isfinite(out).all()
    # whatever dropout mask the compiled RNG drew, each row is LayerNorm-ed: (out - b) / w is standardised
    z = (out - x["bias"]) / x["weight"]
    torch.testing.assert_close(z.mean(-1), torch.zeros(shape["N"]), atol=1e-4, rtol=0)
    torch.testing.assert_close(z.var(-1, unbiased=False), torch.ones(shape["N"]), atol=1e-3, rtol=0)


def test_benchmark_suite_smallest_case_of_every_file():
    # one mode (forward+backward; fp32 for the training step) of the smallest shape, per provider
    env = dict(os.environ, FASTFORMER_BENCH_SWEEP="smoke", FASTFORMER_BENCH_PROVIDERS="torch-eager,fastformer-cpu",
               OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", *[os.path.join("benchmarks", f) for f in BENCH_FILES],
         "--benchmark-disable", "-v", "-p", "no:cacheprovider", "-rs", "-k", "fwd_bwd or fp32"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    passed = [line.split("::")[0] for line in proc.stdout.splitlines() if line.endswith("]") and " PASSED " in line]
    for name in BENCH_FILES:
        assert f"benchmarks/{name}" in passed, f"no case of {name} ran:\n{proc.stdout[-3000:]}"
    ids = [line.split(" ")[0] for line in proc.stdout.splitlines() if " PASSED " in line]
    assert len(ids) == len(set(ids)), "a benchmark case was collected twice"


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny shapes: no thread start-up and no contention on a shared machine
    yield
    torch.set_num_threads(threads)


def test_bench_quick_writes_json_table_and_plots(tmp_path, capsys, one_thread):
    out = tmp_path / "results"
    code = main(["bench", "--quick", "--sweep", "smoke", "--ops", "add_layer_norm", "train_step",
                 "--providers", "torch-eager", "fastformer-cpu", "fastformer-reference", "--out", str(out)])
    assert code == 0
    table = capsys.readouterr().out
    assert "### add_layer_norm" in table and "| torch-eager |" in table and "GB/s" in table
    doc = json.load(open(out / "results.json"))
    assert doc["machine"]["torch"] == torch.__version__ and doc["machine"]["cpu"]
    ok = [r for r in doc["results"] if r["status"] == "ok"]
    assert {r["op"] for r in ok} == {"add_layer_norm", "train_step"}
    for r in ok:
        assert r["median_ms"] > 0 and r["q25_ms"] <= r["median_ms"] <= r["q75_ms"]
        assert r["tokens_per_s"] > 0
    eager = [r for r in ok if r["provider"] == "torch-eager" and r["op"] != "train_step"]
    assert {r["mode"] for r in eager} == {"fwd", "bwd", "fwd_bwd"}
    assert all(r["speedup_vs_eager"] == pytest.approx(1.0) and r["throughput"] > 0 for r in eager)
    assert {r["dtype"] for r in ok if r["op"] == "train_step"} == {"fp32", "bf16"}
    for dtype in ("fp32", "bf16"):  # each step against both yardsticks of its run
        steps = {r["provider"]: r for r in ok if r["op"] == "train_step" and r["dtype"] == dtype}
        padded, real = steps["torch-gemms-alone"], steps["torch-gemms-real-tokens-alone"]
        for name in ("torch-eager", "fastformer-cpu"):
            assert steps[name]["gemm_share"] == pytest.approx(padded["min_ms"] / steps[name]["min_ms"])
            assert steps[name]["gemm_share_real_tokens"] == pytest.approx(real["min_ms"] / steps[name]["min_ms"])
            assert len(steps[name]["samples_ms"]) == steps[name]["reps"] == len(real["samples_ms"])
            ratios = sorted(a / b for a, b in zip(real["samples_ms"], steps[name]["samples_ms"]))
            assert steps[name]["gemm_share_real_tokens_paired"] == pytest.approx(ratios[len(ratios) // 2])
        assert padded["gemm_share"] is None and padded["speedup_vs_eager"] is None
    assert "| GEMM share | GEMM share, real tokens | real tokens, paired median |" in table
    for op in ("add_layer_norm", "train_step"):
        with open(out / f"{op}.png", "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_relate_pairs_the_repetitions_of_an_interleaved_run():
    """best over best can pair a fast moment of one with a slow one of the other; the paired
    share is the median of each repetition's own ratio."""
    from fastformer.jobs.bench.records import relate

    def rec(samples):
        return {"status": "ok", "min_ms": min(samples), "samples_ms": samples}
    recs = {"yard": rec([80.0, 100.0, 60.0]), "step": rec([100.0, 100.0, 100.0]),
            "short": rec([100.0, 100.0]), "failed": {"status": "error: boom", "min_ms": None}}
    relate(recs, "yard", "share")
    assert recs["step"]["share"] == pytest.approx(0.6)  # 60 / 100
    assert recs["step"]["share_paired"] == pytest.approx(0.8)  # median of 0.8, 1.0, 0.6
    assert recs["short"]["share_paired"] is None  # not one sample per repetition: no pairs
    assert recs["failed"]["share"] is None and recs["failed"]["share_paired"] is None
    assert recs["yard"]["share"] is None and recs["yard"]["share_paired"] is None


def test_measure_interleaved_calls_each_once_per_repetition_in_rotated_order():
    from fastformer.jobs.bench.timing import measure_interleaved

    order = []
    fns = {name: (lambda name=name: order.append(name)) for name in "abc"}
    timings = measure_interleaved(fns, warmup=1, min_reps=4, max_reps=4)
    assert order[:6] == list("abcabc")  # first (timed alone) and warm-up calls
    reps = [order[6 + 3 * i: 9 + 3 * i] for i in range(4)]
    assert reps == [list("abc"), list("bca"), list("cab"), list("abc")]
    for t in timings.values():
        assert t.reps == 4 and t.min_ms <= t.q25_ms <= t.median_ms <= t.q75_ms


def test_quiet_verdict_needs_a_load_of_at_most_a_quarter_of_the_cores():
    from fastformer.jobs.bench.report import quiet_verdict

    assert quiet_verdict(0.3, 2)[0] and quiet_verdict(1.0, 4)[0]
    quiet, why = quiet_verdict(0.9, 2)
    assert not quiet and "NOT README-grade" in why and "0.90" in why
    assert not quiet_verdict(None, 2)[0]


def test_quiet_verdict_rejects_a_run_that_other_work_joined(monkeypatch):
    """The load after the run may include the benchmark's own threads, but no more than a quarter
    of the cores beyond them."""
    from fastformer.jobs.bench.report import quiet_verdict

    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    quiet, why = quiet_verdict(0.2, 2, 2.4)
    assert quiet and "2.40 after" in why
    quiet, why = quiet_verdict(0.2, 2, 3.1)
    assert not quiet and "NOT README-grade" in why and "3.10 after" in why


def test_step_gemms_are_the_models_matrix_products():
    """The yardstick's linear products are exactly what torch's flop counter sees in the eager
    model's forward (which does not count attention's products); attention adds q k^T and p v."""
    from torch.utils.flop_counter import FlopCounterMode

    from fastformer.jobs.bench import train_step as ts

    shape = dict(ts.sweep("cpu", "smoke")[0], B=3, S=12, dropout=0.0)
    src, tgt = ts.make_batch(shape, torch.device("cpu"))
    model = ts.TorchSeq2Seq(shape["vocab"], shape["d_model"], shape["heads"], shape["layers"], shape["ffn"],
                            0.0, 0.1).train()
    with FlopCounterMode(display=False) as counter:
        model.loss(src, tgt)
    gemms = ts.step_gemms(shape, src, tgt)
    linear = sum(2 * b * m * k * n for b, m, k, n in gemms if b == 1)
    assert linear == counter.get_total_flops()
    B, Ss, St, h, dh = 3, src.shape[1], tgt.shape[1] - 1, shape["heads"], shape["d_model"] // shape["heads"]
    per_layer = 4 * B * h * dh * (Ss * Ss + St * St + St * Ss)  # encoder self, decoder self, cross
    assert sum(2 * b * m * k * n for b, m, k, n in gemms if b > 1) == shape["layers"] * per_layer
    assert ts.step_gemm_flops(gemms) == 3 * (linear + shape["layers"] * per_layer)


def test_real_token_gemms_are_the_packed_models_linear_products():
    """Over the real tokens only: the linear products are what the flop counter sees in
    fastformer's model skipping padding (its fused ops report no flops, so the counter sees
    the projections outside them; the feed-forward and output projection are counted from the
    model's sizes over the real tokens). The yardstick keeps attention's products padded (as
    before the model ran attention on the packed rows: comparable numbers), while the model now
    computes them per sequence."""
    from torch.utils.flop_counter import FlopCounterMode

    from fastformer.jobs.bench import train_step as ts

    shape = dict(ts.sweep("cpu", "smoke")[0], B=3, S=12, dropout=0.0)
    src, tgt = ts.make_batch(shape, torch.device("cpu"))
    ns, nt = int((src != ts.PAD).sum()), int((tgt[:, :-1] != ts.PAD).sum())
    assert ns < src.numel() and nt < tgt[:, :-1].numel(), "the batch must hold padding"
    padded, real = ts.step_gemms(shape, src, tgt), ts.step_gemms(shape, src, tgt, real_tokens=True)
    assert [g for g in real if g[0] > 1] == [g for g in padded if g[0] > 1]  # attention: padded
    d, F, V, L = shape["d_model"], shape["ffn"], shape["vocab"], shape["layers"]
    model = fastformer.Seq2SeqTransformer(V, V, d_model=d, nhead=shape["heads"], num_encoder_layers=L,
                                          num_decoder_layers=L, dim_feedforward=F, dropout=0.0)
    with FlopCounterMode(display=False) as counter, fastformer.use_backend("reference"):
        model.loss(src, tgt)  # the reference ops are torch ops: every product is counted
    linear = sum(2 * b * m * k * n for b, m, k, n in real if b == 1)
    ls, lt = (src != ts.PAD).sum(1).tolist(), (tgt[:, :-1] != ts.PAD).sum(1).tolist()
    dh, h = d // shape["heads"], shape["heads"]
    per_sequence = sum(s * s for s in ls) + sum(t * t for t in lt) + sum(t * s for t, s in zip(lt, ls))
    assert linear + L * 2 * (2 * h * dh * per_sequence) == counter.get_total_flops()  # q k^T and p v
    assert linear == 2 * (ns * L * (4 * d * d + 2 * d * F) + nt * L * (6 * d * d + 2 * d * F)  # self, FFN
                          + ns * L * 2 * d * d + nt * d * V)  # cross-attention K V of the memory; vocabulary


@pytest.mark.skipif(not fastformer.backends.availability("cpu"), reason="needs the cpu backend (the C++ extension)")
def test_compiled_fastformer_step_trains_as_the_eager_step(one_thread):
    """fastformer-cpu-compile: the same model and optimizer under inductor, on the packed rows.
    Dropout on: the compiled graph draws the same Philox pairs in the same order, so two steps
    give eager's losses up to inductor's rounding."""
    from fastformer.jobs.bench import train_step as ts

    shape = ts.sweep("cpu", "smoke")[0]
    assert shape["dropout"] > 0
    compiled = ts.FASTFORMER_COMPILE
    assert ts.why_not(compiled, torch.device("cpu")) is None and compiled in ts.providers_for(torch.device("cpu"))
    assert compiled not in ts.providers_for(torch.device("cuda"))
    torch._dynamo.reset()
    losses = {}
    for provider in ("fastformer-cpu", compiled):
        step = ts.build_step(provider, shape, torch.device("cpu"), "fp32")
        losses[provider] = torch.stack([step.run().detach() for _ in range(2)])
    torch.testing.assert_close(losses[compiled], losses["fastformer-cpu"], atol=1e-5, rtol=1e-5)
    assert losses[compiled][1] != losses[compiled][0], "the second step must see the updated weights"


def test_copy_yardstick_moves_the_ops_bytes_and_gives_the_fraction_of_copy_bandwidth(tmp_path, capsys, one_thread):
    spec = bench_ops.OPS["cross_entropy"]
    shape = spec.sweep("cpu", "smoke")[0]
    case = registry.build_case("cross_entropy", registry.COPY, shape, torch.device("cpu"), torch.float32)
    assert set(case.calls) == {"fwd", "bwd", "fwd_bwd"}
    for mode, call in case.calls.items():
        src, dst = case.buffers[mode]
        assert src.numel() * 2 * 4 == spec.bytes(shape, mode, 4)  # read + write = the op's traffic model
        call()
        assert torch.equal(dst, src)
    reasons = dict((p.name, r) for p, r in registry.providers_for("attention", torch.device("cpu"), torch.float32))
    assert "memory-bound" in reasons[registry.COPY]  # no GB/s yardstick for a FLOP-bound op
    code = main(["bench", "--quick", "--sweep", "smoke", "--ops", "cross_entropy", "--no-plots",
                 "--providers", "torch-eager", "fastformer-cpu", registry.COPY, "--out", str(tmp_path)])
    assert code == 0
    assert "of copy GB/s" in capsys.readouterr().out
    ok = [r for r in json.load(open(tmp_path / "results.json"))["results"] if r["status"] == "ok"]
    for mode in ("fwd", "bwd", "fwd_bwd"):
        rows = {r["provider"]: r for r in ok if r["mode"] == mode}
        copy = rows[registry.COPY]
        # the copy moves the bytes the op's traffic model counts, so its GB/s is over the same volume
        assert copy["throughput"] == pytest.approx(spec.bytes(shape, mode, 4) / (copy["min_ms"] / 1e3) / 1e9)
        assert copy["speedup_vs_eager"] is None and copy["copy_fraction"] is None
        for name in ("torch-eager", "fastformer-cpu"):
            assert rows[name]["copy_fraction"] == pytest.approx(copy["min_ms"] / rows[name]["min_ms"])


# -- make gpu-check's sweep (benchmarks/gpu_check.py runs `bench --sweep gpu-check` on a GPU) -----------
def test_gpu_check_attention_grid_is_every_combination_unpadded():
    shapes = bench_ops.ATTENTION.sweep("cuda", "gpu-check")
    combos = {(s["B"], s["H"], s["S"], s["D"], s["causal"], s["dropout"]) for s in shapes}
    assert len(shapes) == len(combos) == 16
    assert combos == {(8, 16, S, D, c, p) for S in (512, 2048) for D in (64, 128) for c in (False, True)
                      for p in (0.0, 0.1)}
    assert all(s["pad"] is False for s in shapes)  # SDPA's flash kernel takes no mask
    labels = [bench_ops.ATTENTION.label(s) for s in shapes]
    assert len(set(labels)) == 16 and "B8 H16 S512 D64 nopad full p0" in labels
    assert "B8 H16 S2048 D128 nopad causal p0.1" in labels
    # the older sweeps keep their labels (their results.json records stay comparable)
    assert bench_ops.ATTENTION.label(dict(B=8, H=8, S=64, D=64)) == "B8 H8 S64 D64"
    # every provider the gpu-check names applies to the whole grid
    assert all(registry.REGISTRY["sdpa-flash"].supports(bench_ops.ATTENTION, s) for s in shapes)


def test_gpu_check_attention_flops_count_the_causal_half():
    full, causal = (dict(B=8, H=16, S=512, D=64, causal=c, dropout=0.0, pad=False) for c in (False, True))
    assert bench_ops.ATTENTION.flops(full, "fwd") == 4.0 * 8 * 16 * 512 * 512 * 64
    assert bench_ops.ATTENTION.flops(causal, "fwd") == bench_ops.ATTENTION.flops(full, "fwd") / 2
    assert bench_ops.ATTENTION.flops(full, "bwd") == 2.5 * bench_ops.ATTENTION.flops(full, "fwd")


def test_gpu_check_other_ops_take_their_quick_shapes():
    from fastformer.jobs.bench.records import STEP_TIMING, TIMING

    for op, spec in bench_ops.OPS.items():
        if op != "attention":
            assert spec.sweep("cuda", "gpu-check") == spec.sweep("cuda", "quick"), op
    warmup, min_reps, max_reps, _ = TIMING["gpu-check"]
    assert warmup >= 1 and min_reps == max_reps  # a fixed, small number of samples per case
    assert "gpu-check" in STEP_TIMING


@pytest.mark.parametrize("causal", [False, True])
def test_attention_providers_run_the_shapes_causal_setting(causal):
    """torch-eager's merged mask, SDPA and fastformer compute the same attention for a shape's
    ``causal`` (dropout 0), so the gpu-check grid compares like with like."""
    shape = dict(B=2, H=2, S=16, D=32, causal=causal, dropout=0.0, pad=False)
    x = bench_ops.ATTENTION.make_inputs(shape, torch.device("cpu"), torch.float32)
    want = torch.nn.functional.scaled_dot_product_attention(x["q"], x["k"], x["v"], is_causal=causal)
    torch.testing.assert_close(bench_ops.ATTENTION.eager(x, shape), want)
    with fastformer.use_backend("reference"):
        torch.testing.assert_close(bench_ops.ATTENTION.fastformer(x, shape), want, atol=1e-5, rtol=1e-5)
    sdpa = registry.REGISTRY["sdpa"].factory(bench_ops.ATTENTION)  # a CUDA provider; its math runs anywhere
    torch.testing.assert_close(sdpa(x, shape), want)
    padded = dict(shape, pad=True)  # its boolean mask path against eager's merged float mask
    xp = bench_ops.ATTENTION.make_inputs(padded, torch.device("cpu"), torch.float32)
    torch.testing.assert_close(sdpa(xp, padded), bench_ops.ATTENTION.eager(xp, padded), atol=1e-5, rtol=1e-5)


def test_device_timed_callables_report_their_own_time():
    """On CUDA, synchronized() gives the timers the raw call and the device's clock: a sample is the
    device time per call (events around back-to-back calls), not the wall time, which includes the
    host and the synchronisation (tests/test_bench_timing.py times a fake device in detail)."""
    from fastformer.jobs.bench.timing import measure_interleaved, synchronized

    calls = [0]

    class Event:  # each call is 250 ms of "device" time between two events
        def record(self):
            self.calls = calls[0]

        def elapsed_time(self, end):
            return 250.0 * (end.calls - self.calls)

    class Clock:
        def synchronize(self):
            pass

        def busy(self, seconds):
            pass

        def event(self):
            return Event()

    def gpu_like():
        calls[0] += 1
        time.sleep(0.001)
    fn = synchronized(gpu_like, torch.device("cpu"), clock=Clock())
    t = measure_interleaved({"gpu": fn}, warmup=0, min_reps=3, max_reps=3)["gpu"]
    assert t.median_ms == t.min_ms == 250.0 and t.reps == 3 and t.host_median_ms >= 1.0
    t = measure(fn, warmup=0, min_reps=3, max_reps=3, min_time=0.0)
    assert t.median_ms == 250.0 and t.timer == "cuda-events"


def test_a_run_of_some_shapes_replaces_only_their_records(tmp_path):
    """gpu-check benchmarks attention in two runs (``--shapes D64``, ``--shapes D128``): the second
    keeps the first's records, while a run of whole ops still replaces each op's records."""
    from fastformer.jobs.bench import report
    from fastformer.jobs.bench.__init__ import shape_wanted

    assert shape_wanted("B8 H16 S512 D64 nopad causal p0.1", ["D64", "causal"])
    assert not shape_wanted("B8 H16 S512 D64 nopad full p0", ["D64", "causal"])
    assert not shape_wanted("B8 H16 S512 D640", ["D64"])  # whole words only
    path = str(tmp_path / "results.json")

    def rec(op, label, value):
        return {"op": op, "label": label, "v": value}

    report.write_json(path, {}, {}, [rec("attention", "D64", 1), rec("feed_forward", "N1", 1)])
    doc = report.write_json(path, {}, {}, [rec("attention", "D128", 2)], per_shape=True)
    assert sorted((r["op"], r["label"], r["v"]) for r in doc["results"]) == [
        ("attention", "D128", 2), ("attention", "D64", 1), ("feed_forward", "N1", 1)]
    doc = report.write_json(path, {}, {}, [rec("attention", "D64", 3)], per_shape=True)
    assert sorted((r["label"], r["v"]) for r in doc["results"] if r["op"] == "attention") == [("D128", 2), ("D64", 3)]
    doc = report.write_json(path, {}, {}, [rec("attention", "D32", 4)])
    assert [(r["op"], r["label"]) for r in doc["results"]] == [("feed_forward", "N1"), ("attention", "D32")]


def test_reps_sets_the_number_of_interleaved_samples(tmp_path, one_thread):
    # the smoke sweep takes one sample per timing; --reps asks for more, for ops and the step
    code = main(["bench", "--sweep", "smoke", "--reps", "4", "--ops", "add_layer_norm", "train_step",
                 "--modes", "fwd", "--dtypes", "fp32", "--providers", "torch-eager", "fastformer-cpu",
                 "--no-plots", "--out", str(tmp_path)])
    assert code == 0
    doc = json.load(open(tmp_path / "results.json"))
    assert doc["settings"]["reps"] == 4
    ok = [r for r in doc["results"] if r["status"] == "ok"]
    assert {r["op"] for r in ok} == {"add_layer_norm", "train_step"}
    assert all(r["reps"] == 4 and len(r["samples_ms"]) == 4 for r in ok)
    with pytest.raises(SystemExit):  # argparse: "--reps must be an int >= 1, got 0"
        main(["bench", "--reps", "0"])
