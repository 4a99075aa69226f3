"""fastformer's fused ops. Each validates its inputs, picks a backend and runs it.

``fastformer.ops.reference`` holds the pure-PyTorch definitions they are checked against.
"""
from . import reference
from .add_layer_norm import add_layer_norm
from .attention import attention
from .attention_varlen import attention_varlen, attention_varlen_kvpacked, attention_varlen_qkvpacked
from .cross_entropy import cross_entropy, linear_cross_entropy
from .embedding import embedding
from .feed_forward import feed_forward

__all__ = ["attention", "attention_varlen", "attention_varlen_qkvpacked", "attention_varlen_kvpacked",
           "add_layer_norm", "feed_forward", "cross_entropy", "linear_cross_entropy", "embedding", "reference"]
