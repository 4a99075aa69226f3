"""fastformer: fused kernels that make encoder-decoder Transformer training faster.

    import fastformer
    model = fastformer.convert(model)            # torch.nn Transformer modules -> fused twins
    with fastformer.use_backend("reference"):    # or "cpu", "triton", "cuda", "auto"
        ...

Nothing here imports triton or touches CUDA at import time.
"""
from . import ops
from .backends import available_backends, get_backend, set_backend, use_backend
from . import nn, models, optim  # the modules built on the ops
from .convert import convert
from .models import Seq2SeqTransformer

__version__ = "0.1.0"

__all__ = ["ops", "available_backends", "get_backend", "set_backend", "use_backend", "nn", "models", "optim",
           "convert", "Seq2SeqTransformer", "__version__"]
