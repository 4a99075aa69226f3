"""pytest-benchmark: ``embedding`` forward, backward and forward+backward, each provider x shape."""
from providers import op_benchmark

test_embedding = op_benchmark("embedding")
