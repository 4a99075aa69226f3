"""pytest-benchmark: ``feed_forward`` forward, backward and forward+backward, each provider x shape."""
from providers import op_benchmark

test_feed_forward = op_benchmark("feed_forward")
