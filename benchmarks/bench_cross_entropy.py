"""pytest-benchmark: ``cross_entropy`` and ``linear_cross_entropy`` (label smoothing 0.1),
forward, backward and forward+backward, each provider x shape. linear_cross_entropy's providers
include torch's own ``F.linear_cross_entropy`` (default and chunked) where torch has it (2.13+)."""
from providers import op_benchmark

test_cross_entropy = op_benchmark("cross_entropy")
test_linear_cross_entropy = op_benchmark("linear_cross_entropy")
