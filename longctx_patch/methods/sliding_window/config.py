"""`sliding-window`'s config: the window."""

from __future__ import annotations

from dataclasses import dataclass

from ..base import MethodConfig, option


@dataclass
class SlidingWindowConfig(MethodConfig):
    window: int = option(256, "number of most recent tokens (the current one included) each query attends to", min=1)


__all__ = ["SlidingWindowConfig"]
