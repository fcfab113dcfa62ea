"""Helpers used by several scripts of evals/.

`take_top` and `blocks` are the cells far field's selection and block layout (the package's
`kernels.muse.cells._take_top` and `kernels.muse.plan._blocks`, private there); the studies rebuild the
selection from them, so they must stay equal to the package's (tests/test_evals_layout.py checks it).
"""

from __future__ import annotations

from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS = REPO_ROOT / "evals" / "results"  # the results committed with the checkout (results/INDEX.md)
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"  # the essays of ../shared/data (pg_essays/) beside the checkout


def take_top(retrieved: torch.Tensor, scores: torch.Tensor, k: int) -> None:
    """Marks in `retrieved` (in place; it may be a view) the k best blocks of each row of `scores` that score above
    -inf (-inf: not a candidate)."""
    val, idx = scores.topk(k, -1)
    retrieved.scatter_(-1, idx, torch.isfinite(val) | retrieved.gather(-1, idx))


def blocks(x: torch.Tensor, L: int, Sp: int) -> torch.Tensor:
    """[B, H, S, D] -> [B, H, Sp // L, L, D], zero-padded at the end to Sp tokens."""
    B, H, S, D = x.shape
    if Sp != S:
        x = torch.nn.functional.pad(x, (0, 0, 0, Sp - S))
    return x.reshape(B, H, Sp // L, L, D)
