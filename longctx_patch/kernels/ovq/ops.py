"""Chunk-parallel OVQ attention driver (dispatches to Triton or the PyTorch reference).

:func:`ovq_attention` processes new tokens on top of a dictionary state and an open (incomplete)
chunk: the open chunk's keys are prepended so that chunks always start at multiples of
``chunk_size`` of the absolute (cache) position.  Every complete chunk is absorbed into the
dictionary after its queries have attended; an incomplete last chunk is returned as the new open
chunk.  The same code path serves training forwards, prefill and token-by-token decode, so that
prefill-then-decode equals one forward over the same tokens.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ...errors import ConfigError
from .reference import (OVQState, apply_assignments, chunk_attention_ref, merge_keys, plan_growth,
                        update_state)


@dataclass
class OpenChunk:
    """Keys / values / key mask of the tokens of the current, not yet absorbed chunk."""
    keys: Tensor    # [B, H, b, D]
    values: Tensor  # [B, H, b, Dv]
    valid: Tensor   # [B, b] bool

    @property
    def length(self) -> int:
        return self.keys.shape[2]


def _is_pow2(n: int) -> bool:
    return n >= 16 and (n & (n - 1)) == 0


def resolve_backend(backend: str, q: Tensor, k: Tensor, v: Tensor) -> str:
    if backend == "torch":
        return "torch"
    shapes_ok = _is_pow2(q.shape[-1]) and _is_pow2(v.shape[-1]) and q.shape[-1] <= 256
    if backend == "triton":
        if not shapes_ok:
            raise ConfigError(f"backend='triton': the Triton OVQ kernels need power-of-two head dims from 16 to 256, "
                              f"got {q.shape[-1]}; use backend='auto' or 'torch'")
        return "triton"
    # auto: Triton on CUDA, the reference elsewhere
    if q.is_cuda and shapes_ok:
        return "triton"
    return "torch"


def target_int(seen: int, max_centroids: int, growth: float) -> int:
    """Host-side version of :func:`reference.target_centroids` (upper bound on the active rows)."""
    if growth <= 0:
        n = seen
    else:
        n = math.ceil(growth * math.log1p(seen / growth) - 1e-9) if seen > 0 else 0
    return int(min(n, seen, max_centroids))


def ovq_attention(q: Tensor, k: Tensor, v: Tensor, state: OVQState | None, open_chunk: OpenChunk | None,
                  key_valid: Tensor | None, *, chunk_size: int, max_centroids: int, growth: float,
                  backend: str = "auto", seen_bound: int | None = None, exact_assign: bool = True):
    """OVQ attention of new tokens.

    ``q``: ``[B, Hq, S, D]`` (unit-normalised, times beta); ``k``, ``v``: ``[B, H, S, D]``;
    ``key_valid``: ``[B, S]`` bool (True = real token) or None.
    ``seen_bound``: host-side upper bound of the tokens already absorbed (avoids a device sync);
    when None it is read from the state.
    Returns ``(o [B, Hq, S, Dv], state, open_chunk, seen_bound)``.

    With the Triton backend and no gradient needed, the fused path of ``triton_fast`` runs and
    updates ``state`` in place; otherwise the state is never modified (a new one is returned).
    """
    B, Hq, S, D = q.shape
    H = k.shape[1]
    Dv = v.shape[-1]
    C = chunk_size
    be = resolve_backend(backend, q, k, v)
    if state is None:
        state = OVQState.empty(B, H, max_centroids, D, Dv, device=q.device)
        seen_bound = 0
    if seen_bound is None:
        seen_bound = int(state.seen.max().item()) if B > 0 else 0
    if key_valid is None:
        key_valid = torch.ones(B, S, dtype=torch.bool, device=q.device)
    if open_chunk is not None and open_chunk.length > 0:
        kk = torch.cat([open_chunk.keys.to(k.dtype), k], dim=2)
        vv = torch.cat([open_chunk.values.to(v.dtype), v], dim=2)
        valid = torch.cat([open_chunk.valid, key_valid], dim=1)
        off = open_chunk.length
    else:
        kk, vv, valid, off = k, v, key_valid, 0
    L = off + S
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                              or state.key_sums.requires_grad or state.value_sums.requires_grad)
    if be == "triton" and not needs_grad:
        from .triton_fast import ovq_forward_fast
        if not (state.key_sums.is_contiguous() and state.value_sums.is_contiguous() and state.counts.is_contiguous()):
            state = OVQState(state.key_sums.contiguous(), state.value_sums.contiguous(), state.counts.contiguous(),
                             state.n_active, state.seen)
        o, state, start, seen_bound = ovq_forward_fast(q, kk, vv, valid, off, state, seen_bound,
                                                       chunk_size=C, max_centroids=max_centroids, growth=growth,
                                                       exact_assign=exact_assign)
        new_open = OpenChunk(kk[:, :, start:], vv[:, :, start:], valid[:, start:]) if start < L else None
        return o, state, new_open, seen_bound
    if be == "triton":
        from .triton_attn import chunk_attention_triton as attn
    else:
        attn = chunk_attention_ref
    outs = []
    new_open = None
    for s0 in range(0, L, C):
        e = min(s0 + C, L)
        qs = max(s0, off)
        kc, vc, validc = kk[:, :, s0:e], vv[:, :, s0:e], valid[:, s0:e]
        n_dict = target_int(seen_bound, max_centroids, growth)
        if e > qs:
            k_all, v_all, bias = merge_keys(state, kc, vc, validc, n_dict, q.dtype)
            outs.append(attn(q[:, :, qs - off:e - off], k_all, v_all, bias, n_dict, qs - s0))
        if e - s0 == C:
            if be == "triton":
                from .triton_fast import assign_rows_triton
                n_real = validc.sum(-1).to(torch.long)
                n_new = plan_growth(state.seen, state.n_active, n_real, max_centroids, growth)
                assign = assign_rows_triton(kc.detach(), validc, state, n_new, n_dict, exact_assign=exact_assign)
                state = apply_assignments(state, kc, vc, assign, n_new, n_real)
            else:
                state = update_state(state, kc, vc, validc, max_centroids, growth)
            seen_bound += C
        else:
            new_open = OpenChunk(kc.detach(), vc.detach(), validc)
    o = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]
    return o, state, new_open, seen_bound
