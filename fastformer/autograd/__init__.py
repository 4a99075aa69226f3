"""One torch.autograd.Function per op. Each takes the chosen backend's kernels, runs its
forward kernel, saves what backward needs (the dropout's (2,) ``philox`` tensor of seed and offset, never a mask)
and calls the same backend's backward kernel."""
from .add_layer_norm import AddLayerNormFunction
from .attention import AttentionFunction
from .attention_varlen import AttentionVarlenFunction
from .cross_entropy import CrossEntropyFunction, LinearCrossEntropyFunction
from .embedding import EmbeddingFunction
from .feed_forward import FeedForwardFunction

__all__ = ["AttentionFunction", "AttentionVarlenFunction", "AddLayerNormFunction", "FeedForwardFunction",
           "CrossEntropyFunction", "LinearCrossEntropyFunction", "EmbeddingFunction"]
