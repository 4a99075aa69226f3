"""fastformer.convert on the T5 family (T5 v1.1 / Flan-T5: gated-gelu, T5 v1.0: relu, mT5, UMT5): with dropout 0
the converted model gives the unconverted one's loss, logits and every parameter gradient, the relative
bias tables' included, on each backend; every attention gets its stack's (num_buckets, H) table (UMT5: its
layer's), never a dense bias or mask; the encoder and decoder skip their padding; the tables' gradient is
the same bits run after run."""
import copy
import io

import pytest

transformers = pytest.importorskip("transformers", reason="the Hugging Face integration tests need transformers")

import torch  # noqa: E402

import fastformer  # noqa: E402
import fastformer.hf  # noqa: E402
import hf_models as H  # noqa: E402
from utils import assert_close, kernel_backends  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread_module")  # tiny shapes

TOL = {"reference": (1e-5, 1e-4), "cpu": (2e-5, 1e-4), "triton": (5e-5, 1e-3)}
BACKENDS = [pytest.param("reference", id="reference")] + kernel_backends("cpu")
# every variant on the reference and cpu backends; Triton (its interpreter: seconds a layer) on one tiny case
CASES = [pytest.param(m, *b.values, id=f"{m}-{b.id}", marks=b.marks) for m in H.T5_TYPES for b in BACKENDS]
CASES += [pytest.param("t5", *b.values, id=f"t5-{b.id}", marks=b.marks) for b in kernel_backends("triton")]
S = 9  # source length: distances up to 8, past the tiny configs' max distance 6 (the clamped buckets)


def _self_tables(stack, umt5):
    """The table each block's self-attention must get: T5's first block's (shared), UMT5's own."""
    table = stack.block[0].layer[0].SelfAttention.relative_attention_bias.weight
    return [b.layer[0].SelfAttention.relative_attention_bias.weight if umt5 else table for b in stack.block]


def _bias_seen(attention):
    """Per attention call: (the table it got or None, bidirectional or None, whether a dense mask came)."""
    return [(k.get("relative_attention_bias"), k.get("bidirectional") if k.get("relative_attention_bias") is not None
             else None, k.get("attn_mask") is not None) for k in attention]


def _expected_bias(model):
    umt5 = model.config.model_type == "umt5"
    want = [(t, True, False) for t in _self_tables(model.encoder, umt5)]
    if hasattr(model, "decoder"):
        for t in _self_tables(model.decoder, umt5):
            want += [(t, False, False), (None, None, False)]  # causal self-attention, then cross-attention: no bias
    return want


def _same(seen, want):
    return len(seen) == len(want) and all((a is b if torch.is_tensor(b) else a == b) and c == d and e == f
                                          for (a, c, e), (b, d, f) in zip(seen, want))


@pytest.mark.parametrize("model_type, backend", CASES)
def test_lm_loss_logits_and_grads_match(model_type, backend, monkeypatch):
    small = dict(num_layers=1, num_decoder_layers=1) if backend == "triton" else {}
    atol, rtol = TOL[backend]
    backend = H.t5_backend(backend)
    ref = H.build(model_type, **small).train()
    model = copy.deepcopy(ref)
    assert H.convert(model, backend) is model
    calls, attention = H.count_op_calls(monkeypatch)
    batch = H.batch(model_type, S=S)

    # training with labels: the fused loss (the head scaled by d_model ** -0.5 where the family does)
    with fastformer.use_backend(backend):
        out = model(**batch)
        out.loss.backward()
    want = ref(**batch)
    want.loss.backward()
    assert out.logits is None
    assert_close("loss", out.loss, want.loss, atol, rtol)
    assert dict(calls) == {k: v for k, v in H.expected_calls(model, loss=True).items() if v}
    assert _same(_bias_seen(attention), _expected_bias(model))
    got = H.assert_grads_match(model, ref, atol, rtol)
    assert len(got) == sum(p.requires_grad for p in ref.parameters())
    tables = [n for n in got if "relative_attention_bias" in n]
    assert len(tables) == (sum(H.layer_counts(model)) if model_type == "umt5" else 2)  # UMT5: one a block

    # evaluation: the model's own head, logits and loss as before
    H.assert_eval_matches(model, ref, batch, backend, atol, rtol)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("model_type", ["t5", "umt5"])
def test_bare_and_encoder_models_match(model_type, backend, monkeypatch):
    """T5Model and T5EncoderModel (UMT5's too): outputs at the real tokens and every gradient."""
    atol, rtol = TOL[backend]
    backend = H.t5_backend(backend)
    batch = H.batch(model_type, S=S)
    labels = batch.pop("labels")
    real = batch["attention_mask"].bool()
    g = torch.Generator().manual_seed(3)
    for kind in ("bare", "encoder_only"):
        ref = H.build(model_type, **{kind: True}).train()
        model = copy.deepcopy(ref)
        H.convert(model, backend)
        calls, attention = H.count_op_calls(monkeypatch)
        inputs = dict(batch)
        if kind == "bare":
            inputs["decoder_input_ids"] = ref._shift_right(labels)
        with fastformer.use_backend(backend):
            out = model(**inputs)
        want = ref(**inputs)
        w_enc = torch.randn(want.last_hidden_state.shape if kind != "bare" else want.encoder_last_hidden_state.shape,
                            generator=g) * real[..., None]
        for o in (out, want):
            enc = o.last_hidden_state if kind != "bare" else o.encoder_last_hidden_state
            loss = (enc * w_enc).sum()
            if kind == "bare":
                loss = loss + o.last_hidden_state.square().sum()
            loss.backward()
        if kind == "bare":
            assert_close("decoder output", out.last_hidden_state, want.last_hidden_state, atol, rtol)
        enc_got = out.encoder_last_hidden_state if kind == "bare" else out.last_hidden_state
        enc_want = want.encoder_last_hidden_state if kind == "bare" else want.last_hidden_state
        assert_close("encoder output", enc_got[real], enc_want[real], atol, rtol)
        assert dict(calls) == {k: v for k, v in H.expected_calls(model).items() if v}
        assert _same(_bias_seen(attention), _expected_bias(model))
        H.assert_grads_match(model, ref, atol, rtol, what=f"{kind} grad")


def _step(model, ref, batch, tol=(2e-5, 1e-4)):
    got, want = model(**batch).loss, ref(**batch).loss
    got.backward(), want.backward()
    assert_close("loss", got, want, *tol)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if q.requires_grad:
            assert_close(f"grad {name}", p.grad, q.grad, *tol)


@pytest.mark.parametrize("model_type", ["t5", "umt5"])
def test_padding_is_skipped_by_every_block_op_and_the_loss(model_type, monkeypatch):
    """Right and left source padding: the encoder's ops take the real tokens only, attention (with the
    relative bias by positions within each sentence) included; the decoder's the target positions up
    to each row's last label; the loss those labels. The unconverted model's loss and gradients."""
    ref = H.build(model_type).train()
    model = H.convert(copy.deepcopy(ref))
    batch = H.batch(model_type, B=4, S=S)
    batch["attention_mask"][3] = 0
    batch["attention_mask"][3, 3:] = 1  # left padding: its tokens keep their distances
    rows = H.spy_rows(monkeypatch, "add_layer_norm", "feed_forward", "linear_cross_entropy")
    _, attention = H.count_op_calls(monkeypatch)
    _step(model, ref, batch)
    n_src, n_labels = int(batch["attention_mask"].sum()), int(batch["labels"].ne(-100).sum())
    n_dec = H.rows_up_to_last_label(batch["labels"])
    assert n_src < batch["attention_mask"].numel() and n_dec < batch["labels"].numel()
    E, L = H.layer_counts(model)
    assert rows["feed_forward"] == [n_src] * E + [n_dec] * L
    assert rows["add_layer_norm"] == [n_src] * 2 * E + [n_dec] * 3 * L
    assert rows["linear_cross_entropy"] == [n_labels]
    seen = [(k.get("varlen", False), k.get("rows_q"), k.get("rows_k"), k["is_causal"]) for k in attention]
    assert seen == [(True, n_src, n_src, False)] * E + [(True, n_dec, n_dec, True), (True, n_dec, n_src, False)] * L


def test_a_hole_in_the_source_mask_keeps_the_encoder_padded(monkeypatch):
    """A row whose real tokens are not one run: packed, their distances would shrink, so the encoder
    runs padded (key padding mask, bias by the padded positions), exactly; the decoder still packs."""
    ref = H.build("t5").train()
    model = H.convert(copy.deepcopy(ref))
    batch = H.batch("t5", S=S)
    batch["attention_mask"][0, 3:5] = 0
    rows = H.spy_rows(monkeypatch, "feed_forward")
    _, attention = H.count_op_calls(monkeypatch)
    _step(model, ref, batch)
    E, L = H.layer_counts(model)
    assert rows["feed_forward"][:E] == [batch["attention_mask"].numel()] * E
    encoder = attention[:E]
    assert all(not k.get("varlen", False) and k["key_padding_mask"] is not None for k in encoder)
    assert all(k.get("varlen", False) for k in attention[E:])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("model_type", ["t5", "umt5"])
def test_relative_bias_gradient_is_deterministic(model_type, backend):
    """Two training steps from the same state and seed, dropout 0.1 everywhere: every gradient, the
    relative bias tables' first, is the same bits."""
    backend = H.t5_backend(backend)
    model = H.convert(H.build(model_type, dropout_rate=0.1).train(), backend)
    batch = H.batch(model_type, S=S)
    runs = []
    for _ in range(2):
        model.zero_grad()
        torch.manual_seed(7)
        with fastformer.use_backend(backend):
            model(**batch).loss.backward()
        runs.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    tables = [n for n in runs[0] if "relative_attention_bias" in n]
    assert tables and all(runs[0][n].abs().sum() > 0 for n in tables)
    for name in tables + sorted(runs[0]):
        assert torch.equal(runs[0][name], runs[1][name]), name


@pytest.mark.parametrize("tie", [True, False], ids=["tied-scaled", "untied-unscaled"])
def test_head_scaling_follows_the_config(tie):
    """T5 scales the decoder output by d_model ** -0.5 before the head when its config was made with
    tied embeddings (``scale_decoder_outputs``); the fused loss does the same, and not otherwise."""
    ref = H.build("t5", tie_word_embeddings=tie).train()
    assert ref.config.scale_decoder_outputs is tie
    _step(H.convert(copy.deepcopy(ref)), ref, H.batch("t5", S=S))


def test_untie_lm_head_gives_v1_1_its_own_head_at_fan_in_scale():
    """transformers 5 ties a config-built T5's head even with tie_word_embeddings=False; untie_lm_head
    makes it a Parameter of its own, drawn N(0, 1/d_model), that training moves apart from the
    embedding, and converted and plain copies still agree on a step."""
    from fastformer.hf.t5 import untie_lm_head

    torch.manual_seed(0)
    ref = H.build("t5", tie_word_embeddings=False).train()
    assert ref.lm_head.weight is ref.shared.weight  # the transformers behaviour this works around
    untie_lm_head(ref)
    head, shared = ref.lm_head.weight, ref.shared.weight
    assert head is not shared and "lm_head.weight" not in ref.all_tied_weights_keys
    d = ref.config.d_model
    assert abs(head.std().item() * d ** 0.5 - 1.0) < 0.1, head.std().item()
    assert head in set(ref.parameters()) and shared in set(ref.parameters())
    _step(H.convert(copy.deepcopy(ref)), ref, H.batch("t5", S=S))


def test_blocks_and_attention_are_fused_where_expected():
    """Every block and attention module becomes its fused subclass (same class name, same object); the
    LM class and the stacks' dropout too; norms, embeddings and the head stay transformers' modules."""
    model = H.build("t5")
    before = {n: type(m) for n, m in model.named_modules()}
    H.convert(model)
    for name, m in model.named_modules():
        changed = type(m) is not before[name]
        fused = name in ("", "encoder.dropout", "decoder.dropout") or before[name].__name__ in ("T5Block",
                                                                                                 "T5Attention")
        assert changed == fused, name
        if changed:
            assert type(m).__name__ == before[name].__name__ and isinstance(m, before[name])


def test_dense_position_bias_through_the_attention_implementation():
    """register() alone: an unconverted T5 with attn_implementation="fastformer" hands the interface
    transformers' dense position_bias, which it adds with the mask: SDPA's loss and gradients."""
    fastformer.hf.register()
    ref = H.build("t5").train()
    model = copy.deepcopy(ref)
    model.set_attn_implementation("fastformer")
    batch = H.batch("t5", S=S)
    _step(model, ref, batch)


def test_half_precision_model_with_fp32_wo_keeps_transformers_casts():
    """A bf16 model whose ``wo`` stays fp32 (``_keep_in_fp32_modules``, as from_pretrained loads
    Flan-T5): the feed-forward and the norms after it (an fp32 residual) run as transformers runs them;
    the converted model's logits are the unconverted one's to bf16 rounding."""
    ref = H.build("t5").to(torch.bfloat16)
    for m in ref.modules():
        if hasattr(m, "wo"):
            m.wo.float()
    model = H.convert(copy.deepcopy(ref))
    batch = H.batch("t5", S=S)
    with torch.no_grad():
        got, want = model(**batch).logits, ref(**batch).logits
    assert got.dtype == want.dtype
    assert (got.float() - want.float()).abs().max() < 0.05 * want.float().abs().max()


def test_copies_and_pickles_stay_fused(monkeypatch):
    """deepcopy and torch.save / torch.load keep the fused blocks (and what they were told at convert():
    the activation, the norm class) and give the same loss."""
    model = H.convert(H.build("umt5")).train()
    batch = H.batch("umt5", S=S)
    want = model(**batch).loss
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    for c in (copy.deepcopy(model), torch.load(buf, weights_only=False)):
        calls, _ = H.count_op_calls(monkeypatch)
        assert type(c.decoder.block[1]) is type(model.decoder.block[1])
        assert torch.equal(c(**batch).loss, want)
        assert dict(calls) == {k: v for k, v in H.expected_calls(c, loss=True).items() if v}


@pytest.mark.parametrize("backend", BACKENDS)
def test_block_end_dropout_is_fastformers_and_exact(backend, monkeypatch):
    """A block's last residual add, ``residual + dropout(out)`` (its norm is the next block's), runs
    fastformer's dropout in training: each element of ``h - residual`` is 0 or ``out / (1 - p)``, about
    ``p`` of them 0, the gradients are the mask's, and the norm weight it borrows gets none; torch's
    dropout is not called. In eval it is the plain sum."""
    from fastformer.hf import t5

    backend = H.t5_backend(backend)
    model = H.convert(H.build("t5", dropout_rate=0.25).train(), backend)
    block = model.encoder.block[0]
    ff_layer = block.layer[-1]
    monkeypatch.setattr(torch.nn.functional, "dropout", lambda *a, **k: pytest.fail("torch's dropout ran"))
    out = torch.full((64, 32, block.layer[0].layer_norm.weight.numel()), 2.0, requires_grad=True)
    residual = torch.randn(out.shape, requires_grad=True)
    with fastformer.use_backend(backend):
        h = t5._add(block, ff_layer, out, residual)
    kept = (h - residual).detach()
    assert torch.all((kept == 0) | torch.isclose(kept, torch.tensor(2.0 / 0.75)))
    assert abs(float((kept == 0).float().mean()) - 0.25) < 0.02
    h.backward(torch.ones_like(h))
    assert torch.equal(out.grad, (kept != 0).float() / 0.75)
    assert torch.equal(residual.grad, torch.ones_like(residual))
    assert ff_layer.layer_norm.weight.grad is None
    monkeypatch.undo()
    model.eval()
    with fastformer.use_backend(backend):
        assert torch.equal(t5._add(block, ff_layer, out, residual), residual + out)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("model_type", ["t5", "umt5"])
def test_no_torch_dropout_in_a_converted_training_step(model_type, backend, monkeypatch):
    """With dropout 0.25 everywhere, a converted model's training step calls no torch dropout: the
    stacks' dropout (of the embeddings, after the final norm) is fastformer's, each element 0 or
    ``x / (1 - p)``, about ``p`` of them 0, its gradient the mask's; in eval it is the identity."""
    backend = H.t5_backend(backend)
    model = H.convert(H.build(model_type, dropout_rate=0.25).train(), backend)
    batch = H.batch(model_type, S=S)
    monkeypatch.setattr(torch.nn.functional, "dropout", lambda *a, **k: pytest.fail("torch's dropout ran"))
    with fastformer.use_backend(backend):
        model(**batch).loss.backward()
        x = torch.full((64, 32, model.config.d_model), 3.0, requires_grad=True)
        y = model.encoder.dropout(x)
    assert type(model.encoder.dropout).__name__ == "Dropout"
    assert torch.all((y == 0) | torch.isclose(y, torch.tensor(3.0 / 0.75)))
    assert abs(float((y == 0).float().mean()) - 0.25) < 0.02
    y.backward(torch.ones_like(y))
    assert torch.equal(x.grad, (y != 0).float() / 0.75)
    monkeypatch.undo()
    model.eval()
    assert torch.equal(model.decoder.dropout(x), x)
