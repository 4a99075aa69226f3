"""pytest-benchmark: ``cross_entropy`` and ``linear_cross_entropy`` (label smoothing 0.1),
forward, backward and forward+backward, each provider x shape."""
import pytest

from providers import op_params, run_op

CE = op_params("cross_entropy")
LCE = op_params("linear_cross_entropy")


@pytest.mark.parametrize("provider, shape", CE)
def test_cross_entropy_fwd(benchmark, provider, shape):
    run_op(benchmark, "cross_entropy", "fwd", provider, shape)


@pytest.mark.parametrize("provider, shape", CE)
def test_cross_entropy_bwd(benchmark, provider, shape):
    run_op(benchmark, "cross_entropy", "bwd", provider, shape)


@pytest.mark.parametrize("provider, shape", CE)
def test_cross_entropy_fwd_bwd(benchmark, provider, shape):
    run_op(benchmark, "cross_entropy", "fwd_bwd", provider, shape)


@pytest.mark.parametrize("provider, shape", LCE)
def test_linear_cross_entropy_fwd(benchmark, provider, shape):
    run_op(benchmark, "linear_cross_entropy", "fwd", provider, shape)


@pytest.mark.parametrize("provider, shape", LCE)
def test_linear_cross_entropy_bwd(benchmark, provider, shape):
    run_op(benchmark, "linear_cross_entropy", "bwd", provider, shape)


@pytest.mark.parametrize("provider, shape", LCE)
def test_linear_cross_entropy_fwd_bwd(benchmark, provider, shape):
    run_op(benchmark, "linear_cross_entropy", "fwd_bwd", provider, shape)
