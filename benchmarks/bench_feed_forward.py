"""pytest-benchmark: ``feed_forward`` forward, backward and forward+backward, each provider x shape."""
import pytest

from providers import op_params, run_op

PARAMS = op_params("feed_forward")


@pytest.mark.parametrize("provider, shape", PARAMS)
def test_feed_forward_fwd(benchmark, provider, shape):
    run_op(benchmark, "feed_forward", "fwd", provider, shape)


@pytest.mark.parametrize("provider, shape", PARAMS)
def test_feed_forward_bwd(benchmark, provider, shape):
    run_op(benchmark, "feed_forward", "bwd", provider, shape)


@pytest.mark.parametrize("provider, shape", PARAMS)
def test_feed_forward_fwd_bwd(benchmark, provider, shape):
    run_op(benchmark, "feed_forward", "fwd_bwd", provider, shape)
