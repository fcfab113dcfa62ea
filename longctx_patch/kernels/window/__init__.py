"""Exact sliding-window attention in O(S * W): `reference` (the banded form through SDPA, differentiable), `ops` (when
the banded form pays, the route to the Triton forward), `triton_window` (the forward kernel)."""

from .ops import use_banded, window_attention_triton, window_kernel_route, window_kernel_supported
from .reference import band_block, banded_bytes, banded_window_attention

__all__ = ["band_block", "banded_bytes", "banded_window_attention", "use_banded", "window_attention_triton",
           "window_kernel_route", "window_kernel_supported"]
