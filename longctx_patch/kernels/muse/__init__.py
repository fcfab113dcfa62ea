"""MuSe (multipole semantic attention) kernels: planning, PyTorch reference, Triton forward/backward.

`muse_attention(q, k, v, ...)` is the entry point (see its docstring); docs/muse.md has the maths.
"""

from __future__ import annotations

import torch

from ...errors import ConfigError
from ..backend import BACKENDS, require_triton, resolve_backend
from .plan import MusePlan, lloyd, make_plan
from .reference import muse_reference_planned

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


def muse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    block_size: int = 128,
    q_clusters: int = 8,
    k_clusters: int = 4,
    kmeans_iters: int = 2,
    topk_clusters: int = 4,
    topk_blocks: int = 2,
    peak_blocks: int = 0,
    local_blocks: int = 1,
    sink_blocks: int = 1,
    dipole: bool = False,
    key_mask: torch.Tensor | None = None,
    backend: str = "auto",
    plan: MusePlan | None = None,
    far_field: str = "tilted",
) -> torch.Tensor:
    """Causal MuSe attention.

    q `[B, Hq, S, D]`, k/v `[B, Hkv, S, D]` (post-rotary; `Hq % Hkv == 0`), any S.
    key_mask `[B, S]` bool (True = real token) or None. Returns o `[B, S, Hq, D]` in q's dtype (under autocast, as
    SDPA: in the autocast dtype; k and v of another dtype than q are cast to it).

    block_size L: spatial block (exact attention inside it and over the `local_blocks` blocks before it);
    q_clusters / k_clusters: clusters per block of queries (per query head) and keys (per kv head);
    kmeans_iters: Lloyd iterations; topk_blocks / topk_clusters: earlier blocks / cells (key cluster of a
    block) attended exactly by each query cluster; dipole: first-order correction of the super-keys'
    values (reference only). `plan`: a precomputed `make_plan(...)` (then the clustering options are unused).
    Triton path: L a power of two in 16..128, q_clusters * k_clusters in 16..64 (powers of two), D a power
    of two; for the backward L * D <= 8192.
    backend: "auto" (Triton on CUDA when supported, else the PyTorch reference), "torch" (the reference) or "triton".
    far_field: "tilted" (above) or "cells" (kernels/muse/cells.py: each key cluster of an earlier block is one
    super-key shared by every query; `topk_blocks` retrieved per query block by their estimated attention mass and
    `peak_blocks` more by their best key, plus the `sink_blocks` first blocks with a real key, exact for every query
    block; q_clusters, topk_clusters unused).
    Cells Triton path: block_size a multiple of 128, D <= 128 (zero-padded to a power of two in 16..128).
    """
    if far_field not in ("tilted", "cells"):
        raise ConfigError(f"muse far_field={far_field!r}; allowed: tilted, cells")
    if backend not in BACKENDS:
        raise ConfigError(f"muse backend={backend!r}; allowed: {', '.join(BACKENDS)}")
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ConfigError(f"muse_attention: expected q [B,Hq,S,D], k/v [B,Hkv,S,D]; got {tuple(q.shape)}, {tuple(k.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ConfigError(f"muse_attention: {q.shape[1]} query heads is not a multiple of {k.shape[1]} kv heads")
    if k_clusters > block_size or q_clusters > block_size:
        raise ConfigError("muse: q_clusters and k_clusters must be <= block_size")
    if torch.is_autocast_enabled(q.device.type):  # as SDPA under autocast: the attention runs in the autocast dtype
        dt = torch.get_autocast_dtype(q.device.type)
        q, k, v = (t.to(dt) for t in (q, k, v))
    elif not q.dtype == k.dtype == v.dtype:  # mixed inputs run in q's dtype
        k, v = k.to(q.dtype), v.to(q.dtype)
    if far_field == "cells":
        return _cells(q, k, v, scale=scale, block_size=block_size, k_clusters=k_clusters, kmeans_iters=kmeans_iters,
                      topk_blocks=topk_blocks, peak_blocks=peak_blocks, local_blocks=local_blocks,
                      sink_blocks=sink_blocks, dipole=dipole, key_mask=key_mask, backend=backend)
    if peak_blocks:
        raise ConfigError("muse: peak_blocks needs far_field='cells' (the tilted design retrieves per query cluster)")
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    why = triton_supported(q, block_size=block_size, q_clusters=q_clusters, k_clusters=k_clusters, dipole=dipole,
                           needs_grad=needs_grad)
    if backend == "auto":
        why_fwd = triton_supported(q, block_size=block_size, q_clusters=q_clusters, k_clusters=k_clusters,
                                   dipole=dipole)
        on_gpu = resolve_backend("auto", q, what="muse") == "triton"
        if on_gpu and why is not None and why_fwd is None:
            # the dense reference would not fit at the lengths the Triton path is for: say what to change
            raise ConfigError(f"muse: {why}")
        backend = "triton" if (on_gpu and why is None) else "torch"
    if backend == "triton":
        require_triton("muse", q)
        if why is not None:
            raise ConfigError(f"muse backend='triton' cannot run: {why}; use backend='torch' or change the setting")
    if plan is None:
        plan = make_plan(
            q.detach(),
            k.detach(),
            scale=scale,
            block_size=block_size,
            q_clusters=q_clusters,
            k_clusters=k_clusters,
            kmeans_iters=kmeans_iters,
            topk_clusters=topk_clusters,
            topk_blocks=topk_blocks,
            local_blocks=local_blocks,
            key_mask=key_mask,
            backend=_plan_backend(backend),
        )
    if backend == "triton":
        from .triton_kernels import muse_triton_planned

        return muse_triton_planned(q, k, v, plan, scale=scale)
    return muse_reference_planned(q, k, v, plan, scale=scale, dipole=dipole)


def _plan_backend(backend: str) -> str:
    """The plan's kernels follow the attention backend: PyTorch for "torch"; for "triton", the Triton plan
    kernels where they take the inputs (bf16 keys for the clustering), PyTorch elsewhere."""
    return "torch" if backend == "torch" else "auto"


def cells_supported(q: torch.Tensor, *, block_size: int) -> str | None:
    """None if the cells Triton kernels can run these inputs, else what to change. A head_dim that is not a power
    of two in 16..128 runs zero-padded to the next one (`_cells`)."""
    D = q.shape[-1]
    if block_size % 128:
        return f"block_size {block_size} must be a multiple of 128 for the cells kernel"
    if D > 128:
        return f"head_dim {D} must be <= 128 (shared memory of the backward kernels)"
    return None


def _kernel_head_dim(D: int) -> int:
    """The head_dim the cells kernels run at: D rounded up to a power of two, at least 16."""
    return max(16, 1 << (D - 1).bit_length())


def _cells(q, k, v, *, scale, block_size, k_clusters, kmeans_iters, topk_blocks, peak_blocks, local_blocks,
           sink_blocks, dipole, key_mask, backend):
    from .cells import cells_reference, make_cells_plan

    if dipole:
        raise ConfigError("muse: dipole=True needs far_field='tilted'")
    why = cells_supported(q, block_size=block_size)
    if backend == "triton":
        require_triton("muse", q)
        if why is not None:
            raise ConfigError(f"muse backend='triton' cannot run: {why}; use backend='torch' or change the setting")
    elif backend == "auto":
        backend = "triton" if (resolve_backend("auto", q, what="muse") == "triton" and why is None) else "torch"
    D = q.shape[-1]
    Dp = _kernel_head_dim(D) if backend == "triton" else D
    if Dp != D:  # zero columns change no dot product or distance: the same plan and output, sliced back
        q, k, v = (torch.nn.functional.pad(t, (0, Dp - D)) for t in (q, k, v))
    plan = make_cells_plan(q.detach(), k.detach(), scale=scale, block_size=block_size, k_clusters=k_clusters,
                           kmeans_iters=kmeans_iters, topk_blocks=topk_blocks, peak_blocks=peak_blocks,
                           local_blocks=local_blocks, sink_blocks=sink_blocks, key_mask=key_mask,
                           backend=_plan_backend(backend))
    if backend == "triton":
        from .cells_triton import cells_triton

        return cells_triton(q, k, v, plan, scale=scale)[..., :D]
    return cells_reference(q, k, v, plan, scale=scale)


__all__ = ["cells_supported", "MusePlan", "make_plan", "lloyd", "muse_attention", "muse_reference_planned", "triton_supported"]
