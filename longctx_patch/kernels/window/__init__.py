"""Exact sliding-window attention in O(S * W): `ops` (the banded form through SDPA, the route to the Triton
forward), `triton_window` (the forward kernel)."""

from .ops import (band_block, banded_bytes, banded_window_attention, use_banded, window_attention_triton,
                  window_kernel_route, window_kernel_supported)

__all__ = ["band_block", "banded_bytes", "banded_window_attention", "use_banded", "window_attention_triton",
           "window_kernel_route", "window_kernel_supported"]
