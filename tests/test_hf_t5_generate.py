"""generate() of a converted T5-family model, greedy and beam search with transformers' KV cache, gives the
unconverted model's tokens and scores; each cached decoding step's self-attention gets the decoder's
relative bias table with the query's position past the cache (no dense bias); a static cache (a tensor
offset: transformers' dense bias, built for the one query) and no cache give the same tokens too."""
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
@pytest.mark.parametrize("model_type", H.T5_TYPES)
def test_generate_gives_the_same_tokens(model_type, num_beams, backend, monkeypatch):
    backend = H.t5_backend(backend)
    ref = H.build(model_type, seed=4)
    model = H.convert(copy.deepcopy(ref), backend)
    batch = H.batch(model_type, S=9, seed=5)
    batch.pop("labels")
    calls, attention = H.count_op_calls(monkeypatch)
    with torch.no_grad(), fastformer.use_backend(backend):
        got = H.generate(model, batch, num_beams=num_beams)
    with torch.no_grad():
        want = H.generate(ref, batch, num_beams=num_beams)
    H.assert_same_generation(got, want, num_beams)

    # the encoder once, on its packed rows; then per step and layer one self-attention call of one query
    # against the cache (the decoder's table, the query at position Sk - 1, unidirectional buckets) and
    # one cross-attention call (no bias, the source padding as key_padding_mask)
    E, L = H.layer_counts(model)
    S = batch["input_ids"].shape[1]
    seen = collections.Counter(
        (k["Sq"], k["Sk"], k["is_causal"], k.get("key_padding_mask") is not None, k.get("varlen", False),
         k.get("relative_attention_bias") is not None, k.get("bidirectional"), k.get("query_offset"))
        for k in attention)
    want_calls = {(S, S, False, False, True, True, True, None): E,
                  (1, S, False, True, False, False, None, None): H.NEW_TOKENS * L}
    want_calls.update({(1, step, False, False, False, True, False, step - 1): L for step in range(1, H.NEW_TOKENS + 1)})
    assert dict(seen) == want_calls
    assert all(k.get("attn_mask") is None for k in attention), "a mask or dense bias was materialised"
    assert calls["feed_forward"] == E + H.NEW_TOKENS * L


@pytest.mark.parametrize("kwargs", [dict(cache_implementation="static"), dict(use_cache=False),
                                    dict(num_beams=2, num_return_sequences=2)],
                         ids=["static-cache", "no-cache", "beam2-return2"])
@pytest.mark.parametrize("model_type", ["t5", "umt5"])
def test_generate_other_cache_settings(model_type, kwargs):
    ref = H.build(model_type, seed=4)
    model = H.convert(copy.deepcopy(ref))
    batch = H.batch(model_type, S=9, seed=5)
    batch.pop("labels")
    new = H.NEW_TOKENS
    with torch.no_grad():
        got = model.generate(**batch, max_new_tokens=new, min_new_tokens=new, do_sample=False, **kwargs)
        want = ref.generate(**batch, max_new_tokens=new, min_new_tokens=new, do_sample=False, **kwargs)
    assert torch.equal(got, want)
