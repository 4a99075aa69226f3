"""DROPOUT.md, "dK/dV: the transposed scores": AOT-compile the first-choice fp16 dK/dV kernels (fused
dQ and not; heavy, and light's tile with dropout on) at d64 / d128 for sm_80 and sm_90, as main
computes them (S^T, the keep tile transposed and converted) and with QUERIES_FIRST (S, P and dS
transposed), and count per kernel. No GPU needed. QUERIES_FIRST is not in the tree (DROPOUT.md
decided against it): apply its patch first, from the repository root, and take it off after:

    git apply benchmarks/results/aot-sm80-sm90/dkdv_queries_first.patch
    TRITON_DEFAULT_FP_FUSION=1 python benchmarks/results/aot-sm80-sm90/dkdv_queries_first.py [--jobs 2] [--match REGEX]
    git apply -R benchmarks/results/aot-sm80-sm90/dkdv_queries_first.patch

dkdv_queries_first.txt holds its output (32 kernels, about 3 minutes with --jobs 2).
"""
import argparse
import concurrent.futures as futures
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.getcwd())


def _copy(spec):
    return {**spec, "constexprs": dict(spec["constexprs"])}


def specs(match=None):
    from fastformer.triton_kernels import aot
    from fastformer.triton_kernels.attention import aot_specs
    all_specs = aot_specs()
    first = [all_specs[i] for i in aot.first_choice_indices(all_specs)]
    out = []
    for d in (64, 128):
        for fam in ("", "_sm90"):
            heavy = [s for s in first if re.fullmatch(rf"attention_dkdvdq_fp16_d{d}_heavy_.*{fam}", s["name"])
                     and s["name"].endswith("_sm90") == bool(fam)]
            light = [s for s in first if re.fullmatch(rf"attention_dkdvdq_fp16_d{d}_light_.*{fam}", s["name"])
                     and s["name"].endswith("_sm90") == bool(fam)]
            assert len(heavy) == 1 and len(light) == 1, (d, fam, [s["name"] for s in heavy + light])
            h, l = heavy[0], light[0]
            # light's tile with dropout on: the heavy spec (its pointers) without the additive mask
            lp = _copy(h)
            for key in ("BLOCK_M", "BLOCK_N"):
                lp["constexprs"][key] = l["constexprs"][key]
            lp["num_warps"], lp["num_stages"] = l["num_warps"], l["num_stages"]
            lp["constexprs"].update(HAS_MASK=False, AM=None)
            lp["name"] = l["name"].replace("_light_", "_lightdrop_")
            for base in (h, lp):
                for fused in (True, False):
                    for qf in (False, True):
                        s = _copy(base)
                        s["constexprs"]["FUSED_DQ"] = fused
                        if not fused:
                            s["constexprs"].update(DQ=None, DQAcc=None, DQLock=None)
                            s["name"] = s["name"].replace("dkdvdq", "dkdv")
                        s["constexprs"]["QUERIES_FIRST"] = qf
                        s["name"] += "  QF" if qf else "  main"
                        if match is None or re.search(match, s["name"]):
                            out.append(s)
    return out


def count(job):
    from fastformer.triton_kernels import aot
    spec = specs(job[0])[job[1]]
    from triton import knobs
    cc = spec["ccs"][0]
    try:
        kernel, log = aot._compile(spec, cc)
    except Exception as e:  # noqa: BLE001 - report and go on
        return spec["name"], cc, f"FAILED: {str(e)[-1500:]}"
    res = aot._measure(kernel, cc, log)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        sass = subprocess.run([knobs.nvidia.cuobjdump.path, "-sass", path], capture_output=True, text=True).stdout
    ttgir = kernel.asm["ttgir"]
    # bytes a thread moves through shared memory, as the static code reads (each instruction once):
    # STS / LDS by their width (.U8 .. .128, 32 bits without one), STSM / LDSM by matrices (.x1 .. .x4:
    # 4 B each a thread; LDSM also reads the dots' pipelined operands, the same in both variants)
    def shared_bytes(op):
        total = 0
        for matrix, suffix in re.findall(rf"\b{op}(M?)((?:\.[A-Z0-9]+)*)", sass):
            parts = suffix.split(".")[1:]
            if matrix:  # LDSM.16.M88.4 / .MT88.2: that many 8 x 8 16-bit matrices, 128 B each a warp
                total += 4 * int(parts[-1] if parts[-1] in ("1", "2", "4") else 1)
            else:  # LDS, LDS.64, STS.U8, LDS.U.128: the width in bits, 32 without one
                widths = [int(x) for x in parts if x in ("8", "16", "32", "64", "128")]
                total += (widths[-1] if widths else 32) // 8
        return total
    row = dict(regs=res["registers"], spill=res["spill_stores"] + res["spill_loads"],
               imadhi=len(re.findall(r"IMAD\.HI", sass)), cvt=ttgir.count("ttg.convert_layout"),
               bar=len(re.findall(r"\bBAR\.SYNC", sass)), sts=len(re.findall(r"\bSTS\b", sass)),
               lds=len(re.findall(r"\bLDS\b", sass)), stsm=len(re.findall(r"\bSTSM\b", sass)),
               ldsm=len(re.findall(r"\bLDSM\b", sass)), hmma=len(re.findall(r"\bHMMA\b", sass)),
               hgmma=len(re.findall(r"\bHGMMA\b", sass)),
               sts_B=shared_bytes("STS"), lds_B=shared_bytes("LDS"), smem=kernel.metadata.shared)
    return spec["name"], cc, row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--match")
    args = ap.parse_args()
    todo = specs(args.match)
    print(f"{len(todo)} kernels", flush=True)
    with futures.ProcessPoolExecutor(args.jobs) as pool:
        for name, cc, row in pool.map(count, [(args.match, i) for i in range(len(todo))]):
            print(f"{name}  sm{cc}  {row}", flush=True)


if __name__ == "__main__":
    main()
