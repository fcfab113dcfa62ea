"""`exact`'s config: no options."""

from __future__ import annotations

from dataclasses import dataclass

from ..base import MethodConfig


@dataclass
class ExactConfig(MethodConfig):
    """No options: exact softmax attention."""


__all__ = ["ExactConfig"]
