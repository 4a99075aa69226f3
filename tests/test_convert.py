"""fastformer.convert: every torch Transformer module at any depth becomes its twin, sharing the
parameter objects, keeping modes, hooks and state_dict keys, with the same outputs and gradients."""
import pytest
import torch

import fastformer
from fastformer import nn as fnn
from utils import assert_close

pytestmark = [pytest.mark.filterwarnings("ignore:Support for mismatched:UserWarning"),
              pytest.mark.filterwarnings("ignore:enable_nested_tensor is True:UserWarning"),
              pytest.mark.usefixtures("one_thread_module")]  # tiny shapes

BACKENDS = ["reference", "auto"]
TOL = {"reference": {"out": (2e-5, 1e-4), "grad": (5e-5, 1e-4)},
       "auto": {"out": (5e-5, 1e-4), "grad": (2e-4, 1e-3)}}
TWINNED = {torch.nn.MultiheadAttention: fnn.MultiheadAttention, torch.nn.LayerNorm: fnn.LayerNorm,
           torch.nn.RMSNorm: fnn.RMSNorm,
           torch.nn.TransformerEncoderLayer: fnn.TransformerEncoderLayer,
           torch.nn.TransformerDecoderLayer: fnn.TransformerDecoderLayer,
           torch.nn.TransformerEncoder: fnn.TransformerEncoder, torch.nn.TransformerDecoder: fnn.TransformerDecoder,
           torch.nn.Transformer: fnn.Transformer}
D, NHEAD, FF, VOCAB = 32, 4, 64, 17


class Translator(torch.nn.Module):
    """A user model: embeddings, a torch.nn.Transformer, extra layers and containers around it."""

    def __init__(self, norm_first=False):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, D)
        self.core = torch.nn.Transformer(D, NHEAD, 2, 2, FF, dropout=0.0, batch_first=True, norm_first=norm_first,
                                         activation="gelu")
        self.extra = torch.nn.ModuleDict({
            "attn": torch.nn.MultiheadAttention(D, NHEAD, batch_first=True),
            "post": torch.nn.Sequential(torch.nn.LayerNorm(D), torch.nn.Linear(D, D)),
        })
        self.head = torch.nn.Linear(D, VOCAB)
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():  # move zero biases / unit norms / cloned layers off their initial values
            for p in self.parameters():
                p.add_(0.1 * torch.randn(p.shape, generator=g))

    def forward(self, src, tgt):
        s, t = self.embed(src), self.embed(tgt)
        kpm = src == 0
        causal = torch.nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
        h = self.core(s, t, tgt_mask=causal, src_key_padding_mask=kpm, memory_key_padding_mask=kpm)
        h = h + self.extra["attn"](h, s, s, key_padding_mask=kpm, need_weights=False)[0]
        return self.head(self.extra["post"](h))


def _tokens():
    g = torch.Generator().manual_seed(7)
    src = torch.randint(1, VOCAB, (3, 9), generator=g)
    src[1, 6:] = 0
    src[2, 2:] = 0
    return src, torch.randint(1, VOCAB, (3, 6), generator=g)


def _outputs_and_grads(model, backend="reference"):
    src, tgt = _tokens()
    model.zero_grad(set_to_none=True)
    with fastformer.use_backend(backend):
        out = model(src, tgt)
        out.pow(2).mean().backward()
    return out.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def _assert_converted(model):
    for name, m in model.named_modules():
        assert type(m) not in TWINNED, f"{name} is still a plain torch {type(m).__name__}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("norm_first", [False, True], ids=["post_ln", "pre_ln"])
def test_convert_same_outputs_and_gradients(backend, norm_first):
    torch.manual_seed(0)
    model = Translator(norm_first)
    want_out, want_grads = _outputs_and_grads(model)
    converted = fastformer.convert(model)
    _assert_converted(converted)
    got_out, got_grads = _outputs_and_grads(converted, backend)
    assert_close("logits", got_out, want_out, *TOL[backend]["out"])
    assert set(got_grads) == set(want_grads)
    for name in want_grads:
        assert_close(f"grad {name}", got_grads[name], want_grads[name], *TOL[backend]["grad"])


def test_convert_copy_leaves_the_original_alone():
    torch.manual_seed(0)
    model = Translator()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    converted = fastformer.convert(model, copy=True)
    assert type(model.core) is torch.nn.Transformer
    assert type(model.core.encoder.layers[0].self_attn) is torch.nn.MultiheadAttention
    assert type(model.extra["post"][0]) is torch.nn.LayerNorm
    assert type(converted.core) is fnn.Transformer
    _assert_converted(converted)
    originals = {id(p) for p in model.parameters()}
    assert not originals & {id(p) for p in converted.parameters()}, "a copy must not share parameters"
    assert list(model.state_dict()) == list(converted.state_dict())
    for name, p in converted.named_parameters():
        assert torch.equal(p, before[name])
    with torch.no_grad():
        converted.head.weight.add_(1.0)
    assert torch.equal(model.head.weight, before["head.weight"])


@pytest.mark.parametrize("activation", [torch.nn.GELU(), torch.nn.SiLU()], ids=["GELU", "SiLU"])
def test_convert_copy_keeps_a_module_activation(activation):
    """copy.deepcopy of a torch decoder layer whose activation is a module computes relu (torch's
    __setstate__ shadows the module with F.relu); convert(copy=True) must not inherit that."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.TransformerDecoderLayer(D, NHEAD, FF, dropout=0.0, activation=activation,
                                                                 batch_first=True))
    x, memory = torch.randn(2, 5, D), torch.randn(2, 3, D)
    with torch.no_grad():
        want = model[0](x, memory)
        got = fastformer.convert(model, copy=True)[0](x, memory)
    assert_close("output", got, want, *TOL["auto"]["out"])


@pytest.mark.parametrize("activation", [torch.nn.GELU(), torch.nn.SiLU()], ids=["GELU", "SiLU"])
def test_deepcopy_and_pickle_of_a_converted_layer_keep_a_module_activation(activation):
    """The same torch shadow on the twins: a copied or reloaded converted layer must not compute relu."""
    import copy
    import io

    torch.manual_seed(0)
    model = fastformer.convert(torch.nn.Sequential(torch.nn.TransformerDecoderLayer(
        D, NHEAD, FF, dropout=0.0, activation=activation, batch_first=True)))
    x, memory = torch.randn(2, 5, D), torch.randn(2, 3, D)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    with torch.no_grad():
        want = model[0](x, memory)
        for name, other in (("deepcopy", copy.deepcopy(model)), ("pickle", torch.load(buffer, weights_only=False))):
            assert type(other[0]) is fnn.TransformerDecoderLayer
            assert_close(name, other[0](x, memory), want, *TOL["auto"]["out"])


def test_convert_shares_every_parameter_and_buffer_object():
    torch.manual_seed(0)
    model = Translator()
    # buffers at the root, inside a twinned layer and (non-persistent) inside a twinned attention
    model.register_buffer("scale", torch.full((D,), 2.0))
    model.core.encoder.layers[0].register_buffer("step", torch.zeros((), dtype=torch.long))
    model.extra["attn"].register_buffer("scratch", torch.ones(3), persistent=False)
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    keys = list(model.state_dict())
    result = fastformer.convert(model)
    assert result is model, "converting a model whose root has no twin returns the model itself"
    _assert_converted(model)
    assert type(model.core.decoder.layers[1].multihead_attn) is fnn.MultiheadAttention
    assert type(model.extra["post"][0]) is fnn.LayerNorm
    assert list(model.state_dict()) == keys
    assert "extra.attn.scratch" not in keys
    got_params, got_buffers = dict(result.named_parameters()), dict(result.named_buffers())
    assert set(got_params) == set(params) and set(got_buffers) == set(buffers) == {
        "scale", "core.encoder.layers.0.step", "extra.attn.scratch"}
    for name, p in got_params.items():
        assert p is params[name], f"parameter {name} is a new object, not the original"
    for name, b in got_buffers.items():
        assert b is buffers[name], f"buffer {name} is a new object, not the original"


def _train(model, opt, steps, backend):
    """``steps`` optimizer steps on the fixed batch; the losses."""
    src, tgt = _tokens()
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        with fastformer.use_backend(backend):
            loss = model(src, tgt).pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("optimizer", [torch.optim.Adam, torch.optim.SGD], ids=["adam", "sgd"])
def test_convert_after_the_optimizer_trains_the_converted_model(optimizer):
    """The user's order: optimizer first, then convert. The step must move the converted
    model's parameters (before: it moved the orphaned originals, the copy never trained)."""
    torch.manual_seed(0)
    model = Translator()
    opt = optimizer(model.parameters(), lr=0.01)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    model = fastformer.convert(model)
    _assert_converted(model)
    held = {id(p) for group in opt.param_groups for p in group["params"]}
    assert held == {id(p) for p in model.parameters()}
    _train(model, opt, 1, "auto")
    for name, p in model.named_parameters():
        assert not torch.equal(p, before[name]), f"{name} did not change: the optimizer trains another tensor"


# (atol, rtol) of losses and parameters after 3 SGD-with-momentum steps of lr 0.1: the error is
# about lr * (1 + 1.9 + 2.71) times the twins' gradient error (measured here: 1.2e-7 on both)
TRAIN_TOL = {"reference": (1e-5, 1e-4), "auto": (5e-5, 1e-4)}


@pytest.mark.parametrize("backend", BACKENDS)
def test_convert_after_the_optimizer_trains_like_plain_torch(backend):
    """Same weights, same data, dropout 0: training the converted model (optimizer made before
    convert) gives the losses and parameters of the plain torch model trained the same way."""
    torch.manual_seed(0)
    plain = Translator()
    model = Translator()
    model.load_state_dict(plain.state_dict())
    want_losses = _train(plain, torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9), 3, "reference")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model = fastformer.convert(model)
    got_losses = _train(model, opt, 3, backend)
    assert_close("losses", torch.tensor(got_losses), torch.tensor(want_losses), *TRAIN_TOL[backend])
    assert want_losses[-1] < want_losses[0], "the comparison needs a run that trains"
    want = dict(plain.named_parameters())
    for name, p in model.named_parameters():
        assert_close(f"trained {name}", p.detach(), want[name].detach(), *TRAIN_TOL[backend])


@pytest.mark.parametrize("copy", [False, True], ids=["shared", "copy"])
def test_convert_root_module_and_modes(copy):
    torch.manual_seed(0)
    core = torch.nn.Transformer(D, NHEAD, 1, 1, FF, dropout=0.2, batch_first=True)
    core.train()
    core.decoder.eval()  # mixed modes must survive
    params = list(core.parameters())
    twin = fastformer.convert(core, copy=copy)
    assert type(twin) is fnn.Transformer
    assert twin.training and twin.encoder.training and not twin.decoder.training
    assert not twin.decoder.layers[0].self_attn.training
    same = [a is b for a, b in zip(params, twin.parameters())]
    assert not any(same) if copy else all(same)
    if not copy:  # the root cannot change class: a new twin, the torch module keeps its children
        assert type(core) is torch.nn.Transformer and type(core.encoder) is torch.nn.TransformerEncoder


@pytest.mark.parametrize("copy", [False, True], ids=["shared", "copy"])
def test_convert_keeps_hooks_and_tied_weights(copy):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, D),
                                torch.nn.TransformerEncoderLayer(D, NHEAD, FF, dropout=0.0, batch_first=True),
                                torch.nn.Linear(D, VOCAB, bias=False))
    model[2].weight = model[0].weight
    seen = []
    handle = model[1].self_attn.register_forward_hook(lambda m, args, out: seen.append(type(m)))
    twin = fastformer.convert(model, copy=copy)
    assert twin[2].weight is twin[0].weight, "tied weights must stay tied"
    tokens = torch.randint(0, VOCAB, (2, 5))
    twin(tokens)
    assert seen == [fnn.MultiheadAttention]
    if not copy:  # the handle the user holds still removes the hook from the twin
        handle.remove()
        twin(tokens)
        assert seen == [fnn.MultiheadAttention]


def test_convert_subclasses_are_left_but_their_children_converted():
    class MyLayer(torch.nn.TransformerEncoderLayer):
        pass
    torch.manual_seed(0)
    model = torch.nn.Sequential(MyLayer(D, NHEAD, FF, batch_first=True))
    twin = fastformer.convert(model)
    assert type(twin[0]) is MyLayer
    assert type(twin[0].self_attn) is fnn.MultiheadAttention and type(twin[0].norm1) is fnn.LayerNorm


def test_convert_rejects_an_unsupported_activation():
    model = torch.nn.Sequential(torch.nn.TransformerEncoderLayer(D, NHEAD, FF, activation=torch.tanh))
    with pytest.raises(ValueError, match="relu.*gelu"):
        fastformer.convert(model)
    with pytest.raises(TypeError, match="model"):
        fastformer.convert("not a module")


def test_convert_rejects_the_removed_inplace_and_bad_arguments():
    model = torch.nn.Sequential(torch.nn.LayerNorm(D))
    for inplace in (False, True):
        with pytest.raises(TypeError, match="inplace.*removed.*copy=True"):
            fastformer.convert(model, inplace=inplace)
    with pytest.raises(TypeError, match="positional"):
        fastformer.convert(model, True)  # the old positional inplace must not silently mean copy
    with pytest.raises(TypeError, match="copy must be a bool, got str"):
        fastformer.convert(model, copy="yes")
    with pytest.raises(TypeError, match="unexpected keyword.*deep"):
        fastformer.convert(model, deep=True)
    assert type(model[0]) is torch.nn.LayerNorm, "a rejected call must not have converted anything"
