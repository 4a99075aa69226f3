"""fastformer.convert: every torch Transformer module at any depth becomes its twin, sharing the
parameter objects, keeping modes, hooks and state_dict keys, with the same outputs and gradients."""
import pytest
import torch

import fastformer
from fastformer import nn as fnn
from utils import assert_close

pytestmark = [pytest.mark.filterwarnings("ignore:Support for mismatched:UserWarning"),
              pytest.mark.filterwarnings("ignore:enable_nested_tensor is True:UserWarning")]

BACKENDS = ["reference", "auto"]
TOL = {"reference": {"out": (2e-5, 1e-4), "grad": (5e-5, 1e-4)},
       "auto": {"out": (5e-5, 1e-4), "grad": (2e-4, 1e-3)}}
TWINNED = {torch.nn.MultiheadAttention: fnn.MultiheadAttention, torch.nn.LayerNorm: fnn.LayerNorm,
           torch.nn.TransformerEncoderLayer: fnn.TransformerEncoderLayer,
           torch.nn.TransformerDecoderLayer: fnn.TransformerDecoderLayer,
           torch.nn.TransformerEncoder: fnn.TransformerEncoder, torch.nn.TransformerDecoder: fnn.TransformerDecoder,
           torch.nn.Transformer: fnn.Transformer}
D, NHEAD, FF, VOCAB = 32, 4, 64, 17


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny shapes; one thread avoids OpenMP stalls on the shared 2-core machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


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
    converted = fastformer.convert(model)
    assert type(model.core) is torch.nn.Transformer
    assert type(model.core.encoder.layers[0].self_attn) is torch.nn.MultiheadAttention
    assert type(converted.core) is fnn.Transformer
    originals = {id(p) for p in model.parameters()}
    assert not originals & {id(p) for p in converted.parameters()}, "a copy must not share parameters"
    assert list(model.state_dict()) == list(converted.state_dict())
    for name, p in converted.named_parameters():
        assert torch.equal(p, before[name])
    with torch.no_grad():
        converted.head.weight.add_(1.0)
    assert torch.equal(model.head.weight, before["head.weight"])


def test_convert_inplace_shares_the_parameter_objects():
    torch.manual_seed(0)
    model = Translator()
    params = {name: p for name, p in model.named_parameters()}
    keys = list(model.state_dict())
    result = fastformer.convert(model, inplace=True)
    assert result is model, "inplace conversion of a non-twinned root returns the model itself"
    _assert_converted(model)
    assert type(model.core.decoder.layers[1].multihead_attn) is fnn.MultiheadAttention
    assert type(model.extra["post"][0]) is fnn.LayerNorm
    assert list(model.state_dict()) == keys
    for name, p in model.named_parameters():
        assert p is params[name], f"{name} is a new object, not the original parameter"


def test_converted_parameters_are_the_twins_parameters():
    """Training the converted model updates the very tensors an optimiser built before holds."""
    torch.manual_seed(0)
    model = Translator()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fastformer.convert(model, inplace=True)
    before = model.core.encoder.layers[0].self_attn.in_proj_weight.detach().clone()
    src, tgt = _tokens()
    model(src, tgt).pow(2).mean().backward()
    opt.step()
    assert not torch.equal(model.core.encoder.layers[0].self_attn.in_proj_weight, before)


@pytest.mark.parametrize("inplace", [False, True])
def test_convert_root_module_and_modes(inplace):
    torch.manual_seed(0)
    core = torch.nn.Transformer(D, NHEAD, 1, 1, FF, dropout=0.2, batch_first=True)
    core.train()
    core.decoder.eval()  # mixed modes must survive
    params = list(core.parameters())
    twin = fastformer.convert(core, inplace=inplace)
    assert type(twin) is fnn.Transformer
    assert twin.training and twin.encoder.training and not twin.decoder.training
    assert not twin.decoder.layers[0].self_attn.training
    same = [a is b for a, b in zip(params, twin.parameters())]
    assert all(same) if inplace else not any(same)


@pytest.mark.parametrize("inplace", [False, True])
def test_convert_keeps_hooks_and_tied_weights(inplace):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, D),
                                torch.nn.TransformerEncoderLayer(D, NHEAD, FF, dropout=0.0, batch_first=True),
                                torch.nn.Linear(D, VOCAB, bias=False))
    model[2].weight = model[0].weight
    seen = []
    handle = model[1].self_attn.register_forward_hook(lambda m, args, out: seen.append(type(m)))
    twin = fastformer.convert(model, inplace=inplace)
    assert twin[2].weight is twin[0].weight, "tied weights must stay tied"
    tokens = torch.randint(0, VOCAB, (2, 5))
    twin(tokens)
    assert seen == [fnn.MultiheadAttention]
    if inplace:  # the handle the user holds still removes the hook from the twin
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
