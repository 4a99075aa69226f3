"""The data pipeline of the command-line jobs: built-in tasks, corpus files, tokenizers, batching."""
from .batching import TokenBatches, collate, collate_packed, encode_pairs, pad_batch, target_tokens
from .corpus import CorpusError, load_corpus, load_parallel, load_tsv, split_pairs
from .tasks import TASKS, make_task
from .tokenizer import (BOS_ID, EOS_ID, PAD_ID, UNK_ID, BPETokenizer, CharTokenizer, Tokenizer,
                        train_tokenizer)

__all__ = ["TokenBatches", "collate", "collate_packed", "encode_pairs", "pad_batch", "target_tokens", "CorpusError", "load_corpus",
           "load_parallel", "load_tsv", "split_pairs", "TASKS", "make_task", "BOS_ID", "EOS_ID",
           "PAD_ID", "UNK_ID", "BPETokenizer", "CharTokenizer", "Tokenizer", "train_tokenizer"]
