# One process (FASTFORMER_EXT_LIBRARY picks the library): best-of-N of the raw attention_varlen_fwd / _bwd
# ops, H 4, D 64, fp32; "step": 32 sequences of 32..64 (self: Lq = Lk; cross: Lq != Lk); L: T = max(1536, L)
# packed tokens as T / L sequences of L. Prints "key<TAB>ms".
# argv: threads [L list | 'step'] [n]
import os, sys, time, torch, fastformer
import fastformer._ext; assert fastformer._ext.load_error() is None
threads = int(sys.argv[1]); only = sys.argv[2] if len(sys.argv) > 2 else "all"
torch.set_num_threads(threads)
ops = torch.ops.fastformer
H, D = 4, 64
def best(f, n):
    f(); f()
    b = 1e9
    for _ in range(n):
        t = time.perf_counter(); f(); b = min(b, time.perf_counter() - t)
    return b * 1e3
res = {}
def run(tag, lq, lk, n):
    cq = torch.zeros(len(lq) + 1, dtype=torch.int32); cq[1:] = torch.cumsum(torch.tensor(lq), 0)
    ck = torch.zeros(len(lk) + 1, dtype=torch.int32); ck[1:] = torch.cumsum(torch.tensor(lk), 0)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(int(cq[-1]), H, D, generator=g); do = torch.randn(int(cq[-1]), H, D, generator=g)
    k, v = (torch.randn(int(ck[-1]), H, D, generator=g) for _ in range(2))
    mq, mk = max(lq), max(lk)
    for causal in (False, True):
        for p in (0.0, 0.1):
            rng = torch.tensor([1234, 0], dtype=torch.int64)
            out, lse = ops.attention_varlen_fwd(q, k, v, cq, ck, mq, mk, causal, D ** -0.5, p, rng)
            fw = lambda: ops.attention_varlen_fwd(q, k, v, cq, ck, mq, mk, causal, D ** -0.5, p, rng)
            bw = lambda: ops.attention_varlen_bwd(do, q, k, v, out, lse, cq, ck, mq, mk, causal, D ** -0.5, p, rng)
            key = f"{tag} {'causal' if causal else 'full  '} p{p}"
            res[key + " fwd"] = best(fw, n)
            res[key + " bwd"] = best(bw, n)
if only in ("all", "step"):
    g = torch.Generator().manual_seed(1)
    lens = torch.randint(32, 65, (32,), generator=g).tolist()
    lens2 = torch.randint(32, 65, (32,), generator=g).tolist()
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 40
    run("step self ", lens, lens, n)
    run("step cross", lens2, lens, n)
if only != "step":
    Ls = [16, 48, 64, 128, 512] if only == "all" else [int(x) for x in only.split(",")]
    for L in Ls:
        T = max(1536, L); B = T // L
        n = int(sys.argv[3]) if len(sys.argv) > 3 else (30 if L <= 128 else 8)
        run(f"L{L}", [L] * B, [L] * B, n)
for k_, v_ in res.items(): print(f"{k_}\t{v_:.4f}")
