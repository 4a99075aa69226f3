"""embedding's bad input with every backend forced (the machinery: tests/hostile.py; the C++
kernel's checks and more cases on the default backend: tests/test_embedding.py)."""
import math

import torch

from fastformer import ops
import hostile
from hostile import tensor as _t


def _emb(**over):
    args = dict(input=torch.tensor([[0, 3, 1]]), weight=_t(4, 5))
    args.update(over)
    ids, weight = args.pop("input"), args.pop("weight")
    return lambda: ops.embedding(ids, weight, **args)


EMBEDDING = {
    "input_float": (_emb(input=_t(1, 3)), TypeError, "input must hold integer ids"),
    "input_list": (_emb(input=[0, 1]), TypeError, "input must be a torch.Tensor"),
    "input_too_big": (_emb(input=torch.tensor([0, 4])), ValueError, "input must be in \\[0, 4\\)"),
    "input_negative": (_emb(input=torch.tensor([-1, 2])), ValueError, "input must be in \\[0, 4\\)"),
    "input_device": (_emb(input=torch.zeros(3, dtype=torch.long, device="meta")), ValueError, "is on meta"),
    "weight_1d": (_emb(weight=_t(5)), ValueError, "weight must have 2 dimensions"),
    "weight_int": (_emb(weight=_t(4, 5, dtype=torch.int64)), TypeError, "weight must be a floating"),
    "positional_width": (_emb(positional=_t(3, 4)), ValueError, "positional must have shape"),
    "positional_short": (_emb(positional=_t(2, 5)), ValueError, "positional has 2 rows"),
    "positional_dtype": (_emb(positional=_t(3, 5, dtype=torch.bfloat16)), TypeError, "positional has dtype"),
    "positions_alone": (_emb(positions=torch.zeros(1, 3, dtype=torch.long)), ValueError,
                        "positions were given without a positional table"),
    "positions_shape": (_emb(positional=_t(3, 5), positions=torch.zeros(3, dtype=torch.long)), ValueError,
                        "positions must have shape"),
    "positions_float": (_emb(positional=_t(3, 5), positions=_t(1, 3)), TypeError, "positions must hold integer ids"),
    "positions_too_big": (_emb(positional=_t(3, 5), positions=torch.tensor([[0, 1, 3]])), ValueError,
                          "positions must be in \\[0, 3\\)"),
    "padding_idx_big": (_emb(padding_idx=4), ValueError, "padding_idx must be in"),
    "padding_idx_float": (_emb(padding_idx=0.0), TypeError, "padding_idx must be an int"),
    "dropout_one": (_emb(dropout_p=1.0), ValueError, "dropout_p"),
    "scale_nan": (_emb(scale=math.nan), ValueError, "scale must be a finite number"),
}


BAD_INPUT = {"embedding": EMBEDDING}
test_bad_input_raises_naming_the_argument = hostile.bad_input_test(**BAD_INPUT)
