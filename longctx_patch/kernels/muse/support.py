"""Which inputs the MuSe Triton kernels take, and their launch tiles: pure Python (no Triton import), so that the
dispatchers (`ops.py`, `plan.py`, `reference_cells.py`) check them on any install.

- `triton_supported` / `cells_supported`: the attention kernels of the tilted and the cells far field
  (`triton_planned.py`, `triton_cells.py`);
- `lloyd_supported`, `block_scores_supported`, `block_peaks_supported` and the tiles `scores_tiles`, `peaks_tiles`:
  the plan kernels (`triton_cluster.py`);
- `MuseTiles`: launch tiles that replace the kernels' defaults, passed down as `tiles=` (benchmarks sweep them).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ...errors import ConfigError
from ..backend import next_power_of_2


def triton_supported(
    q: torch.Tensor, *, block_size: int, q_clusters: int, k_clusters: int, dipole: bool, needs_grad: bool = False
) -> str | None:
    """None when the Triton kernels can run these inputs/settings, else the reason they cannot."""
    D = q.shape[-1]
    # shared memory (227 KB per block on the H100/H200), from tests/compile_sm90.py: the kernels hold
    # [block_size, D] tiles of the input dtype; the forward fits up to 32 KB per tile (bf16 128 x 128: 192 KB;
    # bf16 128 x 256: 320 KB), the backward up to 16 KB (bf16 128 x 64: 164 KB; fp32 128 x 64: 400 KB)
    tile = block_size * D * q.element_size()
    if tile > 32768:
        return (f"block_size {block_size} x head_dim {D} in {q.dtype} needs more shared memory than an H100/H200 "
                f"block has; use block_size <= {max(16, 32768 // (D * q.element_size()))}")
    if needs_grad and tile > 16384:
        return (f"the backward kernels need block_size * head_dim * {q.element_size()} bytes <= 16384 (shared memory); "
                f"got {block_size} x {D} in {q.dtype}: use block_size <= {max(16, 16384 // (D * q.element_size()))} "
                "for training")
    if dipole:
        return "the dipole term is only implemented in the reference"
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"dtype {q.dtype} (Triton path takes fp16/bf16/fp32)"
    pow2 = lambda x: x > 0 and (x & (x - 1)) == 0  # noqa: E731
    if not (pow2(D) and 16 <= D <= 256):
        return f"head_dim {D} (Triton path needs a power of two in 16..256)"
    if not (pow2(block_size) and 16 <= block_size <= 128):
        return f"block_size {block_size} (Triton path needs a power of two in 16..128)"
    if not (pow2(q_clusters) and pow2(k_clusters) and q_clusters * k_clusters >= 16):
        return "q_clusters and k_clusters must be powers of two with q_clusters * k_clusters >= 16"
    if q_clusters * k_clusters > 64:
        return "q_clusters * k_clusters > 64"
    return None


def cells_supported(q: torch.Tensor, *, block_size: int) -> str | None:
    """None if the cells Triton kernels can run these inputs, else what to change. A head_dim that is not a power
    of two in 16..128 runs zero-padded to the next one (`_cells`)."""
    D = q.shape[-1]
    if block_size % 128:
        return f"block_size {block_size} must be a multiple of 128 for the cells kernel"
    if D > 128:
        return f"head_dim {D} must be <= 128 (shared memory of the backward kernels)"
    return None


def lloyd_supported(x: torch.Tensor, C: int) -> str | None:
    """None when `lloyd_triton` takes x [N, L, D] and C clusters, else why not."""
    L, D = x.shape[1], x.shape[2]
    if x.dtype != torch.bfloat16:
        return f"dtype {x.dtype} (the clustering kernel takes bf16 tokens)"
    if D & (D - 1) or not 16 <= D <= 256:
        return f"head_dim {D} is not a power of two in 16..256"
    if next_power_of_2(L) * D > 256 * 128:
        return f"a block of {L} x {D} does not fit one program's registers"
    if C > 256:
        return f"{C} clusters > 256"
    return None


def scores_tiles(D: int, Ck: int) -> tuple[int, int]:
    """(query blocks, key blocks) per tile of `_block_scores_kernel`: [16, D] x [D, 128 or 64 cells]."""
    return 16, max(1, (128 if D <= 64 else 64) // Ck)


def block_scores_supported(D: int, Ck: int) -> bool:
    return not D & (D - 1) and 16 <= D <= 256 and not Ck & (Ck - 1) and Ck <= 128


def block_peaks_supported(k: torch.Tensor, L: int, G: int) -> bool:
    """bf16 keys (fp32 ones take the PyTorch code), D a power of two in 16..128, L a multiple of the key tile, at
    most 64 query heads per kv head."""
    D = k.shape[-1]
    return (k.dtype == torch.bfloat16 and not D & (D - 1) and 16 <= D <= 128 and G <= 64
            and L % peaks_tiles(D, L, G)[2] == 0)


def peaks_tiles(D: int, L: int, G: int, tiles: tuple[int, int, int] | None = None) -> tuple[int, int, int, int, int]:
    """(query blocks NT, query heads GP, keys BL) per tile of `_block_peaks_kernel`, its warps and pipeline stages:
    128 rows (GP * NT) per key tile; no register spills on sm_90 (cuobjdump) and shared memory within 227 KB (the
    pipeline buffers every key tile of a block: L / BL loads x stages). tiles: (keys per tile, warps, stages) instead
    of the defaults (benchmarks/ops/bench_muse_cells.py times the choices)."""
    GP = next_power_of_2(G)
    BL, warps, stages = tiles or ((64, 4, 3) if D <= 64 else (64, 8, 2))
    return max(2, 128 // GP), GP, min(L, BL), warps, stages


# MuseTiles' fields: what each tuple holds, and its entries' kinds (t: a tile, a power of two >= 16; w: warps, a power
# of two <= 32; s: pipeline stages >= 1; n: a count >= 1)
TILE_FIELDS = {
    "cells_fwd": ("query tile, key tile, warps, stages", "ttws"),
    "cells_dkdv": ("key tile, query tile, warps, stages", "ttws"),
    "tilted_far": ("query tile, cell tile, warps, stages", "ttws"),
    "tilted_summ": ("centroids, keys per step, warps", "ttw"),
    "tilted_dq": ("query tile, cell tile, warps", "ttw"),
    "tilted_dsumm": ("query rows, cell tile, warps", "ttw"),
    "tilted_sbwd": ("centroids, keys per step, warps", "ttw"),
    "cluster_nearest": ("tokens, centroids, warps", "ttw"),
    "cluster_member": ("centroids per program, tokens per step, warps, stages, token chunks", "ttwsn"),
}


@dataclass(frozen=True)
class MuseTiles:
    """Launch tiles of the cells and tilted-cells kernels and of the tilted plan's clustering that replace the
    defaults, for one call (whatever its head_dim and dtype: a caller sweeping them picks them per shape); None: the
    default of that launch. They change how the kernels run, never what they compute (up to the order of sums).
    Passed as `tiles=` to `ops.muse_attention`, `ops.cells_triton`, `ops.tilted_cells_triton`,
    `reference_tilted_cells.make_tilt_plan` / `cluster_queries` and down to the launches; a backward runs with its
    forward's tiles.

    cells_fwd: the cells forward kernel (`triton_cells.cells_tiles`' fwd; also the exact part of tilted-cells);
    cells_dkdv: its dK/dV kernel; tilted_far / tilted_summ: the tilted forward's far field and summaries
    (`triton_tilted.tilted_tiles`); tilted_dq / tilted_dsumm / tilted_sbwd: its backward's kernels
    (`triton_tilted_bwd.tilted_bwd_tiles`); cluster_nearest / cluster_member: a round of the query clustering
    (`triton_cluster.nearest_with_sums`). Each tuple's entries: `TILE_FIELDS`."""

    cells_fwd: tuple[int, int, int, int] | None = None
    cells_dkdv: tuple[int, int, int, int] | None = None
    tilted_far: tuple[int, int, int, int] | None = None
    tilted_summ: tuple[int, int, int] | None = None
    tilted_dq: tuple[int, int, int] | None = None
    tilted_dsumm: tuple[int, int, int] | None = None
    tilted_sbwd: tuple[int, int, int] | None = None
    cluster_nearest: tuple[int, int, int] | None = None
    cluster_member: tuple[int, int, int, int, int] | None = None

    def __post_init__(self):
        pow2 = lambda x: x > 0 and (x & (x - 1)) == 0  # noqa: E731
        ok = {"t": lambda x: pow2(x) and x >= 16, "w": lambda x: pow2(x) and x <= 32, "s": lambda x: x >= 1,
              "n": lambda x: x >= 1}
        for name, (what, kinds) in TILE_FIELDS.items():
            value = getattr(self, name)
            if value is None:
                continue
            good = isinstance(value, (tuple, list)) and len(value) == len(kinds) and all(
                isinstance(x, int) and not isinstance(x, bool) and ok[kd](x) for x, kd in zip(value, kinds))
            if not good:
                raise ValueError(f"MuseTiles.{name}={value!r}: allowed None or ({what}), tiles powers of two >= 16, "
                                 "warps a power of two <= 32, stages and counts >= 1")
            object.__setattr__(self, name, tuple(value))

    def replace(self, **changes) -> "MuseTiles":
        """These tiles with `changes`; a ValueError names a key that is not a field."""
        unknown = sorted(set(changes) - set(TILE_FIELDS))
        if unknown:
            raise ValueError(f"not MuSe tiles: {', '.join(unknown)}; the fields: {', '.join(TILE_FIELDS)}")
        return dataclasses.replace(self, **changes)


DEFAULT_TILES = MuseTiles()


def check_tiles(tiles) -> MuseTiles:
    """`tiles` as passed to an entry point: a MuseTiles, or None for the defaults (anything else: a ConfigError)."""
    if tiles is None:
        return DEFAULT_TILES
    if not isinstance(tiles, MuseTiles):
        raise ConfigError(f"muse: tiles must be a MuseTiles (kernels.muse.support) or None, got {type(tiles).__name__}")
    return tiles


GUARD_TOP_MAX = 64  # the most top rows per head the guard's kernels take (triton_guard.py; guard_rows <= 4 x this)


def guard_kernels_missing(o: torch.Tensor, top: int) -> str | None:
    """None when the guard's kernels (triton_guard.py) take MuSe's output `o` [B, S, Hq, D] and `top` rows per head,
    else why not."""
    from ..backend import attention_kernel_missing

    why = attention_kernel_missing(o, o, o)  # Triton on these tensors, their dtype and head_dim (the estimate: no grad)
    if why is not None:
        return why
    if top > GUARD_TOP_MAX:
        return f"{top} top rows per head: at most {GUARD_TOP_MAX} (guard_rows <= {4 * GUARD_TOP_MAX})"
    return None
