"""fastformer.convert's dispatch: a transformers model goes to fastformer.hf.convert (recognised without
importing transformers; `import fastformer` never imports it), and its arguments are checked."""
import os
import subprocess
import sys

import pytest

transformers = pytest.importorskip("transformers", reason="the Hugging Face integration tests need transformers")

import torch  # noqa: E402

import fastformer  # noqa: E402
import fastformer.hf  # noqa: E402
from fastformer import nn as fnn  # noqa: E402
import hf_models as H  # noqa: E402


def test_import_fastformer_does_not_import_transformers():
    code = ("import sys, torch; import fastformer, fastformer.hf; "
            "fastformer.convert(torch.nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)); "
            "print(sorted(m for m in sys.modules if m == 'transformers' or m.startswith('transformers.')))")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"


def test_is_transformers_model():
    assert fastformer.hf.is_transformers_model(H.build("whisper", bare=True))
    assert not fastformer.hf.is_transformers_model(torch.nn.Linear(2, 2))
    assert not fastformer.hf.is_transformers_model(H.config("bart"))


def test_plain_torch_models_still_take_the_generic_path():
    layer = torch.nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
    assert isinstance(fastformer.convert(layer), fnn.TransformerEncoderLayer)


def test_label_smoothing_on_a_torch_model_is_a_type_error():
    with pytest.raises(TypeError, match="label_smoothing applies to Hugging Face transformers models only"):
        fastformer.convert(torch.nn.Sequential(torch.nn.LayerNorm(4)), label_smoothing=0.1)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(inplace=True), TypeError, "'inplace' argument was removed"),
    (dict(dropout=0.1), TypeError, "unexpected keyword argument"),
    (dict(copy="yes"), TypeError, "copy must be a bool"),
    (dict(label_smoothing=1.5), ValueError, "label_smoothing must be a number in"),
    (dict(label_smoothing="0.1"), ValueError, "label_smoothing must be a number in"),
])
def test_arguments_are_checked(kwargs, error, match):
    model = H.build("bart")
    cls = type(model)
    with pytest.raises(error, match=match):
        fastformer.convert(model, **kwargs)
    assert type(model) is cls and model.config._attn_implementation == "sdpa"


def test_unsupported_transformers_models_are_refused():
    model = transformers.BartForSequenceClassification(H.config("bart"))
    with pytest.raises(TypeError, match="BartForSequenceClassification is not supported.*BartModel"):
        fastformer.convert(model)
    t5 = transformers.T5ForSequenceClassification(H.config("t5"))
    with pytest.raises(TypeError, match="T5ForSequenceClassification is not supported.*T5ForConditionalGeneration, "
                                        "T5Model, T5EncoderModel"):
        fastformer.convert(t5)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=32, n_embd=16, n_layer=1, n_head=2))
    with pytest.raises(TypeError, match="model type 'gpt2'.*not supported.*WhisperForConditionalGeneration.*"
                                        "T5ForConditionalGeneration"):
        fastformer.convert(gpt2)


def test_label_smoothing_on_a_bare_model_warns():
    with pytest.warns(UserWarning, match="label_smoothing has no effect on BartModel"):
        fastformer.convert(H.build("bart", bare=True), label_smoothing=0.1)
