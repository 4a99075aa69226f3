"""Checkpoints written atomically, and the random-number state a resumed run needs.

:func:`save` writes to a temporary file in the destination's directory, flushes it to disk
and ``os.replace``-s it over the destination: a crash at any moment leaves either the old
checkpoint or the new one, never a torn file. A training checkpoint holds the model,
optimizer and scheduler states, the RNG states (torch, python ``random``, CUDA), the data
order position, the tokenizers and the configuration.
"""
import os
import random
import tempfile
from typing import Any, Dict, Optional

import torch

FILENAME = "checkpoint.pt"
FORMAT_VERSION = 1


def checkpoint_path(path: str) -> str:
    """``path`` itself if it is a file (or ends in ``.pt``), else ``path/checkpoint.pt``."""
    if os.path.isdir(path) or not path.endswith(".pt"):
        return os.path.join(path, FILENAME)
    return path


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save(state: Dict[str, Any], path: str) -> str:
    """Write ``state`` (``torch.save``-able) to ``path`` atomically; returns the final path.

    The temporary file lives next to ``path`` (same file system, so the rename is atomic)
    and is removed if anything fails before the rename.
    """
    path = os.path.abspath(path)
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(directory)
    return path


def load(path: str, map_location: Any = "cpu") -> Dict[str, Any]:
    """Read a checkpoint written by :func:`save` (``path`` may be its directory)."""
    path = checkpoint_path(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no checkpoint at {path!r}")
    # weights_only: tensors and plain containers only, so a checkpoint cannot run code when loaded
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # a truncated, foreign or unpicklable file: say which and why
        raise ValueError(f"{path!r} is not a fastformer checkpoint (it could not be read: "
                         f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from e
    if not isinstance(state, dict) or state.get("format") != FORMAT_VERSION:
        raise ValueError(f"{path!r} is not a fastformer checkpoint (format {FORMAT_VERSION})")
    return state


def rng_state() -> Dict[str, Any]:
    """The states of every random generator training draws from."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    """Restore what :func:`rng_state` captured."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    cuda: Optional[list] = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
