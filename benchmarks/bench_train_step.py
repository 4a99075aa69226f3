"""pytest-benchmark: one training step (forward, label-smoothed loss, backward, Adam) of the
Seq2SeqTransformer against torch.nn.Transformer eager and compiled, fp32 and bf16 autocast."""
import pytest

from providers import run_train_step, train_step_params


@pytest.mark.parametrize("provider, dtype, shape", train_step_params())
def test_train_step(benchmark, provider, dtype, shape):
    run_train_step(benchmark, provider, dtype, shape)
