"""A converted Hugging Face model under torch.compile: one graph (``fullgraph=True``) for the training
loss, whose loss and gradients are the eager converted model's. With ``capture_dynamic_output_shape_ops``
the encoder layers skip the source padding, the decoder layers the target positions after each row's
last label and the fused loss the ignored label rows, as eagerly; without it (dynamo's default) they
compute the padding, since their row counts are data."""
import pytest

transformers = pytest.importorskip("transformers", reason="the Hugging Face integration tests need transformers")

import torch  # noqa: E402
from torch._dynamo.testing import CompileCounterWithBackend  # noqa: E402

import hf_models as H  # noqa: E402
from utils import assert_close  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread_module")  # tiny shapes


def loss_and_grads(model, fn, batch):
    loss = fn(**batch).loss
    return loss.detach(), torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad],
                                              allow_unused=True)


# the padded case is the same branches for every model: one post-LN and one pre-LN family; T5's blocks
# once (its encoder is padded under compile either way: whether each row's tokens are one run is data;
# UMT5's per-layer tables are the same branches, checked eagerly in test_hf_t5.py)
CASES = [(m, True) for m in H.MODEL_TYPES + ("t5",)] + [("bart", False), ("mbart", False)]


@pytest.mark.parametrize("model_type, capture", CASES, ids=[f"{m}-{'packed' if c else 'padded'}" for m, c in CASES])
def test_compiled_converted_model_is_one_graph_with_the_eager_loss_and_gradients(model_type, capture, monkeypatch):
    model = H.convert(H.build(model_type)).train()  # dropout 0: the comparison is exact up to rounding
    batch = H.batch(model_type)
    want_loss, want = loss_and_grads(model, model, batch)
    _, attention = H.count_op_calls(monkeypatch)  # counted as dynamo traces the ops
    counter = CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=capture):
        compiled = torch.compile(model, fullgraph=True, backend=counter)
        got_loss, got = loss_and_grads(model, compiled, batch)
    assert counter.frame_count == 1
    # the decoder's self- and cross-attention: on the rows up to each row's last label where sizes may be data
    labels = batch["labels"]
    assert not bool((labels[:, -1] != -100).all())  # some row ends in ignored labels: there is a tail to skip
    n_dec = H.rows_up_to_last_label(labels)
    L = H.layer_counts(model)[1]
    decoder = [(k.get("varlen", False), k.get("rows_q")) for k in attention[-2 * L:]]
    packs = capture and H.packs_when_traced(model)
    assert decoder == ([(True, n_dec)] if packs else [(False, None)]) * 2 * L
    assert_close("loss", got_loss, want_loss, 1e-6, 1e-5)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    for name, a, b in zip(names, got, want):
        assert (a is None) == (b is None), name
        if a is not None:
            assert_close(f"grad {name}", a, b, 1e-6, 1e-5)
