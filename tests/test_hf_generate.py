"""generate() of a converted Hugging Face seq2seq model, greedy and beam search with transformers' KV
cache, gives the unconverted model's tokens and scores, and its cached decoding steps (one query
against the growing cache) run fastformer's attention."""
import collections
import copy

import pytest

pytest.importorskip("transformers", reason="the Hugging Face integration tests need transformers")

import torch  # noqa: E402

import fastformer  # noqa: E402
import hf_models as H  # noqa: E402
from utils import kernel_backends  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread_module")  # tiny shapes



@pytest.mark.parametrize("backend", [pytest.param("reference", id="reference")] + kernel_backends("cpu"))
@pytest.mark.parametrize("num_beams", [1, 3], ids=["greedy", "beam3"])
@pytest.mark.parametrize("model_type", H.MODEL_TYPES)
def test_generate_gives_the_same_tokens(model_type, num_beams, backend, monkeypatch):
    ref = H.build(model_type, seed=4)
    model = H.convert(copy.deepcopy(ref), backend)
    batch = H.batch(model_type, seed=5)
    batch.pop("labels")
    calls, attention = H.count_op_calls(monkeypatch)
    with torch.no_grad(), fastformer.use_backend(backend):
        got = H.generate(model, batch, num_beams=num_beams)
    with torch.no_grad():
        want = H.generate(ref, batch, num_beams=num_beams)
    H.assert_same_generation(got, want, num_beams)

    # cached decoding: the encoder runs once; then each of the new tokens' decoder steps runs, per layer, one
    # self-attention call of one query against the cache (one key more each step, no mask) and one
    # cross-attention call against the encoder output (its padding as key_padding_mask)
    E, L = model.config.encoder_layers, model.config.decoder_layers
    S = H.SRC_POS if model_type == "whisper" else batch["input_ids"].shape[1]
    assert S > H.NEW_TOKENS
    seen = collections.Counter((k["Sq"], k["Sk"], k["is_causal"], k.get("key_padding_mask") is not None,
                                k.get("varlen", False)) for k in attention)
    padded = model_type != "whisper"  # Whisper's encoder has no padding mask
    # the encoder on its packed rows where the source is padded; decoding in the padded layout
    want_calls = {(S, S, False, False, padded): E, (1, S, False, padded, False): H.NEW_TOKENS * L}
    want_calls.update({(1, step, False, False, False): L for step in range(1, H.NEW_TOKENS + 1)})
    assert dict(seen) == want_calls
    assert all(k.get("attn_mask") is None for k in attention), "a mask was materialised"
    fused = H.ffn_fusable(model_type, backend)
    assert calls["feed_forward"] == ((E + H.NEW_TOKENS * L) if fused else 0)


@pytest.mark.parametrize("kwargs", [dict(cache_implementation="static"), dict(use_cache=False),
                                    dict(num_beams=2, num_return_sequences=2)],
                         ids=["static-cache", "no-cache", "beam2-return2"])
@pytest.mark.parametrize("model_type", ["bart", "whisper"])
def test_generate_other_cache_settings(model_type, kwargs):
    """A static cache (its masks reach the kernel as attn_mask: tensor offsets), no cache (the whole
    prefix each step, is_causal) and several returned beams give the unconverted model's tokens."""
    ref = H.build(model_type, seed=4)
    model = H.convert(copy.deepcopy(ref))
    batch = H.batch(model_type, seed=5)
    batch.pop("labels")
    new = H.NEW_TOKENS
    with torch.no_grad():
        got = model.generate(**batch, max_new_tokens=new, min_new_tokens=new, do_sample=False, **kwargs)
        want = ref.generate(**batch, max_new_tokens=new, min_new_tokens=new, do_sample=False, **kwargs)
    assert torch.equal(got, want)
