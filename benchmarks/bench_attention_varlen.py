"""pytest-benchmark: ``attention_varlen`` (packed rows) beside fastformer's padded op and torch SDPA on
the same real tokens, forward, backward and forward+backward."""
from providers import op_benchmark

test_attention_varlen = op_benchmark("attention_varlen")
