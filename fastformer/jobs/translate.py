"""``python -m fastformer translate --checkpoint DIR [--beam N]``: translate lines from stdin.

Each input line gives exactly one output line (an empty line gives an empty line). Piped
input is read whole and translated in length-sorted batches; at a terminal each line is
translated as soon as it is typed.
"""
import sys
from typing import Iterable, List, Optional, Sequence, TextIO, Tuple

import torch

from . import checkpoint as ckpt
from .config import TrainConfig, build_model, resolve_config
from .data import Tokenizer, pad_batch
from .devices import backend_context, pick_device


def load_model(path: str, device: Optional[str] = "auto") -> Tuple[torch.nn.Module, Tokenizer, Tokenizer, TrainConfig]:
    """``(model, src_tokenizer, tgt_tokenizer, config)`` from a training checkpoint (file or dir)."""
    dev = pick_device(device or "auto")
    state = ckpt.load(path, map_location=dev)
    cfg = resolve_config({}, state["config"])
    src_tok = Tokenizer.from_dict(state["src_tokenizer"])
    tgt_tok = Tokenizer.from_dict(state["tgt_tokenizer"])
    model = build_model(cfg, src_tok.vocab_size, tgt_tok.vocab_size)
    model.load_state_dict(state["model"])
    model.to(dev).eval()
    return model, src_tok, tgt_tok, cfg


def translate_lines(model, src_tok: Tokenizer, tgt_tok: Tokenizer, sources: Sequence[str], *, beam: int = 1,
                    batch_size: int = 250, max_len: int = 256, max_output_len: Optional[int] = None, device=None,
                    backend: str = "auto") -> List[str]:
    """Translate ``sources`` in length-sorted batches; returns them in the original order.

    Sources are cut to ``max_len`` tokens. Outputs hold at most ``max_output_len`` tokens
    (counting the leading ``<s>``), by default the source's own length + 50 (what
    ``generate`` does for a lone sentence), so a translation never depends on its batch mates.
    """
    device = device or next(model.parameters()).device
    was_training = model.training
    model.eval()
    out: List[str] = [""] * len(sources)
    encoded = [src_tok.encode(s)[: max_len - 1] + [src_tok.eos_id] for s in sources]
    order = sorted(range(len(sources)), key=lambda i: len(encoded[i]))
    try:
        with torch.no_grad(), backend_context(backend):
            for start in range(0, len(order), batch_size):
                chunk = order[start:start + batch_size]
                src = pad_batch([encoded[i] for i in chunk]).to(device)
                limit = max_output_len or src.shape[1] + 50
                ids = model.generate(src, max_len=limit, beam_size=beam)
                for row, i in enumerate(chunk):
                    own = max_output_len or len(encoded[i]) + 50
                    out[i] = tgt_tok.decode(ids[row, :own].tolist())
    finally:
        model.train(was_training)
    return out


def translate_stream(model, src_tok: Tokenizer, tgt_tok: Tokenizer, lines: Iterable[str], out: TextIO, *,
                     beam: int = 1, batch_size: int = 64, max_len: int = 256, max_output_len: Optional[int] = None,
                     backend: str = "auto", interactive: bool = False) -> int:
    """Translate ``lines`` to ``out`` one line each; returns how many lines were written."""
    def flush(batch: List[str]) -> None:
        keep = [i for i, s in enumerate(batch) if s.strip()]
        hyps = translate_lines(model, src_tok, tgt_tok, [batch[i].strip() for i in keep], beam=beam,
                               batch_size=batch_size, max_len=max_len, max_output_len=max_output_len,
                               backend=backend) if keep else []
        results = [""] * len(batch)
        for i, h in zip(keep, hyps):
            results[i] = h
        for r in results:
            out.write(r + "\n")
        out.flush()

    count, batch = 0, []
    for line in lines:
        batch.append(line.rstrip("\r\n"))
        if interactive or len(batch) >= batch_size * 16:
            flush(batch)
            count += len(batch)
            batch = []
    if batch:
        flush(batch)
        count += len(batch)
    return count


def run(checkpoint: str, beam: int = 1, batch_size: int = 64, device: str = "auto", backend: str = "auto",
        max_output_len: Optional[int] = None, stdin: Optional[TextIO] = None, stdout: Optional[TextIO] = None) -> int:
    """Translate ``stdin`` to ``stdout`` with the checkpoint's model; returns the lines written."""
    if beam < 1:
        raise ValueError(f"--beam must be at least 1, got {beam}")
    if batch_size < 1:
        raise ValueError(f"--batch-size must be at least 1, got {batch_size}")
    if max_output_len is not None and max_output_len < 2:
        raise ValueError(f"--max-len must be at least 2 (<s> and one token), got {max_output_len}")
    stdin = stdin if stdin is not None else sys.stdin
    stdout = stdout if stdout is not None else sys.stdout
    model, src_tok, tgt_tok, cfg = load_model(checkpoint, device)
    interactive = hasattr(stdin, "isatty") and stdin.isatty()
    return translate_stream(model, src_tok, tgt_tok, stdin, stdout, beam=beam, batch_size=batch_size,
                            max_len=cfg.max_len, max_output_len=max_output_len, backend=backend,
                            interactive=interactive)
