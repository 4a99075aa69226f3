"""Drop-in twins of torch.nn's Transformer modules, running on fastformer's fused ops.

Each twin subclasses the torch class (``isinstance`` checks keep working), takes the
same constructor and forward arguments and has the same parameters and ``state_dict``
keys, so checkpoints move freely between the two. :func:`fastformer.convert` swaps the
torch modules of an existing model for these twins.
"""
from .layer_norm import LayerNorm, RMSNorm
from .multihead_attention import MultiheadAttention
from .transformer import (Transformer, TransformerDecoder, TransformerDecoderLayer, TransformerEncoder,
                          TransformerEncoderLayer)

__all__ = ["MultiheadAttention", "TransformerEncoderLayer", "TransformerDecoderLayer", "TransformerEncoder",
           "TransformerDecoder", "Transformer", "LayerNorm", "RMSNorm"]
