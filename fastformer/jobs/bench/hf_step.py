"""The Hugging Face transformers BART training step benchmark (``--ops hf_bart_step``).

One step = zero_grad, forward, label-smoothed cross-entropy over the non-pad target tokens,
backward, Adam update, of a ``BartForConditionalGeneration`` built from a ``BartConfig`` (nothing
is downloaded), for

* ``transformers``: the model as transformers runs it (eager PyTorch, its default attention
  implementation, ``sdpa``), the loss from its logits with ``F.cross_entropy(...,
  label_smoothing=)``, which is what ``Trainer(label_smoothing_factor=)`` computes (at smoothing
  0: the model's own loss from ``labels``);
* ``transformers-compile``: that loss step (the model's forward and the loss) under
  ``torch.compile(dynamic=False)``;
* ``transformers-fastformer``: the model after ``fastformer.convert(model, label_smoothing=)``
  (fused layers and attention; the LM head and loss as one fused ``linear_cross_entropy``, the
  logits never materialised), its loss ``model(..., labels=labels).loss``;
* ``transformers-fastformer-compile``: that loss under ``torch.compile(fullgraph=True,
  dynamic=False)`` with ``capture_dynamic_output_shape_ops`` (the layers still skip the padding);
* ``transformers-fastformer-reduce-overhead``: that loss under ``torch.compile(mode="reduce-overhead")``
  (inductor plus CUDA graphs; CUDA only: on a CPU its record says so).

All start from the same initial weights, run on the same batch (the decoder inputs shifted
from the labels, as the model itself does), with ``use_cache=False`` (what the model's forward sets
when given labels), and update with the same ``torch.optim.Adam`` (lr 1e-4, betas (0.9, 0.98),
eps 1e-9), so the difference is the model's forward and backward alone. fp32 by default (bf16
autocast with ``--dtypes bf16``).

The default shape is the issue's measurement: d_model 256, 4 heads, 3+3 layers, FFN 1024,
vocabulary 8000, batch 32 x 64 tokens with a quarter of them padding (row lengths spread evenly
from 32 to 64, on both sides), dropout 0.1 (on the residual branches, the attention weights and the
FFN activations, as ``torch.nn.Transformer``'s dropout of the ``train_step`` benchmark), label
smoothing 0.1. The ``gpu-check`` sweep (``make gpu-check``, bf16 autocast there) is the training
step's GPU sizes (``train_step.GPU_SHAPES``: d_model 512 and 1024, 6+6 layers, 64 x 128 tokens).

transformers is optional: without it, :func:`why_not` says so for every provider and the bench
records that reason instead of a time.
"""
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F

from . import train_step
from .records import emit, time_steps
from .timing import synchronized

OP = "hf_bart_step"
PROVIDERS = ["transformers", "transformers-compile", "transformers-fastformer", "transformers-fastformer-compile",
             "transformers-fastformer-reduce-overhead"]
EAGER, COMPILE, FASTFORMER, FASTFORMER_COMPILE, FASTFORMER_GRAPHS = PROVIDERS
COMPILED = (COMPILE, FASTFORMER_COMPILE, FASTFORMER_GRAPHS)  # those that compile first (left out of short runs)
CONVERTED = (FASTFORMER, FASTFORMER_COMPILE, FASTFORMER_GRAPHS)  # those that run the model after fastformer.convert
NEEDS_CUDA = {FASTFORMER_GRAPHS: train_step.NEEDS_CUDA[train_step.AUTO_GRAPHS]}
DTYPES = ("fp32", "bf16")
DEFAULT_DTYPES = ("fp32",)
IGNORE = -100
# BartConfig's special ids
PAD, BOS, EOS, DECODER_START = 1, 0, 2, 2


def sweep(device: str, size: str) -> List[Dict]:
    """The shapes of fastformer's own training-step benchmark (the same model size and batch)."""
    return train_step.sweep(device, size)


def label(shape: Dict) -> str:
    return "BART " + train_step.label(shape)


def _lengths(B: int, S: int, g: torch.Generator) -> torch.Tensor:
    """Row lengths spread evenly over [S/2, S], in a seeded order: a quarter of the tokens pad."""
    lengths = torch.linspace(S / 2, S, B).round().long().clamp(2, S)
    return lengths[torch.randperm(B, generator=g)]


def make_batch(shape: Dict, device: torch.device, seed: int = 0) -> Dict[str, torch.Tensor]:
    """``input_ids``/``attention_mask`` ``<s> ... </s>`` then padding, ``labels`` ``... </s>`` then
    -100, and the ``decoder_input_ids`` shifted from them; all ``(B, S)``."""
    from transformers.models.bart.modeling_bart import shift_tokens_right  # -100 becomes padding too

    B, S, V = shape["B"], shape["S"], shape["vocab"]
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, V, (B, S), generator=g)
    labels = torch.randint(3, V, (B, S), generator=g)
    for row, (ls, lt) in enumerate(zip(_lengths(B, S, g).tolist(), _lengths(B, S, g).tolist())):
        input_ids[row, 0] = BOS
        input_ids[row, ls - 1] = EOS
        input_ids[row, ls:] = PAD
        labels[row, lt - 1] = EOS
        labels[row, lt:] = IGNORE
    batch = {"input_ids": input_ids, "attention_mask": (input_ids != PAD).long(),
             "decoder_input_ids": shift_tokens_right(labels, PAD, DECODER_START), "labels": labels}
    return {k: v.to(device) for k, v in batch.items()}


def tokens(batch: Dict[str, torch.Tensor]) -> int:
    """Non-pad source + target tokens of a batch."""
    return int(batch["attention_mask"].sum() + (batch["labels"] != IGNORE).sum())


def gemm_flops(shape: Dict, batch: Dict[str, torch.Tensor]) -> float:
    """The step's matrix-product FLOPs (forward and backward): the same products as the
    ``train_step`` model's (BART's q, k, v projections are its fused QKV's)."""
    B, S = batch["input_ids"].shape
    return train_step.step_gemm_flops(train_step.step_gemms(shape, batch["input_ids"],
                                                            torch.zeros(B, S + 1, dtype=torch.long)))


def why_not(provider: str, device: torch.device) -> Optional[str]:
    """None if ``provider`` can run the BART step on ``device``, else why not."""
    if provider not in PROVIDERS:
        return f"unknown {OP} provider {provider!r} (known: {PROVIDERS})"
    try:
        from transformers import BartConfig, BartForConditionalGeneration  # noqa: F401
    except Exception as e:  # noqa: BLE001 (ImportError, or a broken install)
        detail = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return f"transformers is not installed (pip install transformers): {type(e).__name__}: {detail}"
    if provider in NEEDS_CUDA and device.type != "cuda":
        return f"{NEEDS_CUDA[provider]} (here: {device.type})"
    if provider in COMPILED:
        try:
            import torch._inductor  # noqa: F401
        except ImportError as e:  # pragma: no cover - a torch without inductor
            return f"torch.compile unavailable: {e}"
    if provider in CONVERTED:
        try:
            from fastformer.hf.fingerprint import check
        except ImportError as e:
            return f"fastformer's Hugging Face integration (fastformer.hf) is not importable: {e}"
        try:
            check("bart")
        except RuntimeError as e:
            return str(e)
    return None


def build_model(shape: Dict, device: torch.device, seed: int = 0):
    """A ``BartForConditionalGeneration`` of ``shape``, the same weights for every ``seed``."""
    from transformers import BartConfig, BartForConditionalGeneration

    p = shape["dropout"]
    config = BartConfig(
        vocab_size=shape["vocab"], d_model=shape["d_model"], encoder_layers=shape["layers"],
        decoder_layers=shape["layers"], encoder_attention_heads=shape["heads"],
        decoder_attention_heads=shape["heads"], encoder_ffn_dim=shape["ffn"], decoder_ffn_dim=shape["ffn"],
        dropout=p, attention_dropout=p, activation_dropout=p, max_position_embeddings=max(64, shape["S"]),
        pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS, decoder_start_token_id=DECODER_START,
        use_cache=False)
    torch.manual_seed(seed)
    return BartForConditionalGeneration(config).to(device).train()


def loss_fn(provider: str, model, shape: Dict, batch: Dict[str, torch.Tensor]):
    """The provider's loss of ``batch`` (a callable of no arguments); ``model`` is already
    converted for the fastformer provider."""
    ls = shape["smoothing"]
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "decoder_input_ids")}
    labels = batch["labels"]
    def own():  # the model's loss from labels: fastformer's fused one, or transformers' unsmoothed one
        return model(**inputs, labels=labels, use_cache=False).loss

    def smoothed():
        logits = model(**inputs, use_cache=False).logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE,
                               label_smoothing=ls)

    fn = own if provider in CONVERTED or ls == 0 else smoothed
    if provider == COMPILE:
        return torch.compile(fn, dynamic=False)
    if provider == FASTFORMER_COMPILE:
        return train_step.compiled_packed(fn)
    if provider == FASTFORMER_GRAPHS:
        return train_step.compiled_packed(fn, mode="reduce-overhead")
    return fn


def build_step(provider: str, shape: Dict, device: torch.device, dtype: str = "fp32") -> train_step.Step:
    """The training step of ``provider`` on one fixed padded batch of ``shape``."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    reason = why_not(provider, device)
    if reason is not None:
        raise RuntimeError(reason)
    model = build_model(shape, device)
    if provider in CONVERTED:
        import fastformer

        model = fastformer.convert(model, label_smoothing=shape["smoothing"])
    batch = make_batch(shape, device)
    compute = loss_fn(provider, model, shape, batch)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9)
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bf16")

    graphs = provider == FASTFORMER_GRAPHS

    def step():
        if graphs:  # a new training step for CUDA graph trees: the last step's outputs may be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        optimizer.zero_grad(set_to_none=True)
        with amp:
            loss = compute()
        loss.backward()
        optimizer.step()
        return loss

    return train_step.Step(synchronized(step, device), tokens(batch), lambda: optimizer.zero_grad(set_to_none=True))


def bench_hf_step(device: torch.device, size: str, providers: Optional[List[str]], log=None,
                  dtypes: Optional[List[str]] = None, reps: Optional[int] = None,
                  shapes: Optional[List[str]] = None) -> List[Dict]:
    """Records of the BART step for each provider (``providers``: those of them named there) and
    dtype (fp32; ``dtypes`` may name bf16 too), timed interleaved within each repetition; a
    provider that cannot run here gets a record saying why. ``shapes``: only the shapes whose
    label has every one of these words (e.g. ``d512``)."""
    names = [p for p in (providers or PROVIDERS) if p in PROVIDERS]
    if providers is None and size in ("quick", "smoke"):  # no compilation (a minute on CPU) in short runs
        names = [p for p in names if p not in COMPILED]
    if providers is not None and not names and log:
        log(f"  {OP}: none of --providers is one of its providers ({', '.join(PROVIDERS)})")
    chosen = [d for d in DTYPES if d in dtypes] if dtypes else list(DEFAULT_DTYPES)
    records: List[Dict] = []
    for shape in sweep(device.type, size):
        shape_label = label(shape)
        if shapes is not None and not set(shapes) <= set(shape_label.split()):
            continue
        flops = gemm_flops(shape, make_batch(shape, device))
        for dtype in chosen:
            builders = {p: why_not(p, device) or (lambda p=p: build_step(p, shape, device, dtype)) for p in names}
            recs = time_steps(OP, shape, shape_label, dtype, size, device, builders, flops, reps=reps)
            emit(records, recs, log, f"{OP} {dtype}", 1)
    return records
