"""pytest-benchmark: ``add_layer_norm`` forward, backward and forward+backward, each provider x shape."""
from providers import op_benchmark

test_add_layer_norm = op_benchmark("add_layer_norm")
