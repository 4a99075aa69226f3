"""pytest-benchmark: ``attention`` forward, backward and forward+backward, each provider x shape."""
import pytest

from providers import op_params, run_op

PARAMS = op_params("attention")


@pytest.mark.parametrize("provider, shape", PARAMS)
def test_attention_fwd(benchmark, provider, shape):
    run_op(benchmark, "attention", "fwd", provider, shape)


@pytest.mark.parametrize("provider, shape", PARAMS)
def test_attention_bwd(benchmark, provider, shape):
    run_op(benchmark, "attention", "bwd", provider, shape)


@pytest.mark.parametrize("provider, shape", PARAMS)
def test_attention_fwd_bwd(benchmark, provider, shape):
    run_op(benchmark, "attention", "fwd_bwd", provider, shape)
