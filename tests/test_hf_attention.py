"""attn_implementation="fastformer": transformers' masks reach fastformer.ops.attention translated
exactly (padding as key_padding_mask, causal as is_causal, anything else as attn_mask), fully padded
rows included, and the implementation can be chosen by name like "sdpa"."""
import copy
import types

import pytest

transformers = pytest.importorskip("transformers", reason="the Hugging Face integration tests need transformers")

import torch  # noqa: E402
from transformers import masking_utils as mu  # noqa: E402

import fastformer  # noqa: E402
import fastformer.hf  # noqa: E402
from fastformer.hf.attention import fastformer_mask, translate_mask  # noqa: E402
import hf_models as H  # noqa: E402
from utils import assert_close, kernel_backends  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread_module")  # tiny shapes

B = 4


def _padding(kind, length):
    """(B, length) 2-D attention masks, 1 = a real token."""
    m = torch.ones(B, length, dtype=torch.long)
    if kind == "right":
        m[1, length - 2:] = 0
        m[2, 1:] = 0
    elif kind == "left":
        m[1, :2] = 0
        m[3, :length - 1] = 0
    elif kind == "fully-padded":
        m[0, :] = 0
        m[2, length // 2:] = 0
    return None if kind == "none" else m


def _allowed(kpm, attn_mask, is_causal, Sq, Sk):
    """The (B, 1, Sq, Sk) bool "may attend" pattern fastformer.ops.attention computes from its arguments."""
    allowed = torch.ones(B, 1, Sq, Sk, dtype=torch.bool)
    if kpm is not None:
        allowed &= ~kpm[:, None, None, :]
    if attn_mask is not None:
        allowed &= ~attn_mask
    if is_causal:
        allowed &= torch.arange(Sk)[None, :] <= torch.arange(Sq)[:, None] + Sk - Sq
    return allowed


# (mask function, q_length, kv_length, q_offset, kv_offset): encoder / cross bidirectional, causal
# prefill, cached decoding of one token and of a chunk, a prefill into a longer (static) cache
CASES = [("bidirectional", 6, 6, 0, 0), ("bidirectional", 3, 6, 0, 0), ("causal", 6, 6, 0, 0),
         ("causal", 1, 7, 6, 0), ("causal", 3, 8, 5, 0), ("causal", 4, 9, 0, 0)]


@pytest.mark.parametrize("padding", ["none", "right", "left", "fully-padded"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-q{c[1]}-kv{c[2]}-off{c[3]}")
def test_mask_translation_is_exact(case, padding):
    """What the kernel is told equals transformers' SDPA mask for the same call (its None meaning
    is_causal top-left for a causal module with several queries, no mask otherwise)."""
    kind, Sq, Sk, q_offset, kv_offset = case
    causal = kind == "causal"
    fn = mu.causal_mask_function if causal else mu.bidirectional_mask_function
    attention_mask = _padding(padding, Sk + kv_offset)
    if attention_mask is not None:
        attention_mask = attention_mask.bool()
    kw = dict(batch_size=B, q_length=Sq, kv_length=Sk, q_offset=q_offset, kv_offset=kv_offset, mask_function=fn,
              attention_mask=attention_mask, allow_is_causal_skip=causal, allow_is_bidirectional_skip=not causal,
              dtype=torch.float32, use_vmap=False, device="cpu")
    want = mu.sdpa_mask(**kw)
    got = fastformer_mask(**kw)
    module = types.SimpleNamespace(is_causal=causal)
    kpm, attn_mask, is_causal = translate_mask(module, got, Sq, Sk, B, torch.device("cpu"))
    if want is None:
        assert got is None
        want = _allowed(None, None, False, Sq, Sk)
        if causal and Sq > 1:  # SDPA's is_causal: top-left aligned
            want &= torch.arange(Sk)[None, :] <= torch.arange(Sq)[:, None]
    assert torch.equal(_allowed(kpm, attn_mask, is_causal, Sq, Sk), want.expand(B, 1, Sq, Sk))
    # the plain patterns reach the kernel as its own arguments, nothing materialised
    if got is not None and (not causal or q_offset - kv_offset == Sk - Sq):
        assert attn_mask is None and (kpm is not None) == (attention_mask is not None) and is_causal == causal


@pytest.mark.parametrize("backend", [pytest.param("reference", id="reference")] + kernel_backends("cpu"))
@pytest.mark.parametrize("model_type", H.MODEL_TYPES)
def test_padding_and_fully_padded_rows_match_sdpa(model_type, backend, monkeypatch):
    """A source row that is all padding, decoder rows padded left (their first queries see no key)
    and right: loss, logits and gradients equal the SDPA model's, every row; the encoder output at every
    real token (its padded positions are skipped)."""
    ref = H.build(model_type).train()
    assert ref.config._attn_implementation == "sdpa"
    model = H.convert(copy.deepcopy(ref), backend)
    batch = H.batch(model_type, B=B, S=7, T=6)
    if model_type != "whisper":  # Whisper's encoder takes no padding mask
        batch["attention_mask"][3] = 0
        batch["input_ids"][3] = H.PAD
    dec_mask = torch.ones(B, 6, dtype=torch.long)
    dec_mask[1, :3] = 0
    dec_mask[2, 4:] = 0
    batch["decoder_attention_mask"] = dec_mask
    batch["decoder_input_ids"] = H.decoder_inputs(ref, batch["labels"])
    calls, attention = H.count_op_calls(monkeypatch)
    with fastformer.use_backend(backend):
        out = model(**batch)
        out.loss.backward()
    want = ref(**batch)
    want.loss.backward()
    assert_close("loss", out.loss, want.loss, 2e-5, 1e-4)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if q.grad is not None:
            assert_close(f"grad {name}", p.grad, q.grad, 2e-5, 1e-4)
    assert all(k.get("attn_mask") is None for k in attention), "a mask was materialised"
    L = model.config.decoder_layers
    assert sum(k["is_causal"] and k.get("key_padding_mask") is not None for k in attention) == L
    model.eval(), ref.eval()
    with torch.no_grad(), fastformer.use_backend(backend):
        out = model(**batch)
    with torch.no_grad():
        want = ref(**batch)
    assert torch.isfinite(out.logits).all()
    real = batch["attention_mask"].bool() if "attention_mask" in batch else slice(None)  # padding: not computed
    assert_close("encoder output", out.encoder_last_hidden_state[real], want.encoder_last_hidden_state[real],
                 2e-5, 1e-4)
    assert_close("logits", out.logits, want.logits, 2e-5, 1e-4)


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32], ids=["bool", "float-bias"])
def test_custom_4d_masks_pass_through_exactly(mask_dtype, monkeypatch):
    """A user's own 4-D decoder mask is not a padding/causal pattern: it reaches the kernel as attn_mask
    (bool inverted; float added to the scores, as SDPA adds it)."""
    ref = H.build("bart")
    model = H.convert(copy.deepcopy(ref))
    batch = H.batch("bart", B=B, T=6)
    T = 6
    g = torch.Generator().manual_seed(9)
    allowed = torch.rand(B, 1, T, T, generator=g) > 0.4
    allowed |= torch.eye(T, dtype=torch.bool)
    mask = allowed if mask_dtype == torch.bool else torch.randn(B, 1, T, T, generator=g).masked_fill(
        ~allowed, float("-inf"))
    batch.update(decoder_input_ids=H.decoder_inputs(ref, batch.pop("labels")), decoder_attention_mask=mask)
    calls, attention = H.count_op_calls(monkeypatch)
    with torch.no_grad():
        got, want = model(**batch).logits, ref(**batch).logits
    assert_close("logits", got, want, 2e-5, 1e-4)
    self_attn = [k for k in attention if k.get("attn_mask") is not None]
    assert len(self_attn) == model.config.decoder_layers and not any(k["is_causal"] for k in self_attn)


def test_attn_implementation_fastformer_by_name(monkeypatch):
    """After fastformer.hf.register(), attn_implementation="fastformer" chooses the kernel for any model
    built by transformers (here only the attention is fastformer's: convert() fuses the rest)."""
    fastformer.hf.register()
    cfg = H.config("mbart")
    torch.manual_seed(0)
    model = transformers.AutoModelForSeq2SeqLM.from_config(cfg, attn_implementation="fastformer")
    assert model.config._attn_implementation == "fastformer"
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("sdpa")
    batch = H.batch("mbart")
    calls, _ = H.count_op_calls(monkeypatch)
    with torch.no_grad():
        got, want = model(**batch), ref(**batch)
    E, L = cfg.encoder_layers, cfg.decoder_layers
    assert dict(calls) == {"attention": E + 2 * L}
    assert_close("logits", got.logits, want.logits, 2e-5, 1e-4)
    assert_close("loss", got.loss, want.loss, 2e-5, 1e-4)


def test_output_attentions_warns_once():
    model = H.convert(H.build("bart"))
    batch = H.batch("bart")
    batch.pop("labels")
    with pytest.warns(UserWarning, match="does not return attention weights"):
        model(**batch, output_attentions=True)
