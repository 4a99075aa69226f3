"""The models the model-level tests share: a Seq2SeqTransformer moved off its initial values."""
import torch

from fastformer.models import Seq2SeqTransformer


def perturbed_model(src_vocab, tgt_vocab, seed=0, scale=0.1, everything=False, generator=None, **kwargs):
    """``Seq2SeqTransformer(src_vocab, tgt_vocab, **kwargs)`` built under ``torch.manual_seed(seed)``,
    then its parameters moved by ``scale`` x N(0, 1) drawn from ``generator`` (by default one seeded
    ``seed + 1``): zero biases and unit norms would hide mix-ups. Every parameter when
    ``everything``, else all but the embeddings and the output projection."""
    torch.manual_seed(seed)
    model = Seq2SeqTransformer(src_vocab, tgt_vocab, **kwargs)
    g = torch.Generator().manual_seed(seed + 1) if generator is None else generator
    with torch.no_grad():
        for name, p in model.named_parameters():
            if everything or ("embed" not in name and "output_proj" not in name):
                p.add_(scale * torch.randn(p.shape, generator=g))
    return model
