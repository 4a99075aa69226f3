"""Tiny Hugging Face seq2seq models for the tests/test_hf_*.py files, built from configs (nothing is
downloaded): BART and Marian (post-LN), mBART, M2M100, Whisper and Pegasus (pre-LN), each with its
``*ForConditionalGeneration`` (or ``MarianMTModel``) and bare ``*Model`` class, and the T5 family
(``T5_TYPES``: T5 v1.1 / Flan-T5, T5 v1.0, mT5, UMT5), plus batches with padding in the source, the
target and the labels."""
import pytest
import torch

import fastformer
from utils import assert_close

transformers = pytest.importorskip("transformers", reason="the Hugging Face integration tests need transformers")

MODEL_TYPES = ("bart", "marian", "mbart", "m2m_100", "whisper", "pegasus")
POST_LN = ("bart", "marian")
# the T5 family, by variant: "t5" is v1.1 / Flan-T5 (gated-gelu), "t5_v1_0" the original (relu)
T5_TYPES = ("t5", "t5_v1_0", "mt5", "umt5")
VOCAB, D, HEADS, FFN = 48, 32, 2, 64
PAD, BOS, EOS = 1, 0, 2
MEL, SRC_POS = 8, 8  # Whisper: mel bins, encoder positions (its input has 2 * SRC_POS frames)
# T5's relative bias: 8 buckets up to distance 6, so the tiny batches reach the logarithmic buckets
# (from distance 2 in the encoder, 4 in the decoder) and the clamped ones beyond 6
T5_BUCKETS, T5_MAX_DISTANCE = 8, 6

_CLASSES = {
    "bart": ("BartConfig", "BartForConditionalGeneration", "BartModel"),
    "marian": ("MarianConfig", "MarianMTModel", "MarianModel"),
    "mbart": ("MBartConfig", "MBartForConditionalGeneration", "MBartModel"),
    "m2m_100": ("M2M100Config", "M2M100ForConditionalGeneration", "M2M100Model"),
    "whisper": ("WhisperConfig", "WhisperForConditionalGeneration", "WhisperModel"),
    "pegasus": ("PegasusConfig", "PegasusForConditionalGeneration", "PegasusModel"),
    "t5": ("T5Config", "T5ForConditionalGeneration", "T5Model", "T5EncoderModel"),
    "t5_v1_0": ("T5Config", "T5ForConditionalGeneration", "T5Model", "T5EncoderModel"),
    "mt5": ("MT5Config", "MT5ForConditionalGeneration", "MT5Model", "MT5EncoderModel"),
    "umt5": ("UMT5Config", "UMT5ForConditionalGeneration", "UMT5Model", "UMT5EncoderModel"),
}
ACTIVATION = {"bart": "gelu", "marian": "swish", "mbart": "gelu", "m2m_100": "relu", "whisper": "gelu",
              "pegasus": "gelu", "t5": "gated-gelu", "t5_v1_0": "relu", "mt5": "gated-gelu", "umt5": "gated-gelu"}


def _t5_config(model_type, **overrides):
    """A tiny T5-family config: d_model 32, 2 heads of 16, 2 + 2 blocks, vocab 48, dropout 0; T5's
    convention of the pad token as the decoder's start."""
    kw = dict(vocab_size=VOCAB, d_model=D, d_kv=D // HEADS, d_ff=FFN, num_layers=2, num_decoder_layers=2,
              num_heads=HEADS, relative_attention_num_buckets=T5_BUCKETS,
              relative_attention_max_distance=T5_MAX_DISTANCE, dropout_rate=0.0,
              feed_forward_proj=ACTIVATION[model_type], pad_token_id=PAD, eos_token_id=EOS,
              decoder_start_token_id=PAD)
    kw.update(overrides)
    return getattr(transformers, _CLASSES[model_type][0])(**kw)


def config(model_type, **overrides):
    """A tiny config of ``model_type``: d_model 32, 2 heads, 2 + 2 layers, vocab 48, dropout 0."""
    if model_type in T5_TYPES:
        return _t5_config(model_type, **overrides)
    kw = dict(vocab_size=VOCAB, d_model=D, encoder_layers=2, decoder_layers=2, encoder_attention_heads=HEADS,
              decoder_attention_heads=HEADS, encoder_ffn_dim=FFN, decoder_ffn_dim=FFN, dropout=0.0,
              attention_dropout=0.0, activation_dropout=0.0, encoder_layerdrop=0.0, decoder_layerdrop=0.0,
              activation_function=ACTIVATION[model_type], pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS,
              decoder_start_token_id=EOS, max_position_embeddings=64, scale_embedding=True)
    if model_type == "whisper":
        for k in ("max_position_embeddings", "scale_embedding"):
            kw.pop(k)
        kw.update(num_mel_bins=MEL, max_source_positions=SRC_POS, max_target_positions=32, decoder_start_token_id=3,
                  suppress_tokens=None, begin_suppress_tokens=None)
    if model_type == "marian":
        kw.update(decoder_start_token_id=PAD)
    kw.update(overrides)
    return getattr(transformers, _CLASSES[model_type][0])(**kw)


def build(model_type, bare=False, seed=0, encoder_only=False, **overrides):
    """A tiny model (LM class, the bare *Model with ``bare=True``, a T5 family's *EncoderModel with
    ``encoder_only=True``) in eval mode, its trainable parameters and final_logits_bias moved off their
    initial values (unit LayerNorms, zero biases) by a seeded jitter."""
    cfg = config(model_type, **overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, _CLASSES[model_type][3 if encoder_only else 2 if bare else 1])(cfg)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:  # not the fixed sinusoidal positions (Marian does not even save them)
                p.add_(0.05 * torch.randn(p.shape, generator=g))
        bias = getattr(model, "final_logits_bias", None)
        if bias is not None:
            bias.copy_(0.1 * torch.randn(bias.shape, generator=g))
    return model.eval()


def lm_class(model_type):
    return getattr(transformers, _CLASSES[model_type][1])


def batch(model_type, B=3, S=7, T=5, seed=0, pad_source=True, pad_labels=True, device="cpu"):
    """Inputs with ``labels``: source padding (one row short, one row of length 2) and labels
    padded with -100 at the end of one row."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    if model_type == "whisper":
        out["input_features"] = torch.randn(B, MEL, 2 * SRC_POS, generator=g)
    else:
        ids = torch.randint(4, VOCAB, (B, S), generator=g)
        mask = torch.ones(B, S, dtype=torch.long)
        if pad_source:
            mask[1, S - 2:] = 0
            mask[2 % B, 2:] = 0
            ids[mask == 0] = PAD
        out.update(input_ids=ids, attention_mask=mask)
    labels = torch.randint(4, VOCAB, (B, T), generator=g)
    if pad_labels:
        labels[0, T - 2:] = -100
    out["labels"] = labels
    return {k: v.to(device) for k, v in out.items()}


def decoder_inputs(model, labels):
    """The decoder_input_ids the model's own forward derives from ``labels``."""
    return model.prepare_decoder_input_ids_from_labels(labels) if hasattr(
        model, "prepare_decoder_input_ids_from_labels") else _shift(model, labels)


def _shift(model, labels):
    import importlib
    cls = next(c for c in type(model).__mro__ if c.__module__.startswith("transformers.models."))
    mod = importlib.import_module(cls.__module__)
    if model.config.model_type == "mbart":
        return mod.shift_tokens_right(labels, model.config.pad_token_id)
    return mod.shift_tokens_right(labels, model.config.pad_token_id, model.config.decoder_start_token_id)


# ---- which fused ops ran -----------------------------------------------------------------------
FUSED_OPS = ("attention", "add_layer_norm", "feed_forward", "cross_entropy", "linear_cross_entropy")


def rows_up_to_last_label(labels):
    """The decoder rows a converted model computes in training: per row, 1 + the column of its last label
    that is not -100 (0 for a row with none), summed."""
    return sum(max((t + 1 for t, y in enumerate(row) if y != -100), default=0) for row in labels.tolist())


def count_op_calls(monkeypatch):
    """Wrap each ``fastformer.ops`` entry point (what fastformer.hf calls) with a counter; returns the
    ``Counter`` of calls by op name, and the list of each attention call's keyword arguments.
    ``attention_varlen`` (a layer's attention on its packed rows) counts as ``attention``; its entry
    has ``varlen=True``, ``Sq``/``Sk`` its sequences' bound (the row width) and no key padding mask."""
    import collections

    import fastformer

    calls, attention_kwargs = collections.Counter(), []
    for name in FUSED_OPS + ("attention_varlen",):
        fn = getattr(fastformer.ops, name)

        def wrapper(*args, _fn=fn, _name=name, **kwargs):
            if _name == "attention_varlen":
                calls["attention"] += 1
                attention_kwargs.append(dict(kwargs, Sq=args[5], Sk=args[6], varlen=True, rows_q=args[0].shape[0],
                                             rows_k=args[1].shape[0]))
            else:
                calls[_name] += 1
            if _name == "attention":
                attention_kwargs.append(dict(kwargs, Sq=args[0].shape[2], Sk=args[1].shape[2]))
            return _fn(*args, **kwargs)

        monkeypatch.setattr(fastformer.ops, name, wrapper)
    return calls, attention_kwargs


def ffn_fusable(model_type, backend="auto", device="cpu", dtype=torch.float32):
    """Whether ``model_type``'s activation runs in ``feed_forward`` on ``device`` with ``backend`` (Marian's
    "swish" needs an extension build with silu; without one its layers keep transformers' code)."""
    import fastformer
    from fastformer.hf import patch

    act = ACTIVATION[model_type]
    name = {"gelu": "gelu", "relu": "relu", "swish": "silu", "gated-gelu": "gelu_tanh"}[act]
    with fastformer.use_backend(backend):
        return patch.activation_works(name, torch.device(device), dtype, gated=act.startswith("gated-"))


def layer_counts(model):
    """(encoder layers, decoder layers) of ``model`` (T5's are blocks: num_layers, num_decoder_layers)."""
    cfg = model.config
    if cfg.model_type in ("t5", "mt5", "umt5"):
        return cfg.num_layers, (cfg.num_decoder_layers if hasattr(model, "decoder") else 0)
    return cfg.encoder_layers, cfg.decoder_layers


def expected_calls(model, ffn_fused=True, loss=False):
    """The fused op calls of one forward of a converted ``model`` (E encoder, L decoder layers; a T5
    block's norms and residual adds count as a pre-LN layer's)."""
    E, L = layer_counts(model)
    return {"attention": E + 2 * L, "add_layer_norm": (2 * E + 3 * L) if ffn_fused else 0,
            "feed_forward": (E + L) if ffn_fused else 0, "linear_cross_entropy": int(loss)}


def convert(model, backend="auto", **kwargs):
    """``fastformer.convert`` under ``backend``, asserting its warnings: none, except exactly one naming
    Marian's "swish" when this build's feed_forward cannot run silu."""
    import warnings

    import fastformer

    model_type = model.config.model_type
    fusable = ffn_fusable(model_type, backend, next(model.parameters()).device)
    with warnings.catch_warnings(record=True) as caught, fastformer.use_backend(backend):
        warnings.simplefilter("always")
        out = fastformer.convert(model, **kwargs)
    mine = [str(w.message) for w in caught if "fastformer" in str(w.message)]
    if fusable:
        assert mine == [], mine
    else:
        assert len(mine) == 1 and repr(activation_label(model.config)) in mine[0], mine
    return out


def activation_label(config):
    """The activation as convert()'s warning names it: the config's own word for it."""
    return getattr(config, "activation_function", None) or config.feed_forward_proj


def declines_relative_bias(backend, device="cpu"):
    """Why forcing ``backend`` cannot run attention with T5's relative bias here, or None where it can."""
    import fastformer

    if backend in ("reference", "auto"):
        return None
    try:
        with fastformer.use_backend(backend):
            for op in ("attention", "attention_varlen"):
                fastformer.backends.select(op, torch.device(device), torch.float32, head_dim=D // HEADS,
                                           relative_bias=True)
    except RuntimeError as exc:
        return str(exc)
    return None


def t5_backend(backend, device="cpu"):
    """The backend a T5-family test forces for ``backend``. While the cpu backend's kernels decline
    T5's relative bias (a forced backend then refuses the call), "auto": the cpu kernels for every
    other op, the reference for the biased attention, as a user gets them; Triton is skipped with its
    reason until its kernels take the bias. Once they do, ``backend`` itself."""
    why = declines_relative_bias(backend, device)
    if why is None:
        return backend
    if backend == "cpu":
        return "auto"
    pytest.skip(why)


def packs_when_traced(model):
    """Whether a converted ``model``'s decoder skips its unused rows under torch.compile (with
    ``capture_dynamic_output_shape_ops``): always, except a T5-family model while no kernel takes the
    relative bias on packed rows (the reference loops over the sequences on the host)."""
    if model.config.model_type not in ("t5", "mt5", "umt5"):
        return True
    import fastformer
    return fastformer.backends.select("attention_varlen", torch.device("cpu"), torch.float32,
                                      head_dim=model.config.d_kv, relative_bias=True) is not None


# ---- comparisons the family test files share (tests/test_hf_models.py, test_hf_t5.py, *_generate.py)

NEW_TOKENS = 6  # generate()'s new tokens: with T5's tiny tables, the decoder reaches its log buckets


def grads(model):
    """The gradient of every parameter that has one, by name."""
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def assert_grads_match(model, ref, atol, rtol, what="grad"):
    """Every gradient of the converted ``model`` is ``ref``'s (both after backward); returns them."""
    got, want = grads(model), grads(ref)
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    for name, g in want.items():
        assert_close(f"{what} {name}", got[name], g, atol, rtol)
    return got


def assert_eval_matches(model, ref, batch, backend, atol, rtol):
    """In eval mode, without grad: the converted model's logits and loss are ``ref``'s."""
    model.eval(), ref.eval()
    with torch.no_grad(), fastformer.use_backend(backend):
        out = model(**batch)
    with torch.no_grad():
        want = ref(**batch)
    assert_close("logits", out.logits, want.logits, atol, rtol)
    assert_close("eval loss", out.loss, want.loss, atol, rtol)


def spy_rows(monkeypatch, *names):
    """The rows (numel / last dim) of the first argument of each call to these fastformer.ops."""
    rows = {name: [] for name in names}
    for name, seen in rows.items():
        def spy(x, *args, _fn=getattr(fastformer.ops, name), _seen=seen, **kwargs):
            _seen.append(x.numel() // x.shape[-1])
            return _fn(x, *args, **kwargs)
        monkeypatch.setattr(fastformer.ops, name, spy)
    return rows


def generate(model, batch, **kwargs):
    """Greedy (or beam, with ``num_beams``) decoding of NEW_TOKENS tokens, with the scores."""
    return model.generate(**batch, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                          return_dict_in_generate=True, output_scores=True, **kwargs)


def assert_same_generation(got, want, num_beams):
    """The same tokens, and each step's finite scores (and beam scores) within fp32 tolerance."""
    assert torch.equal(got.sequences, want.sequences)
    assert len(got.scores) == len(want.scores) == NEW_TOKENS
    for step, (a, b) in enumerate(zip(got.scores, want.scores)):
        finite = torch.isfinite(b)
        assert torch.equal(torch.isfinite(a), finite), step
        assert_close(f"scores of step {step}", a[finite], b[finite], 1e-4, 1e-4)
    if num_beams > 1:
        assert_close("sequence scores", got.sequences_scores, want.sequences_scores, 1e-5, 1e-4)
