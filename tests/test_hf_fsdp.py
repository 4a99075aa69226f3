"""A converted T5 trained under FSDP2 (``fully_shard``; two CPU processes with gloo) runs the fused loss
on the LM head's full weight and gives the losses, gradients and updates of the same model unsharded
in one process on the whole batch (and of the unconverted model): every block sharded, the head
sharded with the root (a tied head, T5 v1.0-like), with the embeddings as one group (tied), or on its
own (an untied head, T5 v1.1-like), where the loss runs as the head's redirected forward."""

import pytest

pytest.importorskip("transformers", reason="the Hugging Face integration tests need transformers")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import hf_models as H  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available in this build")

SIZE = 2  # processes
STEPS = 3  # optimizer steps
LR = 0.5
# (name, model type, tied head, where the head is sharded)
ARRANGEMENTS = [
    ("tied-root", "t5_v1_0", True, "root"),
    ("tied-embeddings-group", "t5_v1_0", True, "group"),
    ("untied-root", "t5", False, "root"),
    ("untied-own-unit", "t5", False, "own"),
]


def _model(model_type, tied, convert):
    """The tiny T5 (v1.0: relu, tied head, decoder output scaled; v1.1: gated-gelu, no scaling) in
    training mode. transformers 5 always ties T5's head to the shared embedding, so the untied head
    is a parameter of its own here, moved off the embedding."""
    model = H.build(model_type, seed=3, **({} if tied else dict(tie_word_embeddings=False))).train()
    if not tied:
        g = torch.Generator().manual_seed(4)
        w = model.shared.weight.detach()
        # scaled as the tied head's input is (d_model ** -0.5), so the logits are O(1), not O(sqrt(d_model))
        model.lm_head.weight = torch.nn.Parameter(w * H.D ** -0.5 + 0.05 * torch.randn(w.shape, generator=g))
    assert (model.lm_head.weight is model.shared.weight) == tied
    return H.convert(model) if convert else model


def _batch():
    """4 rows; each half (one process's) has 8 labels that count, so the mean of the halves' mean
    losses is the whole batch's mean loss, and FSDP's averaged gradients are its gradients."""
    batch = H.batch("t5", B=4, S=7, T=5, seed=1)
    batch["labels"][2, 3:] = -100  # row 0's last two are -100 already
    assert [int(h.ne(-100).sum()) for h in batch["labels"].split(2)] == [8, 8]
    return batch


def _shard(model, where):
    from torch.distributed.fsdp import fully_shard

    for stack in (model.encoder, model.decoder):
        for block in stack.block:
            fully_shard(block)
    if where == "own":
        fully_shard(model.lm_head)
    elif where == "group":  # the tied weight's modules (transformers 5: embed_tokens are modules of their own)
        mods = {id(m): m for m in (model.shared, model.encoder.embed_tokens, model.decoder.embed_tokens,
                                   model.lm_head)}
        fully_shard(list(mods.values()))
    fully_shard(model)


def _train(model, batch, step_loss):
    """STEPS steps of SGD; the losses (by ``step_loss(output)``), the first step's gradients and the
    final parameters, as full tensors."""
    full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t  # noqa: E731
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads, logits = [], None, []
    for _ in range(STEPS):
        out = model(**batch)
        out.loss.backward()
        losses.append(step_loss(out.loss))
        logits.append(out.logits is None)
        if grads is None:
            grads = {n: full(p.grad).detach().clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    params = {n: full(p).detach().clone() for n, p in model.named_parameters()}
    return dict(losses=losses, grads=grads, params=params, logits_none=logits)


def _worker(rank, size, store_path, result_path):
    import fastformer
    from fastformer.hf import loss as hf_loss

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=size)
    batch = {k: v.chunk(size)[rank] for k, v in _batch().items()}
    lce = fastformer.ops.linear_cross_entropy
    results = {}
    for name, model_type, tied, where in ARRANGEMENTS:
        model = _model(model_type, tied, convert=True)
        seen = []  # the weight each fused loss call read: its type and shape

        def spy(hidden, weight, *args, **kwargs):
            seen.append((type(weight).__name__, tuple(weight.shape)))
            return lce(hidden, weight, *args, **kwargs)

        fastformer.ops.linear_cross_entropy = spy
        _shard(model, where)

        def mean_over_ranks(loss):
            total = loss.detach().clone()
            dist.all_reduce(total)
            return total.item() / size

        result = _train(model, batch, mean_over_ranks)
        result.update(seen=seen, head_class=type(model.lm_head).__name__)
        # without the redirection (the head judged not shardable, as before it) the loss is not fused
        hf_loss_fsdp_head, hf_loss._fsdp_head = hf_loss._fsdp_head, lambda head: False
        try:
            out = model(**batch)
            result["without_redirection"] = dict(logits_none=out.logits is None, fused_calls=len(seen) - STEPS)
            out.loss.backward()  # FSDP's hooks expect the backward of a forward
        finally:
            hf_loss._fsdp_head = hf_loss_fsdp_head
        fastformer.ops.linear_cross_entropy = lce
        results[name] = result
    if rank == 0:
        torch.save(results, result_path)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    path = tmp_path_factory.mktemp("fsdp")
    mp.spawn(_worker, args=(SIZE, str(path / "store"), str(path / "results.pt")), nprocs=SIZE)
    return torch.load(path / "results.pt")


@pytest.mark.parametrize("name,model_type,tied,where", ARRANGEMENTS, ids=[a[0] for a in ARRANGEMENTS])
def test_fsdp2_trains_with_the_fused_loss_as_one_unsharded_process(sharded, name, model_type, tied, where):
    got = sharded[name]
    # the fused loss ran every step, on the head's full (unsharded) weight, and no logits were made
    full_weight = ("Parameter", (H.VOCAB, H.D))
    assert got["seen"][:STEPS] == [full_weight] * STEPS
    assert got["logits_none"] == [True] * STEPS
    assert got["head_class"] == ("FSDPLinear" if where in ("own", "group") else "Linear")
    # the head an FSDP unit of its own (alone or in a group) is fused only by the redirection: without
    # it the model's own forward runs, logits and all
    assert got["without_redirection"] == (dict(logits_none=False, fused_calls=0) if got["head_class"] == "FSDPLinear"
                                          else dict(logits_none=True, fused_calls=1))

    batch = _batch()
    converted = _train(_model(model_type, tied, convert=True), batch, lambda loss: loss.item())
    plain = _train(_model(model_type, tied, convert=False), batch, lambda loss: loss.item())
    assert converted["logits_none"] == [True] * STEPS and plain["logits_none"] == [False] * STEPS
    # the unconverted model's own kernels round differently: over three steps, test_hf_t5_training's tolerance
    for want, tol in ((converted, dict(atol=1e-6, rtol=1e-5)), (plain, dict(atol=1e-5, rtol=1e-4))):
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]), **tol)
        assert got["grads"].keys() == want["grads"].keys() == want["params"].keys() == got["params"].keys()
        for key in ("grads", "params"):
            for n, t in want[key].items():
                torch.testing.assert_close(got[key][n], t, **tol, msg=lambda m: f"{key} {n}: {m}")
    assert len(set(converted["losses"])) == STEPS  # the steps moved the model
