"""The optimiser and learning-rate schedule of "Attention Is All You Need".

``lr(step) = factor * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)`` for optimiser
steps counted from 1: linear warm-up for ``warmup`` steps, then inverse square-root decay.
"""
from typing import Iterable, Optional, Tuple, Union

import torch
from torch.optim.lr_scheduler import LambdaLR


class NoamLambda:
    """The Noam factor as a picklable callable (so a scheduler's ``state_dict`` keeps it).

    Called with LambdaLR's counter ``n`` (0 before the first ``scheduler.step()``), it
    returns the factor for optimiser step ``n + 1``.
    """

    def __init__(self, d_model: int, warmup: int, factor: float = 1.0):
        if not isinstance(d_model, int) or d_model <= 0:
            raise ValueError(f"d_model must be a positive int, got {d_model!r}")
        if not isinstance(warmup, int) or warmup <= 0:
            raise ValueError(f"warmup must be a positive int, got {warmup!r}")
        if not factor > 0:
            raise ValueError(f"factor must be positive, got {factor!r}")
        self.d_model, self.warmup, self.factor = d_model, warmup, float(factor)

    def __call__(self, n: int) -> float:
        step = n + 1
        return self.factor * self.d_model ** -0.5 * min(step ** -0.5, step * self.warmup ** -1.5)

    def __repr__(self) -> str:
        return f"NoamLambda(d_model={self.d_model}, warmup={self.warmup}, factor={self.factor})"


def noam_lambda(d_model: int, warmup: int) -> NoamLambda:
    """``lr_lambda`` for ``torch.optim.lr_scheduler.LambdaLR``: the Noam factor for step n + 1."""
    return NoamLambda(d_model, warmup)


class NoamScheduler(LambdaLR):
    """LambdaLR with the Noam schedule: lr = base_lr * factor * noam(step).

    With the optimiser's lr at 1.0 (what :func:`make_optimizer` gives), the lr used by
    the s-th ``optimizer.step()`` is exactly ``factor * d_model^-0.5 * min(s^-0.5, s * warmup^-1.5)``.
    Call ``scheduler.step()`` after every ``optimizer.step()``. ``state_dict`` /
    ``load_state_dict`` save and restore the step count and the schedule's constants.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, d_model: int, warmup: int, factor: float = 1.0,
                 last_epoch: int = -1):
        self.d_model, self.warmup, self.factor = d_model, warmup, factor
        super().__init__(optimizer, NoamLambda(d_model, warmup, factor), last_epoch=last_epoch)


def _fused_supported(params) -> bool:
    """Whether torch's fused Adam takes these parameters: all floating point, on one device
    type that has the fused kernels (CPU and CUDA among them in torch 2.13)."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    tensors = [p for group in params for p in (group["params"] if isinstance(group, dict) else [group])]
    devices = {p.device.type for p in tensors}
    return (len(devices) == 1 and devices <= set(_get_fused_kernels_supported_devices())
            and all(p.is_floating_point() and not p.is_sparse for p in tensors))


def make_optimizer(model: Union[torch.nn.Module, Iterable], lr: float = 1.0,
                   betas: Tuple[float, float] = (0.9, 0.98), eps: float = 1e-9,
                   weight_decay: float = 0.0, fused: Optional[bool] = None) -> torch.optim.Adam:
    """Adam with the paper's ``betas=(0.9, 0.98)`` and ``eps=1e-9``.

    ``lr`` defaults to 1.0 so that a :class:`NoamScheduler` sets the actual rate.
    ``model`` may be a module or an iterable of parameters / parameter groups. ``fused``:
    torch's fused Adam (one kernel for the whole update instead of a chain of per-tensor ops);
    ``None`` (default) takes it wherever the parameters' device supports it, ``False`` never.
    """
    params = list(model.parameters() if isinstance(model, torch.nn.Module) else model)
    if fused is None:
        fused = _fused_supported(params)
    return torch.optim.Adam(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                            fused=bool(fused) or None)


__all__ = ["noam_lambda", "NoamLambda", "NoamScheduler", "make_optimizer"]
