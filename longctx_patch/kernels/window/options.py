"""The launch tiles of the sliding-window forward kernel (`triton_window.py`), passed down as `tiles=` from
`window_attention_triton`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WindowTiles:
    """Launch tiles of the Triton forward (`window_attention_triton`) that replace the defaults for one call; None: the
    default of that tile for the call's head dim and dtype (`triton_window.window_tiles`). They change how the kernel
    runs, never what it computes (up to the order of sums).

    block_rows: stacked query-head rows per program; block_keys: keys per tile (each a power of two >= 16); warps: a
    power of two <= 32; stages: software-pipelining stages, >= 1."""

    block_rows: int | None = None
    block_keys: int | None = None
    warps: int | None = None
    stages: int | None = None

    def __post_init__(self):
        pow2 = lambda x: x > 0 and (x & (x - 1)) == 0  # noqa: E731
        rules = {"block_rows": (lambda x: pow2(x) and x >= 16, "a power of two >= 16"),
                 "block_keys": (lambda x: pow2(x) and x >= 16, "a power of two >= 16"),
                 "warps": (lambda x: pow2(x) and x <= 32, "a power of two <= 32"),
                 "stages": (lambda x: x >= 1, "an int >= 1")}
        for name, (ok, allowed) in rules.items():
            value = getattr(self, name)
            if value is None:
                continue
            if not (isinstance(value, int) and not isinstance(value, bool) and ok(value)):
                raise ValueError(f"WindowTiles.{name}={value!r}: allowed None (the default) or {allowed}")


__all__ = ["WindowTiles"]
