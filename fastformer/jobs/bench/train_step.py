"""The end-to-end training step benchmark.

One step = zero_grad, forward, label-smoothed loss, backward, Adam update, for

* ``fastformer-<backend>``: ``fastformer.models.Seq2SeqTransformer`` with that backend forced;
* ``fastformer-auto``: that model with the backend fastformer picks itself (``auto``: triton, then
  cuda, on a GPU; the cpu backend on a CPU, where the ``fastformer-cpu`` row is the same step);
* ``fastformer-auto-reduce-overhead``: that model's loss under ``torch.compile(mode="reduce-overhead")``
  (inductor plus CUDA graphs: CUDA only; on a CPU its record says so);
* ``torch-eager``: the same architecture from ``torch.nn.Transformer`` + embeddings (scaled by
  sqrt(d_model)) + sinusoidal positions + tied output projection + ``nn.CrossEntropyLoss``;
* ``torch-compile``: that torch model's forward + loss under ``torch.compile``;
* ``fastformer-cpu-compile``: fastformer's model on the cpu backend with its loss under
  ``torch.compile``, on the packed rows (``capture_dynamic_output_shape_ops``);

The fastformer step updates with ``fastformer.optim.make_optimizer`` (torch's fused Adam where
the device has it), as ``python -m fastformer train`` does; the torch providers with
``torch.optim.Adam``'s defaults, as a torch user writes them. Each in fp32 and under ``torch.autocast(<device>, torch.bfloat16)``. The default shape is the
base benchmark: d_model 256, 4 heads, 3+3 layers, FFN 1024, vocabulary 8000, batch 32 x 64
tokens with padding, dropout 0.1, label smoothing 0.1.

The ``gpu-check`` sweep (``make gpu-check``, bf16 autocast there) is two GPU-sized models,
:data:`GPU_SHAPES`: d_model 512 (8 heads, FFN 2048) and 1024 (16 heads, FFN 4096), 6+6 layers,
vocabulary 32000, 64 sentences of up to 128 tokens, each padded after a length drawn uniformly
from [64, 128] (a quarter of the positions padding, as in an unsorted batch), dropout 0.1, label
smoothing 0.1. The ``smoke`` and ``quick`` sweeps are tiny and small: they run on a CPU in seconds.
"""
import contextlib
import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

import fastformer
from fastformer import backends

from .providers import backend_why_not
from .timing import synchronized

PAD, BOS, EOS = 0, 1, 2
DTYPES = ("fp32", "bf16")
FASTFORMER_COMPILE, EAGER, COMPILE = "fastformer-cpu-compile", "torch-eager", "torch-compile"
AUTO, AUTO_GRAPHS = "fastformer-auto", "fastformer-auto-reduce-overhead"
PROVIDERS = (["fastformer-" + name for name in backends.NAMES]
             + [AUTO, FASTFORMER_COMPILE, AUTO_GRAPHS, EAGER, COMPILE])
COMPILED = (FASTFORMER_COMPILE, AUTO_GRAPHS, COMPILE)  # those that compile first (left out of short runs)
NEEDS_CUDA = {AUTO_GRAPHS: 'torch.compile(mode="reduce-overhead") captures CUDA graphs: it needs a CUDA device'}
# make gpu-check's step sizes (the `gpu-check` sweep): a base and a big model, a realistic batch
GPU_BASE = dict(layers=6, vocab=32000, B=64, S=128, dropout=0.1, smoothing=0.1)
GPU_SHAPES = [dict(GPU_BASE, d_model=512, heads=8, ffn=2048), dict(GPU_BASE, d_model=1024, heads=16, ffn=4096)]
STEP_OPS = ("embedding", "attention", "add_layer_norm", "feed_forward", "linear_cross_entropy")  # what the model's step runs


def sweep(device: str, size: str) -> List[Dict]:
    base = dict(d_model=256, heads=4, layers=3, ffn=1024, vocab=8000, dropout=0.1, smoothing=0.1)
    if size == "smoke":
        return [dict(base, d_model=32, heads=2, layers=1, ffn=64, vocab=100, B=2, S=8)]
    if size == "gpu-check":  # the GPU sizes, whatever the device (a CPU takes minutes per step)
        return [dict(shape) for shape in GPU_SHAPES]
    if size == "small":  # a small model on short sentences (6-12 tokens): where host time per op call shows
        return [dict(base, d_model=128, heads=4, layers=2, ffn=512, B=32, S=12)]
    if size == "quick" and device != "cuda":
        return [dict(base, B=8, S=32)]
    return [dict(base, B=32, S=64)]


def label(shape: Dict) -> str:
    return (f"d{shape['d_model']} h{shape['heads']} L{shape['layers']}+{shape['layers']} ffn{shape['ffn']} "
            f"V{shape['vocab']} B{shape['B']}x{shape['S']}")


def make_batch(shape: Dict, device: torch.device, seed: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """src ``(B, S)`` and tgt ``(B, S + 1)`` token ids, each row padded after a random length."""
    B, S, V = shape["B"], shape["S"], shape["vocab"]
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(3, V, (B, S), generator=g)
    tgt = torch.randint(3, V, (B, S + 1), generator=g)
    tgt[:, 0] = BOS
    for row in range(B):
        ls = int(torch.randint(S // 2, S + 1, (), generator=g))
        lt = int(torch.randint(S // 2, S + 1, (), generator=g))
        src[row, ls - 1] = EOS
        src[row, ls:] = PAD
        tgt[row, lt] = EOS
        tgt[row, lt + 1:] = PAD
    return src.to(device), tgt.to(device)


def _sinusoid(max_len: int, d: int) -> torch.Tensor:
    pos = torch.arange(max_len, dtype=torch.float32)[:, None]
    div = torch.exp(torch.arange(0, d, 2, dtype=torch.float32) * (-math.log(10000.0) / d))
    pe = torch.zeros(max_len, d)
    pe[:, 0::2] = torch.sin(pos * div)
    pe[:, 1::2] = torch.cos(pos * div)
    return pe


class TorchSeq2Seq(nn.Module):
    """The baseline: the same model built from stock ``torch.nn`` parts."""

    def __init__(self, vocab: int, d_model: int, heads: int, layers: int, ffn: int, dropout: float,
                 smoothing: float, max_len: int = 1024):
        super().__init__()
        self.d_model = d_model
        self.src_embed = nn.Embedding(vocab, d_model)
        self.tgt_embed = nn.Embedding(vocab, d_model)
        self.register_buffer("pe", _sinusoid(max_len, d_model), persistent=False)
        self.dropout = nn.Dropout(dropout)
        self.transformer = nn.Transformer(d_model, heads, layers, layers, ffn, dropout, batch_first=True)
        self.generator = nn.Linear(d_model, vocab, bias=False)  # as fastformer's: no bias, tied
        self.generator.weight = self.tgt_embed.weight
        self.criterion = nn.CrossEntropyLoss(ignore_index=PAD, label_smoothing=smoothing)

    def _embed(self, embed: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
        return self.dropout(embed(ids) * math.sqrt(self.d_model) + self.pe[: ids.shape[1]])  # (B, S, d)

    def loss(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        tgt_in, tgt_out = tgt[:, :-1], tgt[:, 1:]
        St = tgt_in.shape[1]
        causal = torch.ones(St, St, dtype=torch.bool, device=src.device).triu(1)  # True = masked
        src_pad, tgt_pad = src == PAD, tgt_in == PAD
        h = self.transformer(self._embed(self.src_embed, src), self._embed(self.tgt_embed, tgt_in),
                             tgt_mask=causal, src_key_padding_mask=src_pad, tgt_key_padding_mask=tgt_pad,
                             memory_key_padding_mask=src_pad, tgt_is_causal=True)
        logits = self.generator(h)  # (B, St, V)
        return self.criterion(logits.reshape(-1, logits.shape[-1]), tgt_out.reshape(-1))


def providers_for(device: torch.device) -> List[str]:
    """The training-step providers that are timing providers on ``device`` (the cpu backend on a
    CPU, triton and cuda on a GPU, the others on both)."""
    only = {"fastformer-cpu": "cpu", FASTFORMER_COMPILE: "cpu",
            "fastformer-triton": "cuda", "fastformer-cuda": "cuda",
            # on a CPU auto is the cpu backend (its row is fastformer-cpu's); graphs are CUDA's
            AUTO: "cuda", AUTO_GRAPHS: "cuda"}
    return [p for p in PROVIDERS if only.get(p, device.type) == device.type]


def why_not(provider: str, device: torch.device) -> Optional[str]:
    """None if ``provider`` can run the training step on ``device``, else why not."""
    if provider in (EAGER, COMPILE):
        return None
    if provider not in PROVIDERS:
        return f"unknown training-step provider {provider!r} (known: {PROVIDERS})"
    if provider in NEEDS_CUDA and device.type != "cuda":
        return f"{NEEDS_CUDA[provider]} (here: {device.type})"
    try:
        import fastformer.models  # noqa: F401
    except ImportError as e:
        return f"fastformer.models is not importable: {e}"
    backend = _backend(provider)
    return None if backend is None else backend_why_not(backend, STEP_OPS, device, torch.float32)


def _backend(provider: str) -> Optional[str]:
    """The backend a fastformer provider forces (None: fastformer's own choice, ``auto``)."""
    if provider in (AUTO, AUTO_GRAPHS):
        return None
    return provider[len("fastformer-"):].removesuffix("-compile")


def compiled_packed(loss_fn: Callable, mode: Optional[str] = None) -> Callable:
    """``loss_fn`` under torch.compile, with dynamo allowed to trace the number of real tokens as a
    data-dependent size: the compiled model runs on the packed rows, as eager code does.
    ``mode="reduce-overhead"`` adds CUDA graphs (inductor leaves out, and logs, a graph it cannot
    capture); it compiles without ``fullgraph``, so a graph break costs a graph, not the run."""
    if mode is not None:
        compiled = torch.compile(loss_fn, dynamic=False, mode=mode)
    else:
        compiled = torch.compile(loss_fn, fullgraph=True, dynamic=False)

    def call(*args):
        with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
            return compiled(*args)
    return call


def fastformer_model(shape: Dict, device: torch.device) -> nn.Module:
    """``fastformer.models.Seq2SeqTransformer`` of the step's ``shape``."""
    from fastformer.models import Seq2SeqTransformer

    return Seq2SeqTransformer(shape["vocab"], shape["vocab"], d_model=shape["d_model"], nhead=shape["heads"],
                              num_encoder_layers=shape["layers"], num_decoder_layers=shape["layers"],
                              dim_feedforward=shape["ffn"], dropout=shape["dropout"],
                              pad_idx=PAD, bos_idx=BOS, eos_idx=EOS).to(device)


@dataclass
class Step:
    """One benchmarked training step."""
    run: Callable[[], object]  # one step (synchronising on CUDA)
    tokens: int  # non-pad source + target tokens per step
    reset: Callable[[], None]  # frees the gradients (before a memory measurement)


def build_step(provider: str, shape: Dict, device: torch.device, dtype: str) -> Step:
    """The training step of ``provider`` on one fixed padded batch of ``shape``."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    torch.manual_seed(0)
    kw = dict(d_model=shape["d_model"], heads=shape["heads"], layers=shape["layers"], ffn=shape["ffn"],
              dropout=shape["dropout"])
    fused = provider.startswith("fastformer-")
    if fused:
        reason = why_not(provider, device)
        if reason is not None:
            raise RuntimeError(reason)
        model = fastformer_model(shape, device)
        backend = _backend(provider)

        def loss_fn(src, tgt):
            return model.loss(src, tgt, label_smoothing=shape["smoothing"])
        if provider == FASTFORMER_COMPILE:
            loss_fn = compiled_packed(loss_fn)
        elif provider == AUTO_GRAPHS:
            loss_fn = compiled_packed(loss_fn, mode="reduce-overhead")
    else:
        backend = None
        model = TorchSeq2Seq(shape["vocab"], smoothing=shape["smoothing"], **kw).to(device)
        loss_fn = model.loss
        if provider == COMPILE:
            loss_fn = torch.compile(model.loss, dynamic=False)
    model.train()
    if fused:  # what `python -m fastformer train` runs: fastformer.optim (torch's fused Adam here)
        from fastformer.optim import make_optimizer

        optimizer = make_optimizer(model, lr=1e-4)
    else:  # what a torch user writes
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9)
    src, tgt = make_batch(shape, device)
    tokens = int((src != PAD).sum() + (tgt != PAD).sum())
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bf16")

    graphs = provider == AUTO_GRAPHS

    def step() -> float:
        ctx = fastformer.use_backend(backend) if backend else contextlib.nullcontext()
        if graphs:  # a new training step for CUDA graph trees: the last step's outputs may be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        with ctx:
            optimizer.zero_grad(set_to_none=True)
            with amp:
                loss = loss_fn(src, tgt)
            loss.backward()
            optimizer.step()
        return loss

    return Step(synchronized(step, device), tokens, lambda: optimizer.zero_grad(set_to_none=True))


# -- the machine's own yardstick: the step's matrix products alone -------------------------------
def step_gemms(shape: Dict, src: torch.Tensor, tgt: torch.Tensor,
               real_tokens: bool = False) -> List[Tuple[int, int, int, int]]:
    """Every forward matrix product of one training step of the model on this padded batch, as
    ``(batch, M, K, N)`` for ``(M, K) @ (K, N)``: the linear layers (QKV, output, cross-attention
    Q and KV, FFN, the vocabulary projection) and attention's two products per head.

    ``real_tokens``: the linear layers' products over the real (non-pad) tokens only, as a
    model that skips padding computes them (attention's products stay padded)."""
    B, Ss = src.shape
    St = tgt.shape[1] - 1
    d, h, F, V, L = shape["d_model"], shape["heads"], shape["ffn"], shape["vocab"], shape["layers"]
    Ns, Nt, dh = B * Ss, B * St, d // h
    if real_tokens:
        Ns, Nt = int((src != PAD).sum()), int((tgt[:, :-1] != PAD).sum())

    def attention(n_q, n_k):  # per head: scores = q k^T, out = p v
        return [(B * h, n_q, dh, n_k), (B * h, n_q, n_k, dh)]

    encoder = [(1, Ns, d, 3 * d), *attention(Ss, Ss), (1, Ns, d, d), (1, Ns, d, F), (1, Ns, F, d)]
    decoder = [(1, Nt, d, 3 * d), *attention(St, St), (1, Nt, d, d),  # self-attention
               (1, Nt, d, d), (1, Ns, d, 2 * d), *attention(St, Ss), (1, Nt, d, d),  # cross-attention
               (1, Nt, d, F), (1, Nt, F, d)]
    return encoder * L + decoder * L + [(1, Nt, d, V)]


def step_gemm_flops(gemms: List[Tuple[int, int, int, int]]) -> float:
    """Floating-point operations of the products forward and their two backward products."""
    return 3 * sum(2.0 * b * m * k * n for b, m, k, n in gemms)


def build_gemms(shape: Dict, device: torch.device, dtype: str, real_tokens: bool = False) -> Step:
    """The step's matrix products alone, forward and both backward products of each (``dA = dC
    B^T``, ``dB = A^T dC``), with torch's GEMMs in the step's compute dtype, back to back
    (``real_tokens``: see :func:`step_gemms`)."""
    src, tgt = make_batch(shape, device)
    gemms = step_gemms(shape, src, tgt, real_tokens)
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)

    def rand(*size):
        return torch.randn(*size, generator=g, device=device, dtype=torch.float32).to(torch_dtype)

    operands = []
    for b, m, k, n in gemms:
        a, w, dc = rand(b, m, k), rand(b, k, n), rand(b, m, n)
        operands += [(a, w), (dc, w.transpose(1, 2)), (a.transpose(1, 2), dc)]  # C, dA, dB

    def run():
        for x, y in operands:
            torch.bmm(x, y)

    tokens = int((src != PAD).sum() + (tgt != PAD).sum())
    return Step(synchronized(run, device), tokens, lambda: None)
