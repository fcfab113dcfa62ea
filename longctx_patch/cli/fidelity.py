"""`longctx patch`'s fidelity check: how long its sample must be for the method's approximation to run at all, and
what the check then says.

A method approximates attention only past some length: `sliding-window` and the linear hybrids once a query has more
keys than the window, `moba` once a query block has more earlier blocks than it attends, `muse` above `min_seq_len`
and once a query block has more earlier blocks than it attends exactly (sink, local, retrieved). Below that the
patched model is exact up to rounding, and a check there proves nothing about the approximation.
"""

from __future__ import annotations

import math

import torch

DEFAULT_TOKENS = 1024  # the check's length when the method approximates below it (or never)
CPU_MAX_TOKENS = 4096  # the longest automatic check on a CPU (the PyTorch references: MuSe's dense one at 8k takes
GPU_MAX_TOKENS = 32768  # about 3 min for SmolLM2 on 2 cores); on a GPU


def approximation_start(method: str, config, device_type: str = "cpu", head_dim: int = 64
                        ) -> tuple[int | None, int | None, str]:
    """(the shortest sequence in which some query of `method` with `config` (its parsed config) is not attended
    exactly on a `device_type` device at `head_dim` (muse's default min_seq_len depends on both), or None when it
    never is; the first position approximated in such a sequence; a few words on why): the method's own
    `Method.approximation_start`. A method without that hook is refused by name (MissingHookError)."""
    from longctx_patch.methods import get_method

    return tuple(get_method(method).approximation_start(config, device_type, head_dim))


def check_length(start: int | None, device: torch.device, limit: int) -> int:
    """The automatic length of the check: DEFAULT_TOKENS when the approximation starts below it (or never), else
    past its start by a quarter of it (rounded up to 512 tokens) when that fits the device's budget and `limit` (the
    model's positions and the sample's tokens), else DEFAULT_TOKENS (the check then says it ran exactly)."""
    if start is None or start <= DEFAULT_TOKENS * 3 // 4:
        return min(DEFAULT_TOKENS, limit)
    want = int(math.ceil((start + max(start // 4, 256)) / 512) * 512)
    budget = GPU_MAX_TOKENS if device.type == "cuda" else CPU_MAX_TOKENS
    return want if want <= min(budget, limit) else min(DEFAULT_TOKENS, limit)


def affordable_note(want: int, device: torch.device) -> str:
    if device.type == "cuda":
        return "seconds on a GPU"
    return "minutes on a CPU: the methods' PyTorch references run there; seconds on a GPU (--device cuda)"


def report(out: torch.Tensor, ref: torch.Tensor, method: str, start: int | None, first: int | None, why: str,
           device: torch.device, limit: int, echo) -> None:
    """The check's lines: agreement over every position and, past the approximation's start, over the approximated
    positions alone; or a plain statement that the check ran exactly, with the length that would test it."""
    n = out.shape[1]
    diff = (out - ref).abs()
    agree = (out.argmax(-1) == ref.argmax(-1)).float()
    echo(f"fidelity on {n} tokens of built-in sample text vs unpatched:")
    echo(f"  logit |diff| mean {diff.mean().item():.4g}  max {diff.max().item():.4g}")
    echo(f"  next-token agreement {100 * agree.mean().item():.2f}%")
    if start is None:
        if why:
            echo(f"  ({why}: nothing is approximated, the differences are rounding)")
        return
    if n >= start:
        tail = slice(first, n)  # the positions whose queries are approximated
        echo(f"  past the approximation's start (positions {first}..{n - 1}: {why}): logit |diff| mean "
             f"{diff[:, tail].mean().item():.4g}  max {diff[:, tail].max().item():.4g}, next-token agreement "
             f"{100 * agree[:, tail].mean().item():.2f}%")
        return
    want = int(math.ceil((start + max(start // 4, 256)) / 512) * 512)
    if want > limit:
        echo(f"  the check ran exactly: at {n} tokens every query of {method} attends its keys exactly ({why}), and "
             f"this model's {limit} positions are too few to test the approximation")
        return
    echo(f"  the check ran exactly: at {n} tokens every query of {method} attends its keys exactly ({why}); the "
         f"differences above are rounding. To test the approximation: --fidelity-tokens {want} "
         f"({affordable_note(want, device)})")


__all__ = ["approximation_start", "check_length", "report"]
