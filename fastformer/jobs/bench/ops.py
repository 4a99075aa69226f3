"""What each op benchmark runs: its inputs, its eager-PyTorch composition, the fastformer call,
its shape sweep and its work (FLOPs or bytes) for throughput units.

The eager compositions are what the ``torch.nn`` modules do in training:

* attention: ``nn.MultiheadAttention``'s path -- the causal and key-padding masks merged into
  one additive float mask, then ``F.scaled_dot_product_attention`` with dropout;
* attention_varlen: packed rows moved to the padded layout, that same SDPA call, and back (torch
  has no variable-length attention on the CPU); ``fastformer-padded`` does the same around
  fastformer's padded op;
* add_layer_norm: ``F.dropout`` + add + ``F.layer_norm`` (post-LN residual block);
* feed_forward: ``linear -> relu -> dropout -> linear``;
* cross_entropy: ``F.cross_entropy`` with label smoothing;
* linear_cross_entropy: ``F.linear`` then ``F.cross_entropy`` (the full logits materialised);
* embedding: ``F.dropout(F.embedding(ids, weight) * sqrt(D) + table[positions])`` (a Transformer's
  input layer on packed rows: the sinusoidal table has no gradient, the weight has).
"""
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

import fastformer
from fastformer.models.positional import sinusoidal_table

DROPOUT = 0.1
SMOOTHING = 0.1
MODES = ("fwd", "bwd", "fwd_bwd")
# `make gpu-check`'s sweep (benchmarks/gpu_check.py): attention's grid against SDPA's flash kernel
# (GPU_CHECK_ATTENTION), every other op at its quick sweep's shapes; a few minutes on one GPU
GPU_CHECK = "gpu-check"
GPU_CHECK_ATTENTION = dict(B=(8,), H=(16,), S=(512, 2048), D=(64, 128), causal=(False, True), dropout=(0.0, 0.1))
Inputs = Dict[str, torch.Tensor]


@dataclass
class OpSpec:
    """One benchmarked op."""
    name: str
    make_inputs: Callable[[Dict, torch.device, torch.dtype], Inputs]
    eager: Callable[[Inputs, Dict], torch.Tensor]
    fastformer: Callable[[Inputs, Dict], torch.Tensor]
    sweep: Callable[[str, str], List[Dict]]  # (device type, "quick"|"full"|"smoke"|GPU_CHECK) -> shapes
    label: Callable[[Dict], str]
    tokens: Callable[[Dict], int]
    flops: Optional[Callable[[Dict, str], float]] = None  # (shape, mode) -> FLOPs
    bytes: Optional[Callable[[Dict, str, int], float]] = None  # (shape, mode, element size) -> bytes
    leaves: List[str] = field(default_factory=list)  # inputs that require grad

    @property
    def unit(self) -> str:
        return "TFLOP/s" if self.flops is not None else "GB/s"

    def throughput(self, shape: Dict, mode: str, seconds: float, element_size: int) -> float:
        if self.flops is not None:
            return self.flops(shape, mode) / seconds / 1e12
        return self.bytes(shape, mode, element_size) / seconds / 1e9


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().requires_grad_(True)


def _randn_leaves(device, dtype, seed: int = 0) -> Callable[..., torch.Tensor]:
    """``leaf(*size, scale=1.0, shift=0.0)``: a leaf of ``shift + scale * N(0, 1)`` values drawn on the
    CPU from one generator seeded with ``seed`` (so every device gets the same numbers)."""
    g = torch.Generator().manual_seed(seed)

    def leaf(*size: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
        return _leaf((shift + scale * torch.randn(*size, generator=g)).to(device, dtype))

    leaf.generator = g  # for the non-float inputs drawn after the leaves
    return leaf


def _gpu_check_as_quick(sweep: Callable[[str, str], List[Dict]]) -> Callable[[str, str], List[Dict]]:
    """An op's sweep whose gpu-check shapes are its quick sweep's."""
    return lambda device, size: sweep(device, "quick" if size == GPU_CHECK else size)


_MODE_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}  # backward = 2.5 x forward (FlashAttention)


# -- attention ----------------------------------------------------------------------------------
def _attention_inputs(s: Dict, device, dtype) -> Inputs:
    B, H, S, D = s["B"], s["H"], s["S"], s["D"]
    leaf = _randn_leaves(device, dtype)
    q, k, v = (leaf(B, H, S, D) for _ in range(3))
    lengths = torch.full((B,), S)
    if s.get("pad", True):
        lengths[B // 2:] = max(1, int(S * 0.8))  # half the batch carries ~20% padding
    key_padding_mask = (torch.arange(S)[None, :] >= lengths[:, None]).to(device)  # (B, S), True = pad
    return {"q": q, "k": k, "v": v, "key_padding_mask": key_padding_mask}


def attention_causal(s: Dict) -> bool:
    """Whether an attention shape is causal (every sweep but gpu-check's: the decoder's case)."""
    return s.get("causal", True)


def attention_dropout(s: Dict) -> float:
    return s.get("dropout", DROPOUT)


def _attention_eager(x: Inputs, s: Dict) -> torch.Tensor:
    q, k, v, kpm = x["q"], x["k"], x["v"], x["key_padding_mask"]
    S = q.shape[2]
    causal = torch.triu(torch.full((S, S), float("-inf"), device=q.device, dtype=q.dtype),
                        diagonal=1 if attention_causal(s) else S)
    pad = torch.zeros(kpm.shape, device=q.device, dtype=q.dtype).masked_fill(kpm, float("-inf"))
    mask = causal[None, None, :, :] + pad[:, None, None, :]  # (B, 1, S, S) merged as MHA does
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=attention_dropout(s))


def _attention_fastformer(x: Inputs, s: Dict) -> torch.Tensor:
    kpm = x["key_padding_mask"] if s.get("pad", True) else None  # no mask at all when nothing is padded
    return fastformer.ops.attention(x["q"], x["k"], x["v"], key_padding_mask=kpm,
                                    is_causal=attention_causal(s), dropout_p=attention_dropout(s))


def gpu_check_attention_shapes() -> List[Dict]:
    """The gpu-check grid: every combination of GPU_CHECK_ATTENTION, no padding (so SDPA's flash
    kernel, which takes no mask, runs the same attention)."""
    import itertools

    keys = list(GPU_CHECK_ATTENTION)
    return [dict(zip(keys, values), pad=False) for values in itertools.product(*GPU_CHECK_ATTENTION.values())]


def _attention_sweep(device: str, size: str) -> List[Dict]:
    if size == "smoke":
        return [dict(B=2, H=2, S=16, D=32)]
    if size == GPU_CHECK:
        return gpu_check_attention_shapes()
    if device == "cuda":
        lengths = [512, 1024, 2048] if size == "quick" else [512, 1024, 2048, 4096, 8192]
        return [dict(B=max(1, 16384 // S), H=16, S=S, D=64, pad=pad) for pad in (True, False) for S in lengths]
    lengths = [64, 128] if size == "quick" else [64, 128, 256, 512]
    return [dict(B=8, H=8, S=S, D=64) for S in lengths]


def _attention_flops(s: Dict, mode: str) -> float:
    causal = 0.5 if attention_causal(s) else 1.0  # causal: half the scores
    return 4.0 * s["B"] * s["H"] * s["S"] * s["S"] * s["D"] * causal * _MODE_FACTOR[mode]


def _attention_label(s: Dict) -> str:
    label = f"B{s['B']} H{s['H']} S{s['S']} D{s['D']}" + ("" if s.get("pad", True) else " nopad")
    if "causal" in s:  # the gpu-check grid names both settings; the older sweeps' labels stay as they were
        label += (" causal" if s["causal"] else " full") + f" p{s['dropout']:g}"
    return label


ATTENTION = OpSpec(
    name="attention", make_inputs=_attention_inputs, eager=_attention_eager, fastformer=_attention_fastformer,
    sweep=_attention_sweep, tokens=lambda s: s["B"] * s["S"], flops=_attention_flops, leaves=["q", "k", "v"],
    label=_attention_label)


# -- attention_varlen: the same attention on packed rows --------------------------------------------
def _varlen_lengths(s: Dict) -> torch.Tensor:
    return torch.randint(s["S"] // 2, s["S"] + 1, (s["B"],), generator=torch.Generator().manual_seed(1))


def _varlen_inputs(s: Dict, device, dtype) -> Inputs:
    """q, k, v ``(total, H, D)`` of B sequences of lengths uniform in [S/2, S] (as the training step's
    batch), their cu_seqlens, and the padded layout's index of each packed row (for the providers that
    attend on the padded layout: a torch user's SDPA, fastformer's padded op)."""
    B, H, S, D = s["B"], s["H"], s["S"], s["D"]
    leaf = _randn_leaves(device, dtype)
    lengths = _varlen_lengths(s)
    total = int(lengths.sum())
    q, k, v = (leaf(total, H, D) for _ in range(3))
    padding = torch.arange(S)[None, :] >= lengths[:, None]  # (B, S)
    return {"q": q, "k": k, "v": v, "key_padding_mask": padding.to(device),
            "rows": (~padding).reshape(-1).nonzero().squeeze(1).to(device),
            "cu_seqlens": torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(torch.int32).to(device)}


def _padded(x: Inputs, attend) -> torch.Tensor:
    """``attend(q, k, v, key_padding_mask)`` on the padded ``(B, H, S, D)`` layout, with the moves there
    and back: what attention costs a model that keeps packed rows but has no varlen kernel."""
    kpm, rows = x["key_padding_mask"], x["rows"]
    B, S = kpm.shape
    H, D = x["q"].shape[1:]

    def pad(t):  # (total, H, D) -> (B, H, S, D), zeros at the padding
        return t.new_zeros(B * S, H, D).index_copy(0, rows, t).view(B, S, H, D).transpose(1, 2)
    out = attend(pad(x["q"]), pad(x["k"]), pad(x["v"]), kpm)  # (B, H, S, D)
    return out.transpose(1, 2).reshape(B * S, H, D).index_select(0, rows)


def _varlen_eager(x: Inputs, s: Dict) -> torch.Tensor:
    return _padded(x, lambda q, k, v, kpm: _attention_eager({"q": q, "k": k, "v": v, "key_padding_mask": kpm}, s))


def varlen_padded_fastformer(x: Inputs, s: Dict) -> torch.Tensor:
    return _padded(x, lambda q, k, v, kpm: fastformer.ops.attention(q, k, v, key_padding_mask=kpm, is_causal=True,
                                                                    dropout_p=DROPOUT))


def _varlen_fastformer(x: Inputs, s: Dict) -> torch.Tensor:
    cu, S = x["cu_seqlens"], x["key_padding_mask"].shape[1]
    return fastformer.ops.attention_varlen(x["q"], x["k"], x["v"], cu, cu, S, S, is_causal=True, dropout_p=DROPOUT)


def _varlen_sweep(device: str, size: str) -> List[Dict]:
    if size == "smoke":
        return [dict(B=3, H=2, S=16, D=32)]
    if device == "cuda":
        return [dict(B=max(1, 16384 // S), H=16, S=S, D=64) for S in ([512, 2048] if size == "quick" else [512, 1024, 2048, 4096])]
    return [dict(B=32, H=8, S=S, D=64) for S in ([64, 128] if size == "quick" else [64, 128, 256])]


def _varlen_flops(s: Dict, mode: str) -> float:  # causal over the real tokens: ~L^2 / 2 per sequence
    lengths = _varlen_lengths(s).double()
    return 4.0 * s["H"] * s["D"] * float((lengths * lengths).sum()) * 0.5 * _MODE_FACTOR[mode]


ATTENTION_VARLEN = OpSpec(
    name="attention_varlen", make_inputs=_varlen_inputs, eager=_varlen_eager, fastformer=_varlen_fastformer,
    sweep=_gpu_check_as_quick(_varlen_sweep), tokens=lambda s: int(_varlen_lengths(s).sum()), flops=_varlen_flops,
    leaves=["q", "k", "v"],
    label=lambda s: f"B{s['B']} H{s['H']} S<={s['S']} D{s['D']}")


# -- add_layer_norm -----------------------------------------------------------------------------
def _aln_inputs(s: Dict, device, dtype) -> Inputs:
    N, C = s["N"], s["C"]
    leaf = _randn_leaves(device, dtype)
    return {"x": leaf(N, C), "residual": leaf(N, C), "weight": leaf(C, scale=0.1, shift=1.0),
            "bias": leaf(C, scale=0.1)}


def _aln_eager(x: Inputs, s: Dict) -> torch.Tensor:
    h = x["residual"] + F.dropout(x["x"], DROPOUT, training=True)
    return F.layer_norm(h, (x["x"].shape[-1],), x["weight"], x["bias"], 1e-5)


def _aln_fastformer(x: Inputs, s: Dict) -> torch.Tensor:
    return fastformer.ops.add_layer_norm(x["x"], x["residual"], x["weight"], x["bias"], 1e-5, DROPOUT)


def _aln_sweep(device: str, size: str) -> List[Dict]:
    if size == "smoke":
        return [dict(N=64, C=96)]
    if device == "cuda":
        return [dict(N=32768, C=C) for C in ([512, 1024, 4096] if size == "quick" else [512, 1023, 1024, 2048, 4096, 8192])]
    return [dict(N=4096, C=C) for C in ([512, 1023] if size == "quick" else [256, 512, 1023, 1024, 2048])]


def _aln_bytes(s: Dict, mode: str, elem: int) -> float:
    # minimum traffic: fwd reads x, residual and writes y; bwd reads dy, x, h, writes dx, dresidual
    per = {"fwd": 3, "bwd": 5, "fwd_bwd": 8}[mode]
    return per * s["N"] * s["C"] * elem


ADD_LAYER_NORM = OpSpec(
    name="add_layer_norm", make_inputs=_aln_inputs, eager=_aln_eager, fastformer=_aln_fastformer,
    sweep=_gpu_check_as_quick(_aln_sweep), tokens=lambda s: s["N"], bytes=_aln_bytes,
    leaves=["x", "residual", "weight", "bias"],
    label=lambda s: f"N{s['N']} C{s['C']}")


# -- feed_forward -------------------------------------------------------------------------------
def _ffn_inputs(s: Dict, device, dtype) -> Inputs:
    N, E, Fh = s["N"], s["E"], s["F"]
    leaf = _randn_leaves(device, dtype)
    return {"x": leaf(N, E), "w1": leaf(Fh, E, scale=E ** -0.5), "b1": leaf(Fh, scale=0.1),
            "w2": leaf(E, Fh, scale=Fh ** -0.5), "b2": leaf(E, scale=0.1)}


def _ffn_eager(x: Inputs, s: Dict) -> torch.Tensor:
    h = F.dropout(F.relu(F.linear(x["x"], x["w1"], x["b1"])), DROPOUT, training=True)
    return F.linear(h, x["w2"], x["b2"])


def _ffn_fastformer(x: Inputs, s: Dict) -> torch.Tensor:
    return fastformer.ops.feed_forward(x["x"], x["w1"], x["b1"], x["w2"], x["b2"], activation="relu",
                                       dropout_p=DROPOUT)


def _ffn_sweep(device: str, size: str) -> List[Dict]:
    if size == "smoke":
        return [dict(N=32, E=64, F=128)]
    if device == "cuda":
        return [dict(N=N, E=1024, F=4096) for N in ([4096, 16384] if size == "quick" else [2048, 4096, 8192, 16384, 32768])]
    return [dict(N=N, E=512, F=2048) for N in ([256, 1024] if size == "quick" else [256, 512, 1024, 2048])]


FEED_FORWARD = OpSpec(
    name="feed_forward", make_inputs=_ffn_inputs, eager=_ffn_eager, fastformer=_ffn_fastformer,
    sweep=_gpu_check_as_quick(_ffn_sweep), tokens=lambda s: s["N"], leaves=["x", "w1", "b1", "w2", "b2"],
    flops=lambda s, mode: 4.0 * s["N"] * s["E"] * s["F"] * {"fwd": 1, "bwd": 2, "fwd_bwd": 3}[mode],
    label=lambda s: f"N{s['N']} E{s['E']} F{s['F']}")


# -- cross_entropy ------------------------------------------------------------------------------
def _targets(N: int, V: int, g: torch.Generator, device) -> torch.Tensor:
    target = torch.randint(0, V, (N,), generator=g)
    target[torch.randperm(N, generator=g)[:max(1, N // 10)]] = -100  # 10% padding rows (at least one) are ignored
    return target.to(device)


def _ce_inputs(s: Dict, device, dtype) -> Inputs:
    leaf = _randn_leaves(device, dtype)
    logits = leaf(s["N"], s["V"], scale=2.0)
    return {"logits": logits, "target": _targets(s["N"], s["V"], leaf.generator, device)}


def _ce_eager(x: Inputs, s: Dict) -> torch.Tensor:
    return F.cross_entropy(x["logits"], x["target"], label_smoothing=SMOOTHING, ignore_index=-100)


def _ce_fastformer(x: Inputs, s: Dict) -> torch.Tensor:
    return fastformer.ops.cross_entropy(x["logits"], x["target"], label_smoothing=SMOOTHING, ignore_index=-100)


def _ce_sweep(device: str, size: str) -> List[Dict]:
    if size == "smoke":
        return [dict(N=16, V=100)]
    if device == "cuda":
        return [dict(N=N, V=32000) for N in ([4096, 16384] if size == "quick" else [2048, 4096, 8192, 16384])]
    return [dict(N=N, V=8000) for N in ([512, 2048] if size == "quick" else [512, 1024, 2048, 4096])]


CROSS_ENTROPY = OpSpec(
    name="cross_entropy", make_inputs=_ce_inputs, eager=_ce_eager, fastformer=_ce_fastformer,
    sweep=_gpu_check_as_quick(_ce_sweep), tokens=lambda s: s["N"], leaves=["logits"],
    bytes=lambda s, mode, elem: {"fwd": 1, "bwd": 2, "fwd_bwd": 3}[mode] * s["N"] * s["V"] * elem,
    label=lambda s: f"N{s['N']} V{s['V']}")


# -- linear_cross_entropy -----------------------------------------------------------------------
def _lce_inputs(s: Dict, device, dtype) -> Inputs:
    N, D, V = s["N"], s["D"], s["V"]
    leaf = _randn_leaves(device, dtype)
    hidden, weight, bias = leaf(N, D), leaf(V, D, scale=D ** -0.5), leaf(V, scale=0.1)
    return {"hidden": hidden, "weight": weight, "bias": bias, "target": _targets(N, V, leaf.generator, device)}


def _lce_eager(x: Inputs, s: Dict) -> torch.Tensor:
    logits = F.linear(x["hidden"], x["weight"], x["bias"])
    return F.cross_entropy(logits, x["target"], label_smoothing=SMOOTHING, ignore_index=-100)


def _lce_fastformer(x: Inputs, s: Dict) -> torch.Tensor:
    return fastformer.ops.linear_cross_entropy(x["hidden"], x["weight"], x["target"], linear_bias=x["bias"],
                                               label_smoothing=SMOOTHING, ignore_index=-100)


def _lce_sweep(device: str, size: str) -> List[Dict]:
    if size == "smoke":
        return [dict(N=16, D=32, V=100)]
    if device == "cuda":
        return [dict(N=N, D=1024, V=32000) for N in ([4096, 16384] if size == "quick" else [2048, 4096, 8192, 16384])]
    return [dict(N=N, D=256, V=8000) for N in ([256, 1024] if size == "quick" else [512, 1024, 2048, 4096])]


LINEAR_CROSS_ENTROPY = OpSpec(
    name="linear_cross_entropy", make_inputs=_lce_inputs, eager=_lce_eager, fastformer=_lce_fastformer,
    sweep=_gpu_check_as_quick(_lce_sweep), tokens=lambda s: s["N"], leaves=["hidden", "weight", "bias"],
    flops=lambda s, mode: 2.0 * s["N"] * s["D"] * s["V"] * {"fwd": 1, "bwd": 2, "fwd_bwd": 3}[mode],
    label=lambda s: f"N{s['N']} D{s['D']} V{s['V']}")


# -- embedding ----------------------------------------------------------------------------------
def _emb_positions(N: int, S: int, g: torch.Generator) -> torch.Tensor:
    """(N,) positions of packed sentences of lengths uniform in [S/2, S], each counted from 0."""
    pieces, left = [], N
    while left > 0:
        length = min(left, int(torch.randint(S // 2, S + 1, (1,), generator=g)))
        pieces.append(torch.arange(length))
        left -= length
    return torch.cat(pieces)


def _emb_inputs(s: Dict, device, dtype) -> Inputs:
    N, V, D, S = s["N"], s["V"], s["D"], s["S"]
    leaf = _randn_leaves(device, dtype)
    weight = leaf(V, D, scale=D ** -0.5)
    g = leaf.generator
    return {"weight": weight, "ids": torch.randint(3, V, (N,), generator=g).to(device),
            "positions": _emb_positions(N, S, g).to(device),
            "table": sinusoidal_table(S, D).to(device, dtype)}


def _emb_eager(x: Inputs, s: Dict) -> torch.Tensor:
    h = F.embedding(x["ids"], x["weight"]) * s["D"] ** 0.5 + x["table"][x["positions"]]
    return F.dropout(h, DROPOUT, training=True)


def _emb_fastformer(x: Inputs, s: Dict) -> torch.Tensor:
    return fastformer.ops.embedding(x["ids"], x["weight"], scale=s["D"] ** 0.5, positional=x["table"],
                                    positions=x["positions"], dropout_p=DROPOUT)


def _emb_sweep(device: str, size: str) -> List[Dict]:
    if size == "smoke":
        return [dict(N=50, V=100, D=32, S=16)]
    if device == "cuda":
        return [dict(N=N, V=32000, D=1024, S=512) for N in ([16384, 65536] if size == "quick" else [4096, 16384, 65536])]
    # the base training step's two inputs: 1558 source and 1507 target tokens of 32 x 64, V 8000
    step = [dict(N=N, V=8000, D=256, S=64) for N in (1558, 1507)]
    return step if size == "quick" else step + [dict(N=8192, V=32000, D=512, S=256)]


def _emb_bytes(s: Dict, mode: str, elem: int) -> float:
    # minimum traffic: fwd reads a weight row and a table row and writes a row per id; bwd reads
    # the upstream rows and writes the (V, D) gradient once
    N, V, D = s["N"], s["V"], s["D"]
    fwd, bwd = 3 * N * D, N * D + V * D
    return {"fwd": fwd, "bwd": bwd, "fwd_bwd": fwd + bwd}[mode] * elem


EMBEDDING = OpSpec(
    name="embedding", make_inputs=_emb_inputs, eager=_emb_eager, fastformer=_emb_fastformer,
    sweep=_gpu_check_as_quick(_emb_sweep), tokens=lambda s: s["N"], bytes=_emb_bytes, leaves=["weight"],
    label=lambda s: f"N{s['N']} V{s['V']} D{s['D']}")


OPS: Dict[str, OpSpec] = {spec.name: spec for spec in
                          (ATTENTION, ATTENTION_VARLEN, ADD_LAYER_NORM, FEED_FORWARD, CROSS_ENTROPY, LINEAR_CROSS_ENTROPY,
                           EMBEDDING)}
