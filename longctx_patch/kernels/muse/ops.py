"""MuSe's dispatch (`muse_attention`: the tilted or the cells far field, the Triton kernels or the PyTorch
reference) and the `autograd.Function`s of the Triton paths (their kernels: `triton_planned.py`, `triton_cells.py`,
imported once the backend chose "triton").
"""

from __future__ import annotations

import torch

from ...errors import ConfigError
from ..backend import BACKENDS, resolve_backend
from .reference_cells import CellsPlan, cell_summaries, cells_reference, list_plan, make_cells_plan
from .plan import MusePlan, make_plan
from .reference import muse_reference_planned
from .reference_tilted_cells import make_tilt_plan, tilted_cells_reference
from .options import DEFAULT_OPTIONS, FAR_FIELDS, MuseOptions, check_options
from .support import DEFAULT_TILES, MuseTiles, cells_supported, check_tiles, triton_supported


def muse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                   options: MuseOptions = DEFAULT_OPTIONS, key_mask: torch.Tensor | None = None,
                   backend: str = "auto", plan: MusePlan | None = None, tiles: MuseTiles | None = None) -> torch.Tensor:
    """Causal MuSe attention.

    q `[B, Hq, S, D]`, k/v `[B, Hkv, S, D]` (post-rotary; `Hq % Hkv == 0`), any S.
    key_mask `[B, S]` bool (True = real token) or None. Returns o `[B, S, Hq, D]` in q's dtype (under autocast, as
    SDPA: in the autocast dtype; k and v of another dtype than q are cast to it).

    options: what MuSe computes (`options.MuseOptions`: the far field, block_size, the clusters, what is retrieved
    exactly; methods/muse's `MuseConfig.kernel_options()` gives a config's). `plan`: a precomputed `make_plan(...)`
    of the tilted far field (then the clustering options are unused).
    Triton path: L a power of two in 16..128, q_clusters * k_clusters in 16..64 (powers of two), D a power
    of two; for the backward L * D <= 8192.
    backend: "auto" (Triton on CUDA when supported, else the PyTorch reference), "torch" (the reference) or "triton".
    Cells Triton path (cells, tilted-cells): block_size a multiple of 128, D <= 128 (zero-padded to a power of two in
    16..128).
    tiles: launch tiles of the cells and tilted-cells kernels replacing their defaults (`support.MuseTiles`; None: the
    defaults; benchmarks sweep them); they change no result beyond the order of sums.
    """
    o = check_options(options)
    tiles = check_tiles(tiles)
    if backend not in BACKENDS:
        raise ConfigError(f"muse backend={backend!r}; allowed: {', '.join(BACKENDS)}")
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ConfigError(f"muse_attention: expected q [B,Hq,S,D], k/v [B,Hkv,S,D]; got {tuple(q.shape)}, {tuple(k.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ConfigError(f"muse_attention: {q.shape[1]} query heads is not a multiple of {k.shape[1]} kv heads")
    if torch.is_autocast_enabled(q.device.type):  # as SDPA under autocast: the attention runs in the autocast dtype
        dt = torch.get_autocast_dtype(q.device.type)
        q, k, v = (t.to(dt) for t in (q, k, v))
    elif not q.dtype == k.dtype == v.dtype:  # mixed inputs run in q's dtype
        k, v = k.to(q.dtype), v.to(q.dtype)
    if o.far_field == "tilted-cells":
        return _tilted_cells(q, k, v, o, scale=scale, key_mask=key_mask, backend=backend, tiles=tiles)
    if o.far_field == "cells":
        return _cells(q, k, v, o, scale=scale, key_mask=key_mask, backend=backend, tiles=tiles)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    why = triton_supported(q, block_size=o.block_size, q_clusters=o.q_clusters, k_clusters=o.k_clusters,
                           dipole=o.dipole, needs_grad=needs_grad)
    be = resolve_backend(backend, q, what="muse")  # backend='triton' where it cannot run: a DeviceError
    if be == "triton" and why is not None:
        if backend == "triton":
            raise ConfigError(f"muse backend='triton' cannot run: {why}; use backend='torch' or change the setting")
        if triton_supported(q, block_size=o.block_size, q_clusters=o.q_clusters, k_clusters=o.k_clusters,
                            dipole=o.dipole) is None:
            # auto on the GPU, a forward the kernels take but not its backward: the dense reference would not fit
            # at the lengths the Triton path is for, so say what to change
            raise ConfigError(f"muse: {why}")
        be = "torch"
    if plan is None:
        plan = make_plan(
            q.detach(),
            k.detach(),
            scale=scale,
            block_size=o.block_size,
            q_clusters=o.q_clusters,
            k_clusters=o.k_clusters,
            kmeans_iters=o.kmeans_iters,
            topk_clusters=o.topk_clusters,
            topk_blocks=o.topk_blocks,
            local_blocks=o.local_blocks,
            key_mask=key_mask,
            backend=_plan_backend(be),
        )
    if be == "triton":
        return muse_triton_planned(q, k, v, plan, scale=scale)
    return muse_reference_planned(q, k, v, plan, scale=scale, dipole=o.dipole)


def _plan_backend(backend: str) -> str:
    """The plan's kernels follow the attention backend: PyTorch for "torch"; for "triton", the Triton plan
    kernels where they take the inputs (bf16 keys for the clustering), PyTorch elsewhere."""
    return "torch" if backend == "torch" else "auto"


def _kernel_head_dim(D: int) -> int:
    """The head_dim the cells kernels run at: D rounded up to a power of two, at least 16."""
    return max(16, 1 << (D - 1).bit_length())


def _cells_backend(q, backend: str, block_size: int) -> str:
    """The backend of the cells kernels' family (cells, tilted-cells): "triton" where `cells_supported` takes the input
    (backend='triton' where it does not: a ConfigError that says why), else "torch"."""
    why = cells_supported(q, block_size=block_size)
    be = resolve_backend(backend, q, what="muse")  # backend='triton' where it cannot run: a DeviceError
    if be == "triton" and why is not None:
        if backend == "triton":
            raise ConfigError(f"muse backend='triton' cannot run: {why}; use backend='torch' or change the setting")
        be = "torch"
    return be


def _kernel_inputs(q, k, v, be: str):
    """q, k, v zero-padded to the kernels' head_dim on the Triton path (zero columns change no dot product or
    distance: the same plan and output, sliced back to D)."""
    D = q.shape[-1]
    Dp = _kernel_head_dim(D) if be == "triton" else D
    if Dp != D:
        q, k, v = (torch.nn.functional.pad(t, (0, Dp - D)) for t in (q, k, v))
    return q, k, v


def _cells_plan_options(o: MuseOptions) -> dict:
    """The options of the cells plan (`make_cells_plan`; `make_tilt_plan` takes them and q_clusters)."""
    return dict(block_size=o.block_size, k_clusters=o.k_clusters, kmeans_iters=o.kmeans_iters,
                topk_blocks=o.topk_blocks, peak_blocks=o.peak_blocks, local_blocks=o.local_blocks,
                sink_blocks=o.sink_blocks)


def _cells(q, k, v, o: MuseOptions, *, scale, key_mask, backend, tiles):
    be = _cells_backend(q, backend, o.block_size)
    D = q.shape[-1]
    q, k, v = _kernel_inputs(q, k, v, be)
    plan = make_cells_plan(q.detach(), k.detach(), scale=scale, key_mask=key_mask, backend=_plan_backend(be),
                           **_cells_plan_options(o))
    if be == "triton":
        return cells_triton(q, k, v, plan, scale=scale, tiles=tiles)[..., :D]
    return cells_reference(q, k, v, plan, scale=scale)


def _tilted_cells(q, k, v, o: MuseOptions, *, scale, key_mask, backend, tiles):
    """The tilted-cells far field: the Triton kernels (`triton_tilted.py`, `triton_tilted_bwd.py`) where the cells
    kernels run, else the reference."""
    be = _cells_backend(q, backend, o.block_size)
    D = q.shape[-1]
    q, k, v = _kernel_inputs(q, k, v, be)
    plan = make_tilt_plan(q.detach(), k.detach(), scale=scale, q_clusters=o.q_clusters, key_mask=key_mask,
                          backend=_plan_backend(be), tiles=tiles, **_cells_plan_options(o))
    if be == "triton":
        return tilted_cells_triton(q, k, v, plan, scale=scale, tiles=tiles)[..., :D]
    return tilted_cells_reference(q, k, v, plan, scale=scale)


def tilted_cells_triton(q, k, v, plan, *, scale: float, tiles: MuseTiles | None = None) -> torch.Tensor:
    """`tilted_cells_reference` through the Triton kernels, forward and backward (the plan a constant).
    q [B, Hq, S, D], k/v [B, Hkv, S, D] of one dtype, D a power of two in 16..128, block_size a multiple of 128
    -> o [B, S, Hq, D]. tiles: the kernels' launch tiles, the backward's included (`support.MuseTiles`; None: the
    defaults)."""
    return _TiltedCellsAttention.apply(q, k, v, plan, float(scale), check_tiles(tiles))


class _TiltedCellsAttention(torch.autograd.Function):
    """The tilted-cells attention with the plan fixed (`triton_tilted.tilted_cells_forward`,
    `triton_tilted_bwd.tilted_cells_bwd`): differentiable in q, k, v; the plan (clusters, cells, retrieval) is a
    constant, as in the reference."""

    @staticmethod
    def forward(ctx, q, k, v, plan, scale: float, tiles: MuseTiles):
        from .triton_tilted import tilted_cells_forward

        o, saved, ctx.meta = tilted_cells_forward(q, k, v, plan, scale, tiles=tiles)
        ctx.save_for_backward(*saved)
        return o

    @staticmethod
    def backward(ctx, do):
        from .triton_tilted_bwd import tilted_cells_bwd

        return (*tilted_cells_bwd(ctx.saved_tensors, ctx.meta, do), None, None, None)


class _MuseFn(torch.autograd.Function):
    """Planned MuSe attention on the Triton kernels (`triton_planned.muse_fwd` / `muse_bwd`)."""

    @staticmethod
    def forward(ctx, q, k, v, plan: MusePlan, scale: float):
        from .triton_planned import muse_fwd

        o, saved, ctx.meta = muse_fwd(q, k, v, plan, scale)
        ctx.save_for_backward(*saved)
        return o[:, :, :q.shape[2]]

    @staticmethod
    def backward(ctx, do):
        from .triton_planned import muse_bwd

        return (*muse_bwd(ctx.saved_tensors, ctx.meta, do), None, None)


def muse_triton_planned(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: MusePlan, *,
                        scale: float) -> torch.Tensor:
    """q [B, Hq, S, D], k/v [B, Hkv, S, D] -> o [B, S, Hq, D] (q's dtype); differentiable in q, k, v."""
    k = k.to(q.dtype)
    o = _MuseFn.apply(q, k, v, plan, float(scale))
    return o.transpose(1, 2)


class _CellsAttention(torch.autograd.Function):
    """The cells attention with the plan fixed (`triton_cells.cells_fwd` / `cells_bwd`): inputs q, k, v (exact keys)
    and the cell means mu, vbar ([B, Hkv, nb, Ck, D], differentiable functions of k and v computed outside by
    `cell_summaries`); `tiles` the kernels' launch tiles (the backward runs with the forward's)."""

    @staticmethod
    def forward(ctx, q, k, v, mu, vbar, plan: CellsPlan, scale: float, tiles: MuseTiles):
        from .triton_cells import cells_fwd

        O, saved, ctx.meta = cells_fwd(q, k, v, mu, vbar, plan, scale, tiles)
        ctx.save_for_backward(*saved)
        return O[:, :, :q.shape[2]].transpose(1, 2)

    @staticmethod
    def backward(ctx, do):
        from .triton_cells import cells_bwd

        return (*cells_bwd(ctx.saved_tensors, ctx.meta, do), None, None, None)


def cells_triton(q, k, v, plan: CellsPlan, *, scale: float, tiles: MuseTiles | None = None) -> torch.Tensor:
    """`cells_reference` through the Triton kernels (forward, and the backward when gradients are needed).
    q [B, Hq, S, D], k/v [B, Hkv, S, D] -> o [B, S, Hq, D]. Needs `block_size` a multiple of 128 and D a power
    of two. q, k and v share one dtype (`muse_attention` casts mixed inputs). The cell means are computed
    (differentiably) in that dtype with fp32 accumulation, and kept in it under autocast. tiles: the kernels' launch
    tiles, the backward's included (`support.MuseTiles`; None: the defaults)."""
    mu, vbar = cell_summaries(k, v, plan)
    return _CellsAttention.apply(q, k, v, mu.to(q.dtype), vbar.to(q.dtype), plan, scale, check_tiles(tiles))


def listed_blocks_triton(q, k, v, retrieved: torch.Tensor, key_valid: torch.Tensor, *, block_size: int,
                         max_listed: int, scale: float) -> torch.Tensor:
    """Exact attention of every query block to its listed earlier blocks and its own block (causally), nothing else:
    the cells kernels without a far field (`cells.list_plan`), forward and backward. q [B, Hq, S, D], k/v
    [B, Hkv, S, D] of one dtype, retrieved [B, Hq, nb, nb] bool (m < n only), key_valid [B, nb * block_size] bool
    (the listed blocks' keys all real) -> o [B, S, Hq, D]. block_size a multiple of 128, D <= 128 (`cells_supported`;
    a D off the kernels' grid runs zero-padded)."""
    why = cells_supported(q, block_size=block_size)
    if why is not None:
        raise ConfigError(f"block-list kernels: {why}")
    D = q.shape[-1]
    q, k, v = _kernel_inputs(q, k, v, "triton")
    plan = list_plan(retrieved, key_valid, block_size=block_size, max_listed=max_listed)
    return _CellsAttention.apply(q, k, v, None, None, plan, float(scale), DEFAULT_TILES)[..., :D]
