"""Complete models on fastformer's modules: the "Attention Is All You Need" encoder-decoder."""
from .generation import beam_search, generate, greedy_search
from .masks import causal_mask, padding_mask
from .positional import SinusoidalPositionalEncoding, sinusoidal_table
from .seq2seq import Seq2SeqTransformer

__all__ = ["Seq2SeqTransformer", "SinusoidalPositionalEncoding", "sinusoidal_table", "padding_mask",
           "causal_mask", "generate", "greedy_search", "beam_search"]
