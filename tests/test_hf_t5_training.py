"""A converted T5 trained and evaluated by transformers' Seq2SeqTrainer: its training steps run the fused
loss and land where the unconverted model's land; predict_with_generate gives the unconverted model's
tokens and evaluation loss."""
import copy

import pytest

transformers = pytest.importorskip("transformers", reason="the Hugging Face integration tests need transformers")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import hf_models as H  # noqa: E402
from utils import assert_close  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread_module")  # tiny shapes

STEPS = 3


def _examples(n=8):
    """Rows of a padded batch (source padding, labels ending in -100) as a dataset of dicts."""
    batch = H.batch("t5", B=n, S=9, T=5)
    batch["labels"][3, 2:] = -100
    return [{k: v[i] for k, v in batch.items()} for i in range(n)]


def _trainer(model, tmp_path, name):
    args = transformers.Seq2SeqTrainingArguments(
        output_dir=str(tmp_path / name), per_device_train_batch_size=4, per_device_eval_batch_size=4,
        max_steps=STEPS, learning_rate=0.5, optim="sgd", lr_scheduler_type="constant", weight_decay=0.0,
        report_to="none", use_cpu=True, save_strategy="no", seed=0, data_seed=0,
        predict_with_generate=True, generation_max_length=6, generation_num_beams=2)
    data = _examples()
    return transformers.Seq2SeqTrainer(model=model, args=args, train_dataset=data, eval_dataset=data)


def test_seq2seq_trainer_trains_and_predicts_like_the_unconverted_model(tmp_path, monkeypatch):
    ref = H.build("t5", seed=2).train()
    model = H.convert(copy.deepcopy(ref))
    start = {n: p.detach().clone() for n, p in ref.named_parameters()}
    calls, _ = H.count_op_calls(monkeypatch)
    trainer = _trainer(model, tmp_path, "fused")
    trainer.train()
    assert calls["linear_cross_entropy"] == STEPS  # the Trainer's loss is the fused one, every step
    ref_trainer = _trainer(ref, tmp_path, "plain")
    ref_trainer.train()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close(name, p, q, 1e-5, 1e-4)
    assert all(not torch.equal(p, start[n]) for n, p in ref.named_parameters())  # every parameter trained
    got, want = trainer.predict(_examples()), ref_trainer.predict(_examples())
    assert np.array_equal(got.predictions, want.predictions)
    assert abs(got.metrics["test_loss"] - want.metrics["test_loss"]) < 1e-4 * abs(want.metrics["test_loss"])
