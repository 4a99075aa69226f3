"""The Hugging Face transformers training-step benchmarks: BART's (``--ops hf_bart_step``) and
T5 v1.1's (``--ops hf_t5_step``).

One step = zero_grad, forward, label-smoothed cross-entropy over the non-pad target tokens,
backward, Adam update, of a ``BartForConditionalGeneration`` (``T5ForConditionalGeneration``)
built from a ``BartConfig`` (``T5Config``; nothing is downloaded), for

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
smoothing 0.1. T5's step is the same size in the T5 v1.1 layout (:data:`T5`): 4 heads of d_kv 64,
a gated-gelu feed-forward of d_ff 1024 (``wi_0``, ``wi_1``, ``wo``, no biases), RMSNorm, the
relative position bias (32 buckets, max distance 128), an untied LM head, dropout 0.1 where
T5 has it; its source rows have no ``<s>``, its decoder starts at the padding id. A
:class:`Family` holds what differs between the two; everything else is shared. The ``gpu-check``
sweep (``make gpu-check``, bf16 autocast there) is the training step's GPU sizes
(``train_step.GPU_SHAPES``: d_model 512 and 1024, 6+6 layers, 64 x 128 tokens).

transformers is optional: without it, :func:`why_not` says so for every provider and the bench
records that reason instead of a time.
"""
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from . import train_step
from .records import emit, time_steps
from .timing import synchronized

OP = "hf_bart_step"  # BART's (T5.op: "hf_t5_step")
PROVIDERS = ["transformers", "transformers-compile", "transformers-fastformer", "transformers-fastformer-compile",
             "transformers-fastformer-reduce-overhead"]
EAGER, COMPILE, FASTFORMER, FASTFORMER_COMPILE, FASTFORMER_GRAPHS = PROVIDERS
COMPILED = (COMPILE, FASTFORMER_COMPILE, FASTFORMER_GRAPHS)  # those that compile first (left out of short runs)
CONVERTED = (FASTFORMER, FASTFORMER_COMPILE, FASTFORMER_GRAPHS)  # those that run the model after fastformer.convert
NEEDS_CUDA = {FASTFORMER_GRAPHS: train_step.NEEDS_CUDA[train_step.AUTO_GRAPHS]}
DTYPES = ("fp32", "bf16")
DEFAULT_DTYPES = ("fp32",)
IGNORE = -100
FIRST_ID = 3  # random tokens from here on: 0-2 are both families' special ids (T5's unk is 2)
# BartConfig's special ids
PAD, BOS, EOS, DECODER_START = 1, 0, 2, 2
# T5's: no <s>, the decoder starts at the padding id
T5_PAD, T5_EOS = 0, 1


@dataclass(frozen=True)
class Family:
    """What one transformers model family's step needs of its own: the rest is shared."""
    op: str  # the bench op, e.g. "hf_bart_step"
    name: str  # the records' label prefix
    model_type: str  # fastformer.hf.fingerprint.check's family
    model_class: str  # transformers' *ForConditionalGeneration class
    pad: int
    eos: int
    bos: Optional[int]  # the source rows' first token (None: the family has none)
    config: Callable[[Dict], object]  # shape -> the transformers config
    shift: Callable[[torch.Tensor, object], torch.Tensor]  # (labels, config) -> decoder_input_ids
    gemms: Callable[[Dict, int, int, int], List[Tuple[int, int, int, int]]]  # (shape, B, S, T) -> products
    finish: Optional[Callable[[object], None]] = None  # what the built model still needs, in place


def _bart_config(shape: Dict):
    from transformers import BartConfig

    p = shape["dropout"]
    return BartConfig(
        vocab_size=shape["vocab"], d_model=shape["d_model"], encoder_layers=shape["layers"],
        decoder_layers=shape["layers"], encoder_attention_heads=shape["heads"],
        decoder_attention_heads=shape["heads"], encoder_ffn_dim=shape["ffn"], decoder_ffn_dim=shape["ffn"],
        dropout=p, attention_dropout=p, activation_dropout=p, max_position_embeddings=max(64, shape["S"]),
        pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS, decoder_start_token_id=DECODER_START,
        use_cache=False)


def _bart_shift(labels: torch.Tensor, config) -> torch.Tensor:
    from transformers.models.bart.modeling_bart import shift_tokens_right  # -100 becomes padding too

    return shift_tokens_right(labels, config.pad_token_id, config.decoder_start_token_id)


def _bart_gemms(shape: Dict, B: int, S: int, T: int) -> List[Tuple[int, int, int, int]]:
    """The same products as the ``train_step`` model's (BART's q, k, v projections are its fused QKV's)."""
    return train_step.step_gemms(shape, torch.zeros(B, S, dtype=torch.long), torch.zeros(B, T + 1, dtype=torch.long))


def _t5_config(shape: Dict):
    """The T5 v1.1 layout (``google/t5-v1_1-*``'s config) at ``shape``'s size."""
    from transformers import T5Config

    return T5Config(
        vocab_size=shape["vocab"], d_model=shape["d_model"], num_heads=shape["heads"],
        d_kv=shape["d_model"] // shape["heads"], num_layers=shape["layers"], num_decoder_layers=shape["layers"],
        d_ff=shape["ffn"], feed_forward_proj="gated-gelu", dropout_rate=shape["dropout"],
        relative_attention_num_buckets=32, relative_attention_max_distance=128, tie_word_embeddings=False,
        pad_token_id=T5_PAD, eos_token_id=T5_EOS, decoder_start_token_id=T5_PAD, use_cache=False)


def _t5_untie_head(model) -> None:
    from fastformer.hf.t5 import untie_lm_head

    untie_lm_head(model)  # v1.1's own head (transformers 5 ties a config-built T5's regardless)


def _t5_shift(labels: torch.Tensor, config) -> torch.Tensor:
    from transformers import T5ForConditionalGeneration

    # the model's own shift (-100 becomes padding too) reads nothing of the model but its config
    return T5ForConditionalGeneration._shift_right(SimpleNamespace(config=config), labels)


def _t5_gemms(shape: Dict, B: int, S: int, T: int) -> List[Tuple[int, int, int, int]]:
    """T5's products as ``(batch, M, K, N)``, padded rows included (as transformers computes them):
    separate q, k, v, o projections of ``heads * d_kv`` (counted as one (d, 3 inner) product, the
    same FLOPs), the gated feed-forward's ``wi_0`` and ``wi_1`` (one (d, 2 d_ff)) and ``wo``, the
    untied head. The relative position bias is a table lookup and an add, no product."""
    d, h, F, V, L = shape["d_model"], shape["heads"], shape["ffn"], shape["vocab"], shape["layers"]
    dk = d // h
    inner, Ns, Nt = h * dk, B * S, B * T

    def attention(n_q, n_k):  # per head: scores = q k^T, out = p v
        return [(B * h, n_q, dk, n_k), (B * h, n_q, n_k, dk)]

    encoder = [(1, Ns, d, 3 * inner), *attention(S, S), (1, Ns, inner, d), (1, Ns, d, 2 * F), (1, Ns, F, d)]
    decoder = [(1, Nt, d, 3 * inner), *attention(T, T), (1, Nt, inner, d),  # self-attention
               (1, Nt, d, inner), (1, Ns, d, 2 * inner), *attention(T, S), (1, Nt, inner, d),  # cross-attention
               (1, Nt, d, 2 * F), (1, Nt, F, d)]
    return encoder * L + decoder * L + [(1, Nt, d, V)]


BART = Family(OP, "BART", "bart", "BartForConditionalGeneration", PAD, EOS, BOS,
              _bart_config, _bart_shift, _bart_gemms)
T5 = Family("hf_t5_step", "T5 v1.1", "t5", "T5ForConditionalGeneration", T5_PAD, T5_EOS, None,
            _t5_config, _t5_shift, _t5_gemms, _t5_untie_head)
FAMILIES = {f.op: f for f in (BART, T5)}  # op -> family
OPS = list(FAMILIES)


def sweep(device: str, size: str) -> List[Dict]:
    """The shapes of fastformer's own training-step benchmark (the same model size and batch)."""
    return train_step.sweep(device, size)


def label(shape: Dict, family: Family = BART) -> str:
    return f"{family.name} " + train_step.label(shape)


def _lengths(B: int, S: int, g: torch.Generator) -> torch.Tensor:
    """Row lengths spread evenly over [S/2, S], in a seeded order: a quarter of the tokens pad."""
    lengths = torch.linspace(S / 2, S, B).round().long().clamp(2, S)
    return lengths[torch.randperm(B, generator=g)]


def make_batch(shape: Dict, device: torch.device, seed: int = 0, family: Family = BART) -> Dict[str, torch.Tensor]:
    """``input_ids``/``attention_mask`` ``<s> ... </s>`` (T5: ``... </s>``) then padding, ``labels``
    ``... </s>`` then -100, and the ``decoder_input_ids`` shifted from them as the family's model
    shifts them; all ``(B, S)``."""
    B, S, V = shape["B"], shape["S"], shape["vocab"]
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(FIRST_ID, V, (B, S), generator=g)
    labels = torch.randint(FIRST_ID, V, (B, S), generator=g)
    for row, (ls, lt) in enumerate(zip(_lengths(B, S, g).tolist(), _lengths(B, S, g).tolist())):
        if family.bos is not None:
            input_ids[row, 0] = family.bos
        input_ids[row, ls - 1] = family.eos
        input_ids[row, ls:] = family.pad
        labels[row, lt - 1] = family.eos
        labels[row, lt:] = IGNORE
    batch = {"input_ids": input_ids, "attention_mask": (input_ids != family.pad).long(),
             "decoder_input_ids": family.shift(labels, family.config(shape)), "labels": labels}
    return {k: v.to(device) for k, v in batch.items()}


def tokens(batch: Dict[str, torch.Tensor]) -> int:
    """Non-pad source + target tokens of a batch."""
    return int(batch["attention_mask"].sum() + (batch["labels"] != IGNORE).sum())


def gemm_flops(shape: Dict, batch: Dict[str, torch.Tensor], family: Family = BART) -> float:
    """The step's matrix-product FLOPs (forward and backward) over the padded batch, as the plain
    model computes them (see the family's ``gemms``)."""
    B, S = batch["input_ids"].shape
    return train_step.step_gemm_flops(family.gemms(shape, B, S, batch["labels"].shape[1]))


def why_not(provider: str, device: torch.device, family: Family = BART) -> Optional[str]:
    """None if ``provider`` can run the family's step on ``device``, else why not."""
    if provider not in PROVIDERS:
        return f"unknown {family.op} provider {provider!r} (known: {PROVIDERS})"
    try:
        import transformers

        getattr(transformers, family.model_class)  # transformers' lazy module imports the model here
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
            check(family.model_type)
        except RuntimeError as e:
            return str(e)
    return None


def build_model(shape: Dict, device: torch.device, seed: int = 0, family: Family = BART):
    """The family's ``*ForConditionalGeneration`` of ``shape``, the same weights for every ``seed``."""
    import transformers

    config = family.config(shape)
    torch.manual_seed(seed)
    model = getattr(transformers, family.model_class)(config)
    if family.finish is not None:
        family.finish(model)
    return model.to(device).train()


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


def build_loss(provider: str, shape: Dict, device: torch.device, family: Family = BART):
    """``(model, batch, loss)``: the provider's model (converted for the fastformer providers), the
    batch, and the loss of it the step computes (a callable of no arguments)."""
    reason = why_not(provider, device, family)
    if reason is not None:
        raise RuntimeError(reason)
    model = build_model(shape, device, family=family)
    if provider in CONVERTED:
        import fastformer

        model = fastformer.convert(model, label_smoothing=shape["smoothing"])
    batch = make_batch(shape, device, family=family)
    return model, batch, loss_fn(provider, model, shape, batch)


def build_step(provider: str, shape: Dict, device: torch.device, dtype: str = "fp32",
               family: Family = BART) -> train_step.Step:
    """The training step of ``provider`` on one fixed padded batch of ``shape``."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    model, batch, compute = build_loss(provider, shape, device, family)
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
                  shapes: Optional[List[str]] = None, family: Family = BART) -> List[Dict]:
    """Records of the family's step for each provider (``providers``: those of them named there) and
    dtype (fp32; ``dtypes`` may name bf16 too), timed interleaved within each repetition; a
    provider that cannot run here gets a record saying why. ``shapes``: only the shapes whose
    label has every one of these words (e.g. ``d512``)."""
    names = [p for p in (providers or PROVIDERS) if p in PROVIDERS]
    if providers is None and size in ("quick", "smoke"):  # no compilation (a minute on CPU) in short runs
        names = [p for p in names if p not in COMPILED]
    if providers is not None and not names and log:
        log(f"  {family.op}: none of --providers is one of its providers ({', '.join(PROVIDERS)})")
    chosen = [d for d in DTYPES if d in dtypes] if dtypes else list(DEFAULT_DTYPES)
    records: List[Dict] = []
    for shape in sweep(device.type, size):
        shape_label = label(shape, family)
        if shapes is not None and not set(shapes) <= set(shape_label.split()):
            continue
        reasons = {p: why_not(p, device, family) for p in names}
        # the batch needs transformers (the family's shift): none where no provider can run
        runnable = any(reason is None for reason in reasons.values())
        flops = gemm_flops(shape, make_batch(shape, device, family=family), family) if runnable else None
        for dtype in chosen:
            builders = {p: reasons[p] or (lambda p=p: build_step(p, shape, device, dtype, family)) for p in names}
            recs = time_steps(family.op, shape, shape_label, dtype, size, device, builders, flops, reps=reps)
            emit(records, recs, log, f"{family.op} {dtype}", 1)
    return records
