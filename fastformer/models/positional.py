"""Sinusoidal positional encoding of "Attention Is All You Need", for any length."""
import math

import torch


def sinusoidal_table(length: int, d_model: int, device=None) -> torch.Tensor:
    """(length, d_model) fp32: ``PE[pos, 2i] = sin(pos / 10000^(2i/d))``, ``PE[pos, 2i+1] = cos(...)``."""
    pos = torch.arange(length, dtype=torch.float64, device=device)[:, None]  # (L, 1)
    inv_freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float64, device=device)
                         * (-math.log(10000.0) / d_model))  # (ceil(d/2),)
    angle = pos * inv_freq  # (L, ceil(d/2))
    table = torch.empty(length, d_model, dtype=torch.float64, device=device)
    table[:, 0::2] = torch.sin(angle)
    table[:, 1::2] = torch.cos(angle[:, : d_model // 2])
    return table.float()


class SinusoidalPositionalEncoding(torch.nn.Module):
    """Returns the encodings of positions ``offset .. offset + length - 1``.

    The table is a non-persistent buffer (not in ``state_dict``) of ``max_len`` rows to
    start with; it grows (doubling) whenever a longer sequence arrives, so there is no
    maximum length.
    """

    def __init__(self, d_model: int, max_len: int = 1024):
        super().__init__()
        if d_model <= 0 or max_len <= 0:
            raise ValueError(f"d_model and max_len must be positive, got {d_model} and {max_len}")
        self.d_model = d_model
        self.register_buffer("table", sinusoidal_table(max_len, d_model), persistent=False)

    def forward(self, length: int, offset: int = 0) -> torch.Tensor:
        """(length, d_model) encodings, in the table's dtype and device."""
        end = offset + length
        if end > self.table.shape[0]:
            rows = max(end, 2 * self.table.shape[0])
            self.table = sinusoidal_table(rows, self.d_model, self.table.device).to(self.table.dtype)
        return self.table[offset:end]

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, rows={self.table.shape[0]}"
