"""The trainable parameters a method adds to a patched model."""

from __future__ import annotations

from torch import nn


def _patched_modules(model: nn.Module) -> dict[int, nn.Module]:
    from ..patcher import is_patched, patched_modules

    return patched_modules(model) if is_patched(model) else {}


def method_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of every parameter a method added (not the shared q/k/v/o/q_norm/k_norm)."""
    from ..architectures import SHARED_SUBMODULES

    mods = set(id(m) for m in _patched_modules(model).values())
    shared = tuple(f"{n}." for n in SHARED_SUBMODULES)
    out = []
    for mname, mod in model.named_modules():
        if id(mod) not in mods:
            continue
        for pname, p in mod.named_parameters():
            if not pname.startswith(shared):
                out.append((f"{mname}.{pname}", p))
    return out


# ----------------------------------------------------------------------------------------------- runner
