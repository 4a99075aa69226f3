"""Hostile configurations and inputs to every module of ``fastformer.nn`` and to
``fastformer.models.Seq2SeqTransformer`` (forward, loss, generate): each raises a ValueError /
TypeError naming the argument before any work, on every backend; empty batches give correctly
shaped outputs and gradients."""
import pytest
import torch

import fastformer
from fastformer import nn as fnn
from fastformer.models import Seq2SeqTransformer
from utils import ALL_OPS, kernel_backends, skip_without_kernels

BACKENDS = [pytest.param("reference", id="reference")] + kernel_backends()
E, H = 8, 2


def _x(*shape, dtype=torch.float32, device="cpu"):
    if not dtype.is_floating_point:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.randn(shape, device=device).to(dtype)


# ----------------------------------------------------------------------- configurations
CONFIGS = {
    "mha_indivisible": (lambda: fnn.MultiheadAttention(10, 3), ValueError, "embed_dim \\(10\\) must be divisible"),
    "mha_heads_0": (lambda: fnn.MultiheadAttention(8, 0), ValueError, "num_heads must be an int >= 1"),
    "mha_embed_neg": (lambda: fnn.MultiheadAttention(-8, 2), ValueError, "embed_dim must be an int >= 1"),
    "mha_embed_float": (lambda: fnn.MultiheadAttention(8.0, 2), TypeError, "embed_dim must be an int"),
    "mha_dropout_neg": (lambda: fnn.MultiheadAttention(8, 2, dropout=-0.1), ValueError, "dropout"),
    "mha_dropout_one": (lambda: fnn.MultiheadAttention(8, 2, dropout=1.0), ValueError, "dropout"),
    "mha_kdim_0": (lambda: fnn.MultiheadAttention(8, 2, kdim=0), ValueError, "kdim"),
    "ln_eps_neg": (lambda: fnn.LayerNorm(8, eps=-1e-5), ValueError, "eps must be a positive"),
    "ln_eps_zero": (lambda: fnn.LayerNorm(8, eps=0.0), ValueError, "eps"),
    "ln_shape_0": (lambda: fnn.LayerNorm(0), ValueError, "normalized_shape must be an int >= 1"),
    "ln_shape_empty": (lambda: fnn.LayerNorm(()), ValueError, "normalized_shape"),
    "rms_eps_neg": (lambda: fnn.RMSNorm(8, eps=-1e-5), ValueError, "eps must be a positive"),
    "rms_shape_0": (lambda: fnn.RMSNorm(0), ValueError, "normalized_shape must be an int >= 1"),
    "rms_input_shape": (lambda: fnn.RMSNorm(8)(torch.randn(2, 7)), ValueError, "RMSNorm expects input ending in"),
    "enc_indivisible": (lambda: fnn.TransformerEncoderLayer(10, 4), ValueError, "d_model \\(10\\) must be divisible by nhead"),
    "enc_dropout": (lambda: fnn.TransformerEncoderLayer(8, 2, dropout=1.5), ValueError, "dropout must be"),
    "enc_ffn_0": (lambda: fnn.TransformerEncoderLayer(8, 2, dim_feedforward=0), ValueError, "dim_feedforward"),
    "enc_eps_neg": (lambda: fnn.TransformerEncoderLayer(8, 2, layer_norm_eps=-1.0), ValueError, "layer_norm_eps"),
    "enc_activation": (lambda: fnn.TransformerEncoderLayer(8, 2, activation="tanh"), ValueError, "activation"),
    "dec_indivisible": (lambda: fnn.TransformerDecoderLayer(6, 4), ValueError, "d_model \\(6\\) must be divisible"),
    "dec_nhead_0": (lambda: fnn.TransformerDecoderLayer(8, 0), ValueError, "nhead must be an int >= 1"),
    "dec_dropout_neg": (lambda: fnn.TransformerDecoderLayer(8, 2, dropout=-0.5), ValueError, "dropout"),
    "encoder_layers_0": (lambda: fnn.TransformerEncoder(fnn.TransformerEncoderLayer(8, 2), 0), ValueError,
                         "num_layers must be an int >= 1"),
    "decoder_layers_float": (lambda: fnn.TransformerDecoder(fnn.TransformerDecoderLayer(8, 2), 1.5), TypeError,
                             "num_layers must be an int"),
    "transformer_indivisible": (lambda: fnn.Transformer(9, 2), ValueError, "d_model \\(9\\) must be divisible"),
    "transformer_layers_neg": (lambda: fnn.Transformer(8, 2, num_encoder_layers=-1), ValueError,
                               "num_encoder_layers"),
    "transformer_eps": (lambda: fnn.Transformer(8, 2, layer_norm_eps=float("nan")), ValueError, "layer_norm_eps"),
    "s2s_vocab_0": (lambda: Seq2SeqTransformer(0, 10, d_model=8, nhead=2), ValueError, "src_vocab_size"),
    "s2s_vocab_float": (lambda: Seq2SeqTransformer(10, 10.0, d_model=8, nhead=2), TypeError, "tgt_vocab_size"),
    "s2s_indivisible": (lambda: Seq2SeqTransformer(10, 10, d_model=10, nhead=4), ValueError,
                        "d_model \\(10\\) must be divisible by nhead \\(4\\)"),
    "s2s_dropout": (lambda: Seq2SeqTransformer(10, 10, d_model=8, nhead=2, dropout=1.0), ValueError, "dropout"),
    "s2s_ffn_neg": (lambda: Seq2SeqTransformer(10, 10, d_model=8, nhead=2, dim_feedforward=-4), ValueError,
                    "dim_feedforward"),
    "s2s_layers_0": (lambda: Seq2SeqTransformer(10, 10, d_model=8, nhead=2, num_decoder_layers=0), ValueError,
                     "num_decoder_layers"),
    "s2s_max_len_0": (lambda: Seq2SeqTransformer(10, 10, d_model=8, nhead=2, max_len=0), ValueError, "max_len"),
    "s2s_pad_out_of_vocab": (lambda: Seq2SeqTransformer(10, 10, d_model=8, nhead=2, pad_idx=10), ValueError,
                             "pad_idx"),
    "s2s_bos_negative": (lambda: Seq2SeqTransformer(10, 10, d_model=8, nhead=2, bos_idx=-1), ValueError, "bos_idx"),
    "s2s_activation": (lambda: Seq2SeqTransformer(10, 10, d_model=8, nhead=2, activation="swish"), ValueError,
                       "activation"),
}


@pytest.mark.parametrize("build, exc, match", [pytest.param(*v, id=k) for k, v in CONFIGS.items()])
def test_impossible_configuration_is_rejected(build, exc, match):
    with pytest.raises(exc, match=match):
        build()


# ------------------------------------------------------------------------------- inputs
def _mha():
    return fnn.MultiheadAttention(E, H, batch_first=True).eval()


def _enc():
    return fnn.TransformerEncoderLayer(E, H, 16, dropout=0.0, batch_first=True).eval()


def _dec():
    return fnn.TransformerDecoderLayer(E, H, 16, dropout=0.0, batch_first=True).eval()


def _mha_call(**over):
    def call():
        args = dict(query=_x(2, 3, E), key=_x(2, 5, E), value=_x(2, 5, E))
        args.update(over)
        return _mha()(**args)
    return call


def _enc_call(stack=False, **over):
    def call():
        args = dict(src=_x(2, 5, E))
        args.update(over)
        if stack:
            mask = args.pop("src_mask", None)
            return fnn.TransformerEncoder(_enc(), 1)(mask=mask, **args)
        return _enc()(**args)
    return call


def _dec_call(stack=False, **over):
    def call():
        args = dict(tgt=_x(2, 3, E), memory=_x(2, 5, E))
        args.update(over)
        module = fnn.TransformerDecoder(_dec(), 1) if stack else _dec()
        return module(**args)
    return call


def _ln_call(x):
    return lambda: fnn.LayerNorm(E)(x)


def _transformer_call(src, tgt):
    return lambda: fnn.Transformer(E, H, 1, 1, 16, dropout=0.0, batch_first=True)(src, tgt)


INPUTS = {
    "mha_query_int": (_mha_call(query=_x(2, 3, E, dtype=torch.int64)), TypeError, "query must be a floating"),
    "mha_key_list": (_mha_call(key=[[0.0] * E]), TypeError, "key must be a torch.Tensor"),
    "mha_value_4d": (_mha_call(value=_x(2, 5, 1, E)), ValueError, "value must have 2 or 3 dimensions"),
    "mha_query_width": (_mha_call(query=_x(2, 3, E + 1)), ValueError, "embed_dim"),
    "mha_key_batch": (_mha_call(key=_x(3, 5, E), value=_x(3, 5, E)), ValueError, "batch size"),
    "mha_query_dtype": (_mha_call(query=_x(2, 3, E, dtype=torch.float64)), TypeError, "query has dtype"),
    "mha_query_device": (_mha_call(query=_x(2, 3, E, device="meta")), ValueError, "query is on meta"),
    "mha_kpm_shape": (_mha_call(key_padding_mask=torch.zeros(2, 3, dtype=torch.bool)), ValueError,
                      "key_padding_mask must have shape"),
    "mha_kpm_int": (_mha_call(key_padding_mask=torch.zeros(2, 5, dtype=torch.int64)), TypeError,
                    "key_padding_mask must be bool"),
    "mha_kpm_list": (_mha_call(key_padding_mask=[[False] * 5] * 2), TypeError, "key_padding_mask must be a torch"),
    "mha_kpm_device": (_mha_call(key_padding_mask=torch.zeros(2, 5, dtype=torch.bool, device="meta")), ValueError,
                       "key_padding_mask is on meta"),
    "mha_mask_shape": (_mha_call(attn_mask=torch.zeros(5, 3, dtype=torch.bool)), ValueError, "attn_mask"),
    "mha_mask_3d": (_mha_call(attn_mask=torch.zeros(2, 3, 5)), ValueError, "3-D attn_mask must have shape"),
    "mha_mask_int": (_mha_call(attn_mask=torch.zeros(3, 5, dtype=torch.int32)), TypeError, "attn_mask must be bool"),
    "ln_input_int": (_ln_call(_x(3, E, dtype=torch.int64)), TypeError, "input must be a floating"),
    "ln_input_width": (_ln_call(_x(3, E + 2)), ValueError, "normalized_shape"),
    "ln_input_list": (_ln_call([1.0] * E), TypeError, "input must be a torch.Tensor"),
    "enc_src_int": (_enc_call(src=_x(2, 5, E, dtype=torch.int64)), TypeError, "src must be a floating"),
    "enc_src_4d": (_enc_call(src=_x(2, 5, 1, E)), ValueError, "src must have 2 or 3 dimensions"),
    "enc_src_width": (_enc_call(src=_x(2, 5, E - 1)), ValueError, "src's last dimension must be d_model=8"),
    "enc_src_dtype": (_enc_call(src=_x(2, 5, E, dtype=torch.bfloat16)), TypeError, "src has dtype"),
    "enc_src_device": (_enc_call(src=_x(2, 5, E, device="meta")), ValueError, "src is on meta"),
    "enc_mask_shape": (_enc_call(src_mask=torch.zeros(4, 4, dtype=torch.bool)), ValueError, "src_mask"),
    "enc_mask_int": (_enc_call(src_mask=torch.zeros(5, 5, dtype=torch.int64)), TypeError, "src_mask must be bool"),
    "enc_kpm_shape": (_enc_call(src_key_padding_mask=torch.zeros(5, 2, dtype=torch.bool)), ValueError,
                      "src_key_padding_mask must have shape"),
    "enc_kpm_int": (_enc_call(src_key_padding_mask=torch.zeros(2, 5, dtype=torch.int32)), TypeError,
                    "src_key_padding_mask must be bool"),
    "encoder_src_width": (_enc_call(stack=True, src=_x(2, 5, 3)), ValueError, "src's last dimension"),
    "encoder_mask_shape": (_enc_call(stack=True, src_mask=torch.zeros(2, 5)), ValueError, "mask must have shape"),
    "encoder_kpm_dtype": (_enc_call(stack=True, src_key_padding_mask=torch.zeros(2, 5, dtype=torch.int8)),
                          TypeError, "src_key_padding_mask"),
    "dec_tgt_int": (_dec_call(tgt=_x(2, 3, E, dtype=torch.int64)), TypeError, "tgt must be a floating"),
    "dec_memory_width": (_dec_call(memory=_x(2, 5, E + 1)), ValueError, "memory's last dimension"),
    "dec_memory_rank": (_dec_call(memory=_x(5, E)), ValueError, "memory must have 3 dimensions"),
    "dec_memory_batch": (_dec_call(memory=_x(3, 5, E)), ValueError, "tgt and memory must have the same batch"),
    "dec_memory_device": (_dec_call(memory=_x(2, 5, E, device="meta")), ValueError, "memory is on meta"),
    "dec_tgt_mask": (_dec_call(tgt_mask=torch.zeros(3, 5, dtype=torch.bool)), ValueError, "tgt_mask"),
    "dec_memory_mask": (_dec_call(memory_mask=torch.zeros(3, 3, dtype=torch.bool)), ValueError, "memory_mask"),
    "dec_memory_kpm": (_dec_call(memory_key_padding_mask=torch.zeros(2, 3, dtype=torch.bool)), ValueError,
                       "memory_key_padding_mask must have shape"),
    "dec_tgt_kpm": (_dec_call(tgt_key_padding_mask=torch.zeros(2, 3, dtype=torch.int64)), TypeError,
                    "tgt_key_padding_mask"),
    "decoder_memory_batch": (_dec_call(stack=True, memory=_x(1, 5, E)), ValueError, "same batch"),
    "transformer_batch": (_transformer_call(_x(2, 5, E), _x(3, 4, E)), ValueError, "same batch size"),
    "transformer_tgt_width": (_transformer_call(_x(2, 5, E), _x(2, 4, 4)), ValueError, "tgt's last dimension"),
    "transformer_src_int": (_transformer_call(_x(2, 5, E, dtype=torch.int64), _x(2, 4, E)), TypeError,
                            "src must be a floating"),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("call, exc, match", [pytest.param(*v, id=k) for k, v in INPUTS.items()])
def test_bad_module_input_is_rejected(backend, call, exc, match):
    with fastformer.use_backend(backend), pytest.raises(exc, match=match):
        call()


# ----------------------------------------------------------------------- Seq2SeqTransformer
def _model():
    torch.manual_seed(0)
    return Seq2SeqTransformer(11, 13, d_model=E, nhead=H, num_encoder_layers=1, num_decoder_layers=1,
                              dim_feedforward=16, dropout=0.0).eval()


def _ids(*shape, high=11, dtype=torch.long):
    return torch.randint(3, high, shape, dtype=dtype)


MODEL_CALLS = {
    "forward_src_negative": (lambda m: m(torch.tensor([[3, -1, 4]]), _ids(1, 4, high=13)), ValueError,
                             "src token ids must be in \\[0, 11\\)"),
    "forward_src_too_big": (lambda m: m(torch.tensor([[3, 11, 4]]), _ids(1, 4, high=13)), ValueError,
                            "src token ids .* got values in \\[3, 11\\]"),
    "forward_tgt_too_big": (lambda m: m(_ids(1, 3), torch.tensor([[1, 13]])), ValueError, "tgt token ids"),
    "forward_src_float": (lambda m: m(_ids(1, 3).float(), _ids(1, 4)), TypeError, "src must hold integer"),
    "forward_src_1d": (lambda m: m(_ids(3), _ids(1, 4)), ValueError, "src must be a \\(B, S\\) tensor"),
    "forward_src_empty_seq": (lambda m: m(_ids(2, 0), _ids(2, 4)), ValueError, "src must hold at least one"),
    "forward_batch": (lambda m: m(_ids(2, 3), _ids(3, 4)), ValueError, "batch size"),
    "forward_src_device": (lambda m: m(_ids(1, 3).to("meta"), _ids(1, 4)), ValueError, "src is on meta"),
    "loss_tgt_short": (lambda m: m.loss(_ids(1, 3), _ids(1, 1)), ValueError, "tgt must hold at least 2"),
    "loss_tgt_negative": (lambda m: m.loss(_ids(1, 3), torch.tensor([[1, -3, 2]])), ValueError, "tgt token ids"),
    "loss_smoothing": (lambda m: m.loss(_ids(1, 3), _ids(1, 4), label_smoothing=1.5), ValueError,
                       "label_smoothing"),
    "generate_src_too_big": (lambda m: m.generate(torch.tensor([[3, 99]])), ValueError, "src token ids"),
    "generate_beam_0": (lambda m: m.generate(_ids(1, 3), beam_size=0), ValueError, "beam_size"),
    "generate_max_len_0": (lambda m: m.generate(_ids(1, 3), max_len=0), ValueError, "max_len"),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("call, exc, match", [pytest.param(*v, id=k) for k, v in MODEL_CALLS.items()])
def test_bad_model_input_is_rejected(backend, call, exc, match):
    skip_without_kernels(backend, *ALL_OPS)
    model = _model()
    with fastformer.use_backend(backend), pytest.raises(exc, match=match):
        call(model)


# ------------------------------------------------------------------------- empty batches
@pytest.mark.parametrize("backend", BACKENDS)
def test_model_empty_batch(backend):
    skip_without_kernels(backend, *ALL_OPS)
    model = _model().train()
    src, tgt = _ids(0, 5), _ids(0, 4, high=13)
    with fastformer.use_backend(backend):
        logits = model(src, tgt)
        assert logits.shape == (0, 4, 13)
        loss = model.loss(src, tgt)
        assert loss.shape == () and torch.isnan(loss), "the mean loss of no tokens is NaN, as F.cross_entropy's"
        loss.backward()
        for name, p in model.named_parameters():
            assert p.grad is None or p.grad.shape == p.shape, name
        for beam in (1, 3):
            out = model.generate(src, beam_size=beam)
            assert out.shape == (0, 1) and out.dtype == torch.long


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("batch_first", [True, False])
def test_layers_empty_batch(backend, batch_first):
    skip_without_kernels(backend, *ALL_OPS)
    torch.manual_seed(0)
    enc = fnn.TransformerEncoderLayer(E, H, 16, dropout=0.0, batch_first=batch_first)
    dec = fnn.TransformerDecoderLayer(E, H, 16, dropout=0.0, batch_first=batch_first)
    mha = fnn.MultiheadAttention(E, H, batch_first=batch_first)
    shape = (0, 5, E) if batch_first else (5, 0, E)
    src = torch.randn(shape, requires_grad=True)
    with fastformer.use_backend(backend):
        memory = enc(src, src_key_padding_mask=torch.zeros(0, 5, dtype=torch.bool))
        out = dec(torch.randn(shape), memory, tgt_is_causal=True,
                  tgt_mask=torch.ones(5, 5, dtype=torch.bool).triu(1))
        attn, weights = mha(src, src, src)
        (out.sum() + attn.sum()).backward()
    assert memory.shape == shape and out.shape == shape and attn.shape == shape
    assert weights.shape == (0, 5, 5)
    assert src.grad.shape == shape


# ------------------------------------------------------------- the rest of the top-level API
def _enter(ctx):
    with ctx:
        pass


def _noam(d_model, warmup, factor=1.0):
    opt = fastformer.optim.make_optimizer(torch.nn.Linear(2, 2))
    return fastformer.optim.NoamScheduler(opt, d_model, warmup, factor=factor)


TOP_LEVEL = {
    "set_backend": (lambda: fastformer.set_backend("gpu"), ValueError, "backend must be 'auto' or one of"),
    "use_backend": (lambda: _enter(fastformer.use_backend("opencl")), ValueError, "backend must be"),
    "convert_not_a_module": (lambda: fastformer.convert("model"), TypeError, "model"),
    "convert_mha_dropout": (lambda: fastformer.convert(torch.nn.MultiheadAttention(8, 2, dropout=1.5)), ValueError,
                            "dropout must be a number in \\[0, 1\\)"),
    "convert_layer_norm_eps": (lambda: fastformer.convert(torch.nn.Sequential(torch.nn.LayerNorm(8, eps=-1.0))),
                               ValueError, "eps must be a positive"),
    "convert_rms_norm_eps": (lambda: fastformer.convert(torch.nn.Sequential(torch.nn.RMSNorm(8, eps=-1.0))),
                             ValueError, "eps must be a positive"),
    "noam_d_model": (lambda: _noam(0, 10), ValueError, "d_model must be a positive int"),
    "noam_warmup": (lambda: _noam(8, 0), ValueError, "warmup must be a positive int"),
    "noam_factor": (lambda: _noam(8, 10, factor=float("nan")), ValueError, "factor must be positive"),
}


@pytest.mark.parametrize("call, exc, match", [pytest.param(*v, id=k) for k, v in TOP_LEVEL.items()])
def test_bad_top_level_call_is_rejected(call, exc, match):
    with pytest.raises(exc, match=match):
        call()
    assert fastformer.get_backend() == "auto", "a rejected backend name must not stick"
