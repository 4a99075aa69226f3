"""pytest-benchmark: ``attention`` forward, backward and forward+backward, each provider x shape."""
from providers import op_benchmark

test_attention = op_benchmark("attention")
