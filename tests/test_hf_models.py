"""fastformer.convert on Hugging Face seq2seq models (BART, Marian, mBART, M2M100, Whisper): with
dropout 0 the converted model gives the unconverted one's loss, logits and every parameter gradient,
on each backend, and the fused ops (attention, add_layer_norm, feed_forward, linear_cross_entropy)
are what ran."""
import copy

import pytest

pytest.importorskip("transformers", reason="the Hugging Face integration tests need transformers")

import torch  # noqa: E402

import fastformer  # noqa: E402
import hf_models as H  # noqa: E402
from utils import ALL_OPS, assert_close, device_for, kernel_backends, skip_without_kernels  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread_module")  # tiny shapes

# the cuda backend where there is a GPU (on the CPU its SIMT harness is far too slow for whole models)
BACKENDS = [pytest.param("reference", id="reference")] + kernel_backends(
    "cpu", "triton", *(("cuda",) if torch.cuda.is_available() else ()))
TOL = {"reference": (1e-5, 1e-4), "cpu": (2e-5, 1e-4), "triton": (5e-5, 1e-3)}
GPU_TOL = (2e-4, 5e-3)  # triton and cuda on a GPU (other reduction orders than torch's cuBLAS)


def _layers(backend):
    # Triton runs in its interpreter without a GPU (seconds per layer): one layer each side there
    return dict(encoder_layers=1, decoder_layers=1) if backend == "triton" and not torch.cuda.is_available() else {}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("model_type", H.MODEL_TYPES)
def test_lm_loss_logits_and_grads_match(model_type, backend, monkeypatch):
    device = device_for(backend)
    ref = H.build(model_type, **_layers(backend)).train().to(device)
    model = copy.deepcopy(ref)
    assert H.convert(model, backend) is model
    fused = H.ffn_fusable(model_type, backend, device)
    calls, _ = H.count_op_calls(monkeypatch)
    batch = H.batch(model_type, device=device)
    atol, rtol = GPU_TOL if device == "cuda" else TOL[backend]

    # training with labels: the fused loss, logits never materialised
    with fastformer.use_backend(backend):
        out = model(**batch)
        out.loss.backward()
    want = ref(**batch)
    want.loss.backward()
    assert out.logits is None
    assert_close("loss", out.loss, want.loss, atol, rtol)
    assert dict(calls) == {k: v for k, v in H.expected_calls(model, fused, loss=True).items() if v}
    got = H.assert_grads_match(model, ref, atol, rtol)
    assert len(got) == sum(p.requires_grad for p in ref.parameters())

    # evaluation: the model's own head, logits and loss as before
    H.assert_eval_matches(model, ref, batch, backend, atol, rtol)


@pytest.mark.parametrize("backend", [pytest.param("reference", id="reference")] + kernel_backends("cpu"))
@pytest.mark.parametrize("model_type", H.MODEL_TYPES)
def test_bare_model_outputs_and_grads_match(model_type, backend, monkeypatch):
    ref = H.build(model_type, bare=True).train()
    model = copy.deepcopy(ref)
    H.convert(model, backend)
    calls, _ = H.count_op_calls(monkeypatch)
    batch = H.batch(model_type)
    batch["decoder_input_ids"] = H._shift(H.build(model_type), batch.pop("labels"))
    atol, rtol = TOL[backend]
    g = torch.Generator().manual_seed(3)
    with fastformer.use_backend(backend):
        out = model(**batch)
    want = ref(**batch)
    # the encoder's padded positions are not computed (zero in the converted model): compared at real tokens
    real = batch["attention_mask"].bool() if "attention_mask" in batch else torch.ones(
        want.encoder_last_hidden_state.shape[:2], dtype=torch.bool)
    w_dec, w_enc = torch.randn(want.last_hidden_state.shape, generator=g), torch.randn(
        want.encoder_last_hidden_state.shape, generator=g) * real[..., None]
    for o in (out, want):
        ((o.last_hidden_state * w_dec).sum() + (o.encoder_last_hidden_state * w_enc).sum()).backward()
    assert_close("decoder output", out.last_hidden_state, want.last_hidden_state, atol, rtol)
    assert_close("encoder output", out.encoder_last_hidden_state[real], want.encoder_last_hidden_state[real],
                 atol, rtol)
    assert dict(calls) == {k: v for k, v in H.expected_calls(model, H.ffn_fusable(model_type, backend)).items() if v}
    H.assert_grads_match(model, ref, atol, rtol)


@pytest.mark.parametrize("model_type", ["bart", "mbart"])  # post-LN and pre-LN
def test_profiler_shows_the_cpu_kernels(model_type):
    """Under the cpu backend the profiler names fastformer's own kernels, forward and backward."""
    skip_without_kernels("cpu", *ALL_OPS)
    model = H.convert(H.build(model_type).train(), "cpu")
    with fastformer.use_backend("cpu"), torch.profiler.profile() as prof:
        model(**H.batch(model_type)).loss.backward()
    names = {e.name for e in prof.events()}
    E, L = model.config.encoder_layers, model.config.decoder_layers
    counts = {n: sum(e.name == n for e in prof.events()) for n in names if n.startswith("fastformer::")}
    # source padding and labels ending in -100: every attention runs on the packed rows
    assert counts["fastformer::attention_varlen_fwd"] == counts["fastformer::attention_varlen_bwd"] == E + 2 * L
    assert "fastformer::attention_fwd" not in counts
    assert counts["fastformer::feed_forward_fwd"] == counts["fastformer::feed_forward_bwd"] == E + L
    assert counts["fastformer::add_layer_norm_fwd"] == counts["fastformer::add_layer_norm_bwd"] == 2 * E + 3 * L
    assert counts["fastformer::linear_cross_entropy_fwd"] == 1  # its gradient is written in the same pass


@pytest.mark.parametrize("model_type", H.MODEL_TYPES)
def test_layers_and_head_are_fused_where_expected(model_type):
    """Every encoder/decoder layer becomes its fused subclass (same class name, same object); the LM
    class too, while embeddings, final norms and the head stay transformers' modules."""
    model = H.build(model_type)
    before = {n: type(m) for n, m in model.named_modules()}
    H.convert(model)
    fused = H.ffn_fusable(model_type)
    for name, m in model.named_modules():
        changed = type(m) is not before[name]
        is_layer = name.split(".")[-2:-1] == ["layers"]
        assert changed == (name == "" or (is_layer and fused)), name
        if changed:
            assert type(m).__name__ == before[name].__name__ and isinstance(m, before[name])
    assert model.config._attn_implementation == "fastformer"


class _Scaled(torch.nn.Linear):
    """Stands for a module swapped in after transformers built the model (a PEFT LoRA Linear, a
    quantised one): not a plain nn.Linear, so the fused ops must call it rather than read its weight."""

    def forward(self, x):
        return super().forward(x) * 1.5


def _swap(model):
    layer = model.model.encoder.layers[0]
    fc1 = _Scaled(layer.fc1.in_features, layer.fc1.out_features)
    fc1.load_state_dict(layer.fc1.state_dict())
    layer.fc1 = fc1
    old = model.get_output_embeddings()
    head = _Scaled(old.in_features, old.out_features, bias=False)
    head.load_state_dict(old.state_dict())
    model.set_output_embeddings(head)
    model.model.decoder.layers[0].final_layer_norm.register_forward_hook(lambda m, i, o: o * 0.5)


def test_swapped_or_hooked_submodules_are_called(monkeypatch):
    """A swapped fc1 or lm_head and a hooked LayerNorm run as transformers would run them; the rest
    stays fused."""
    ref = H.build("whisper").train()
    model = H.convert(copy.deepcopy(ref))
    _swap(ref), _swap(model)
    calls, _ = H.count_op_calls(monkeypatch)
    batch = H.batch("whisper")
    got = model(**batch)
    got.loss.backward()
    want = ref(**batch)
    want.loss.backward()
    assert_close("loss", got.loss, want.loss, 2e-5, 1e-4)
    assert_close("logits", got.logits, want.logits, 2e-5, 1e-4)  # the head ran: logits materialised
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if q.requires_grad:
            assert_close(f"grad {name}", p.grad, q.grad, 2e-5, 1e-4)
    full = H.expected_calls(model, loss=True)
    assert dict(calls) == {"attention": full["attention"], "add_layer_norm": full["add_layer_norm"] - 1,
                           "feed_forward": full["feed_forward"] - 1}


@pytest.mark.parametrize("model_type", ["bart", "mbart"])  # post-LN and pre-LN
def test_padding_is_skipped_by_every_layer_op_and_the_loss(model_type, monkeypatch):
    """The encoder's ops, attention included, take the real source tokens only, the decoder's the target
    positions up to each row's last label that is not -100, the fused loss those labels; cross-attention
    runs from the decoder's packed rows to the encoder's."""
    model = H.convert(H.build(model_type).train())
    batch = H.batch(model_type)
    rows = H.spy_rows(monkeypatch, "add_layer_norm", "feed_forward", "linear_cross_entropy")
    calls, attention = H.count_op_calls(monkeypatch)
    model(**batch).loss.backward()
    n_src, n_tgt = int(batch["attention_mask"].sum()), batch["labels"].numel()
    n_labels = int(batch["labels"].ne(-100).sum())
    n_dec = H.rows_up_to_last_label(batch["labels"])
    assert n_src < batch["attention_mask"].numel() and n_dec < n_tgt  # the batch has padding to skip
    E, L = model.config.encoder_layers, model.config.decoder_layers
    assert rows["feed_forward"] == [n_src] * E + [n_dec] * L
    assert rows["add_layer_norm"] == [n_src] * 2 * E + [n_dec] * 3 * L
    assert rows["linear_cross_entropy"] == [n_labels]
    seen = [(k.get("varlen", False), k.get("rows_q"), k.get("rows_k"), k["is_causal"]) for k in attention]
    assert seen == [(True, n_src, n_src, False)] * E + [(True, n_dec, n_dec, True), (True, n_dec, n_src, False)] * L


@pytest.mark.parametrize("model_type", H.MODEL_TYPES)
def test_decoder_skips_only_the_positions_after_the_last_label(model_type, monkeypatch):
    """Labels ignored inside a row (a prompt) are still decoder inputs, a row of ignored labels only is
    skipped whole; loss and gradients stay the unconverted model's. A decoder_attention_mask of the
    caller's is its semantics: every position computed, as transformers computes it."""
    ref = H.build(model_type).train()
    model = H.convert(copy.deepcopy(ref))
    batch = H.batch(model_type, B=4)
    labels = batch["labels"]  # (4, 5): row 0 ends in two -100
    labels[1, :2] = -100  # ignored at the start only: nothing after its last label to skip
    labels[2, :] = -100  # a row with no label at all
    labels[3, 1] = labels[3, 3:] = -100  # inside and at the end
    if model_type == "mbart":  # its shift_tokens_right fails on a row without labels: inputs of its own
        batch["decoder_input_ids"] = torch.randint(4, H.VOCAB, labels.shape, generator=torch.Generator().manual_seed(1))
    rows = H.spy_rows(monkeypatch, "feed_forward")
    _, attention = H.count_op_calls(monkeypatch)
    got, want = model(**batch).loss, ref(**batch).loss
    got.backward(), want.backward()
    n_dec = H.rows_up_to_last_label(labels)
    assert n_dec == 3 + 5 + 0 + 3
    L = model.config.decoder_layers
    assert rows["feed_forward"][-L:] == [n_dec] * L
    # the decoder's self- and cross-attention on its packed rows (M2M100 and Whisper included: no KV cache)
    assert [(k.get("varlen", False), k.get("rows_q")) for k in attention[-2 * L:]] == [(True, n_dec)] * 2 * L
    assert_close("loss", got, want, 2e-5, 1e-4)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if q.requires_grad:
            assert_close(f"grad {name}", p.grad, q.grad, 2e-5, 1e-4)

    # the caller's decoder mask (padding at the end of row 0 only, as a tokenizer gives it)
    dec_mask = torch.ones_like(labels)
    dec_mask[0, 3:] = 0
    rows["feed_forward"].clear()
    got = model(**batch, decoder_attention_mask=dec_mask, output_hidden_states=True)
    want = ref(**batch, decoder_attention_mask=dec_mask, output_hidden_states=True)
    assert_close("loss", got.loss, want.loss, 2e-5, 1e-4)
    assert rows["feed_forward"][-L:] == [labels.numel()] * L
    assert_close("decoder hidden states", got.decoder_hidden_states[-1], want.decoder_hidden_states[-1], 2e-5, 1e-4)

    # use_cache=True: where the model keeps it (BART, Marian and mBART drop it given labels), the cache
    # is transformers' own, every position computed as it computes them
    rows["feed_forward"].clear(), attention.clear()
    with torch.no_grad():
        got, want = model(**batch, use_cache=True), ref(**batch, use_cache=True)
    assert_close("loss", got.loss, want.loss, 2e-5, 1e-4)
    cached = model_type in ("m2m_100", "whisper")
    assert rows["feed_forward"][-L:] == [labels.numel() if cached else n_dec] * L
    assert all(k.get("varlen", False) != cached for k in attention[-2 * L:])
    if cached:
        for layer in range(L):
            assert_close(f"cached keys {layer}", got.past_key_values.self_attention_cache.layers[layer].keys,
                         want.past_key_values.self_attention_cache.layers[layer].keys, 2e-5, 1e-4)
