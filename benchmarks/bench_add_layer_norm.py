"""pytest-benchmark: ``add_layer_norm`` forward, backward and forward+backward, each provider x shape."""
import pytest

from providers import op_params, run_op

PARAMS = op_params("add_layer_norm")


@pytest.mark.parametrize("provider, shape", PARAMS)
def test_add_layer_norm_fwd(benchmark, provider, shape):
    run_op(benchmark, "add_layer_norm", "fwd", provider, shape)


@pytest.mark.parametrize("provider, shape", PARAMS)
def test_add_layer_norm_bwd(benchmark, provider, shape):
    run_op(benchmark, "add_layer_norm", "bwd", provider, shape)


@pytest.mark.parametrize("provider, shape", PARAMS)
def test_add_layer_norm_fwd_bwd(benchmark, provider, shape):
    run_op(benchmark, "add_layer_norm", "fwd_bwd", provider, shape)
