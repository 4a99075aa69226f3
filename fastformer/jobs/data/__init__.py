"""The data pipeline of the command-line jobs: built-in tasks, corpus files, tokenizers, batching."""
from .batching import TokenBatches, collate, encode_pairs, pad_batch
from .corpus import CorpusError, load_corpus, load_parallel, load_tsv, split_pairs
from .tasks import TASKS, make_task
from .tokenizer import (BOS_ID, EOS_ID, PAD_ID, UNK_ID, BPETokenizer, CharTokenizer, Tokenizer,
                        train_tokenizer)

__all__ = ["TokenBatches", "collate", "encode_pairs", "pad_batch", "CorpusError", "load_corpus",
           "load_parallel", "load_tsv", "split_pairs", "TASKS", "make_task", "BOS_ID", "EOS_ID",
           "PAD_ID", "UNK_ID", "BPETokenizer", "CharTokenizer", "Tokenizer", "train_tokenizer"]
