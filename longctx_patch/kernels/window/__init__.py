"""Exact sliding-window attention in O(S * W): `reference` (the banded form through SDPA, differentiable), `ops` (when
the banded form pays, the route to the Triton forward), `triton_window` (the forward kernel), `options` (its launch
tiles, `WindowTiles`)."""

from .ops import use_banded, window_attention_triton, window_kernel_route, window_kernel_supported
from .options import WindowTiles
from .reference import band_block, banded_bytes, banded_window_attention

__all__ = ["WindowTiles", "band_block", "banded_bytes", "banded_window_attention", "use_banded",
           "window_attention_triton", "window_kernel_route", "window_kernel_supported"]
