"""Left-padded batches for methods that work on a grid of chunks or blocks (lola, ovq, muse).

A method whose result depends on where its chunk boundaries fall (LoLA's evictions, OVQ's dictionary updates,
MuSe's blocks) gives a left-padded row the result of that prompt alone only if the row's chunks start at its
first real token. Padding that is a whole number of chunks is neutral (fully masked chunks contribute nothing),
so rows whose padding has the same remainder modulo the chunk form one *phase group*: drop the group's first
`trim` columns (padding in every one of its rows) and what remains is padded by whole chunks only.

    for g in phase_groups(key_mask, chunk):
        o[g.rows, g.trim:] = method(x[g.rows, g.trim:], key_mask[g.rows, g.trim:])

A batch without padding, or whose paddings share one remainder, is one group (the batch itself, `rows=None`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PhaseGroup:
    """Rows of a batch whose left padding has the same remainder `trim` modulo the chunk.

    rows: LongTensor of batch indices (sorted), or None for every row of the batch (in order); trim: the number of
    leading columns to drop (padding in each of these rows)."""

    rows: torch.Tensor | None
    trim: int

    def take(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """The group's rows of `x` (batch first) with the first `trim` entries of dimension `dim` dropped."""
        if self.rows is not None:
            x = x.index_select(0, self.rows.to(x.device))
        return x.narrow(dim, self.trim, x.shape[dim] - self.trim) if self.trim else x


def left_padding(key_mask: torch.Tensor) -> torch.Tensor:
    """[B] number of leading padding columns of each row of a [B, S] mask (True = real token). A row of padding
    only counts S."""
    km = key_mask.bool()
    first_real = km.int().argmax(dim=1)
    return torch.where(km.any(dim=1), first_real, torch.full_like(first_real, km.shape[1]))


def check_left_padded(key_mask: torch.Tensor, what: str) -> None:
    """ValueError unless every row of `key_mask` is padding followed by real tokens only (left padding): a hole
    inside a row has no chunk grid of its own."""
    km = key_mask.bool()
    if km.shape[1] < 2:
        return
    if bool((km[:, :-1] & ~km[:, 1:]).any()):
        raise ValueError(f"{what} supports left padding only (a real token followed by padding was found in the "
                         "attention mask); pad on the left (tokenizer.padding_side = 'left'), as generate() expects")


def phase_groups(key_mask: torch.Tensor | None, chunk: int) -> list[PhaseGroup]:
    """The phase groups of a left-padded batch for a grid of `chunk` tokens (see the module docstring).

    key_mask [B, S] bool (True = real token) of the tokens the call sees, or None (no padding)."""
    if key_mask is None:
        return [PhaseGroup(None, 0)]
    phase = left_padding(key_mask) % chunk
    values = torch.unique(phase).tolist()  # one host sync per call with padding
    if len(values) == 1:
        return [PhaseGroup(None, int(values[0]))]
    return [PhaseGroup(torch.nonzero(phase == p).flatten(), int(p)) for p in values]


__all__ = ["PhaseGroup", "check_left_padded", "left_padding", "phase_groups"]
