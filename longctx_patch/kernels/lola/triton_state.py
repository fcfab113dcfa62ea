"""Triton kernels of the LoLA linear state (forward only), each matched against `reference.py`
(tests/test_lola_kernels.py):

  chunk_states      prefix linear states at every `state_chunk` keys      <- cumsum in hybrid_attention_chunked
  fold_into_state   H += sum w phi(k) v^T, s += sum w phi(k)               <- fold
  local_states      the state each key block of a two-pass prefill starts from (after the evictions)

They run under TRITON_INTERPRET=1 on the CPU (small shapes) and on CUDA. Works with triton 3.6 and 3.9.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..backend import INTERPRET
from ..triton_lib import dot, dot_precision, np2
from .tuning import DEFAULT_TUNING, LolaTuning


# ------------------------------------------------------------------------------------------- prefix states
@triton.jit
def _chunk_sums_kernel(
    FK, V, KM, OUT, OUTS,
    N, F2, D, G, OFF,
    s_fk_b, s_fk_h, s_fk_n,
    s_v_b, s_v_h, s_v_n,
    s_km_b,
    s_o_b, s_o_h, s_o_n, s_o_f,
    s_os_b, s_os_h, s_os_n,
    HQ: tl.constexpr, CS: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr,
    HAS_KM: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr = INTERPRET,
):
    """OUT[:, :, c + 1] = sum of phi(k) v^T over the keys c*CS - OFF .. (c+1)*CS - OFF - 1 that lie in [0, N)
    (and OUTS the sum of phi(k)); slot 0 is left alone."""
    pid_bh = tl.program_id(0).to(tl.int64)  # 64-bit base offsets (docs/PERFORMANCE.md, "Large shapes")
    c = tl.program_id(1)
    pid_kv = tl.program_id(2)
    pid_k = pid_kv // NV
    pid_v = pid_kv % NV
    b = pid_bh // HQ
    h = pid_bh % HQ
    hk = h // G
    offs_k = pid_k * BK + tl.arange(0, BK)
    offs_v = pid_v * BV + tl.arange(0, BV)
    mk = offs_k < F2
    mv = offs_v < D
    hacc = tl.zeros([BK, BV], dtype=tl.float32)
    sacc = tl.zeros([BK], dtype=tl.float32)
    for t0 in range(0, CS, BT):
        offs_t = c * CS - OFF + t0 + tl.arange(0, BT)
        mt = (offs_t >= 0) & (offs_t < N)
        if HAS_KM:
            mt = mt & (tl.load(KM + b * s_km_b + offs_t, mask=mt, other=0) != 0)
        fk = tl.load(FK + b * s_fk_b + h * s_fk_h + offs_t[:, None] * s_fk_n + offs_k[None, :],
                     mask=mt[:, None] & mk[None, :], other=0.0)
        vv = tl.load(V + b * s_v_b + hk * s_v_h + offs_t[:, None] * s_v_n + offs_v[None, :],
                     mask=mt[:, None] & mv[None, :], other=0.0)
        hacc += dot(tl.trans(fk.to(vv.dtype)), vv, PREC, UPCAST)
        sacc += tl.sum(fk.to(tl.float32), 0)
    tl.store(OUT + b * s_o_b + h * s_o_h + (c + 1).to(tl.int64) * s_o_n + offs_k[:, None] * s_o_f + offs_v[None, :],
             hacc, mask=mk[:, None] & mv[None, :])
    if pid_v == 0:
        tl.store(OUTS + b * s_os_b + h * s_os_h + (c + 1).to(tl.int64) * s_os_n + offs_k, sacc, mask=mk)


def _range_sums(fk, v, km, H, S, n_slots: int, cs: int, off: int, h_strides, s_strides) -> None:
    """Launch `_chunk_sums_kernel`: slot c + 1 of H / S (c < n_slots) = the sums over keys c*cs - off ..
    (c+1)*cs - off - 1. h_strides = (batch, head, slot, feature) of H, s_strides = (batch, head, slot) of S;
    km [B, N] int8 or None."""
    B, Hq, N, F2 = fk.shape
    D = v.shape[-1]
    BK, BV = min(64, np2(F2)), min(64, np2(D))
    NV = triton.cdiv(D, BV)
    _chunk_sums_kernel[(B * Hq, n_slots, triton.cdiv(F2, BK) * NV)](
        fk, v, km if km is not None else fk, H, S,
        N, F2, D, Hq // v.shape[1], off,
        fk.stride(0), fk.stride(1), fk.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        km.stride(0) if km is not None else 0,
        *h_strides, *s_strides,
        HQ=Hq, CS=cs, BT=min(64, cs & -cs), BK=BK, BV=BV, NV=NV, HAS_KM=km is not None, PREC=dot_precision(fk, v),
    )


def chunk_states(fk, v, state_chunk: int, key_mask=None, H0=None, s0=None):
    """Hs[:, :, n] = H0 + sum_{j < n * state_chunk} phi(k_j) v_j^T (fp32), n = 0 .. ceil(N / state_chunk) - 1.

    One parallel kernel writes each chunk's sum into slot c + 1 (slot 0 = H0), then a cumulative sum over
    the slots gives every prefix state. fk [B, Hq, N, F2], v [B, Hkv, N, D], key_mask [B, N] bool or None.
    Returns (Hs [B, Hq, NS, F2, D], Ss [B, Hq, NS, F2]).
    """
    B, Hq, N, F2 = fk.shape
    D = v.shape[-1]
    NS = max(1, math.ceil(N / state_chunk))
    Hs = torch.empty(B, Hq, NS, F2, D, device=fk.device, dtype=torch.float32)
    Ss = torch.empty(B, Hq, NS, F2, device=fk.device, dtype=torch.float32)
    if H0 is not None:
        Hs[:, :, 0] = H0
        Ss[:, :, 0] = s0
    else:
        Hs[:, :, 0] = 0
        Ss[:, :, 0] = 0
    if NS > 1:
        km = key_mask.to(torch.int8).contiguous() if key_mask is not None else None
        _range_sums(fk, v, km, Hs, Ss, NS - 1, state_chunk, 0,
                    (Hs.stride(0), Hs.stride(1), Hs.stride(2), Hs.stride(3)),
                    (Ss.stride(0), Ss.stride(1), Ss.stride(2)))
        Hs = torch.cumsum(Hs, dim=2)
        Ss = torch.cumsum(Ss, dim=2)
    return Hs, Ss


# ------------------------------------------------------------------------------------------- fold
@triton.jit
def _fold_kernel(
    FK, V, W, H, S,
    N, F2, D, G, GW,
    s_fk_b, s_fk_h, s_fk_n,
    s_v_b, s_v_h, s_v_n,
    s_w_b, s_w_h,
    s_h_b, s_h_h, s_h_f,
    s_s_b, s_s_h,
    HQ: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr = INTERPRET,
):
    pid_bh = tl.program_id(0).to(tl.int64)  # 64-bit base offsets (docs/PERFORMANCE.md, "Large shapes")
    pid_k = tl.program_id(1)
    pid_v = tl.program_id(2)
    b = pid_bh // HQ
    h = pid_bh % HQ
    hv = h // G
    offs_k = pid_k * BK + tl.arange(0, BK)
    offs_v = pid_v * BV + tl.arange(0, BV)
    mk = offs_k < F2
    mv = offs_v < D
    hp = H + b * s_h_b + h * s_h_h + offs_k[:, None] * s_h_f + offs_v[None, :]
    hacc = tl.load(hp, mask=mk[:, None] & mv[None, :], other=0.0)
    # the sum of w phi(k) as a dot with ones, in H's 2-D layout, stored from column 0 of the pid_v == 0 programs:
    # the [BK] slice-layout form stored under a branch is the pattern that raced in _ev_fold_kernel (see there)
    sacc = tl.zeros([BK, BV], dtype=tl.float32)
    ones = tl.full([BN, BV], 1.0, tl.float32)
    for n0 in range(0, N, BN):
        offs_n = n0 + tl.arange(0, BN)
        mn = offs_n < N
        w = tl.load(W + b * s_w_b + (h // GW) * s_w_h + offs_n, mask=mn, other=0.0).to(tl.float32)
        fk = tl.load(FK + b * s_fk_b + h * s_fk_h + offs_n[:, None] * s_fk_n + offs_k[None, :],
                     mask=mn[:, None] & mk[None, :], other=0.0).to(tl.float32) * w[:, None]
        vv = tl.load(V + b * s_v_b + hv * s_v_h + offs_n[:, None] * s_v_n + offs_v[None, :],
                     mask=mn[:, None] & mv[None, :], other=0.0).to(tl.float32)
        hacc += dot(tl.trans(fk), vv, PREC, UPCAST)
        sacc += tl.dot(tl.trans(fk), ones, input_precision="ieee")
    tl.store(hp, hacc, mask=mk[:, None] & mv[None, :])
    col0 = mk[:, None] & (offs_v[None, :] == 0)
    sp = S + b * s_s_b + h * s_s_h + offs_k[:, None] + 0 * offs_v[None, :]
    tl.store(sp, tl.load(sp, mask=col0, other=0.0) + sacc, mask=col0)


def fold_into_state(fk, v, w, H, s, tuning: LolaTuning = DEFAULT_TUNING):
    """In place: H += sum_j w_j phi(k_j) v_j^T, s += sum_j w_j phi(k_j).

    fk [B, Hq, N, F2], v [B, Hv, N, D] (Hv = Hq or Hkv), w [B, Hw, N] float (Hq % Hw == 0: query head h reads
    the weights of h // (Hq / Hw)), H [B, Hq, F2, D] / s [B, Hq, F2] contiguous fp32. Returns (H, s)."""
    B, Hq, N, F2 = fk.shape
    D = v.shape[-1]
    G = Hq // v.shape[1]
    GW = Hq // w.shape[1]
    if N == 0:
        return H, s
    assert H.is_contiguous() and s.is_contiguous() and H.dtype == torch.float32
    w = w.float().contiguous()
    # 32: 2-3% faster lola prefill than 64 in one sweep, 16 slower; within run-to-run noise (docs/PERFORMANCE.md)
    blk = tuning.fold_block or 32
    BK = min(blk, np2(F2))
    BV = min(blk, np2(D))
    grid = (B * Hq, triton.cdiv(F2, BK), triton.cdiv(D, BV))
    _fold_kernel[grid](
        fk, v, w, H, s,
        N, F2, D, G, GW,
        fk.stride(0), fk.stride(1), fk.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        w.stride(0), w.stride(1),
        H.stride(0), H.stride(1), H.stride(2),
        s.stride(0), s.stride(1),
        HQ=Hq, BN=min(64, np2(N)), BK=BK, BV=BV, PREC="ieee",
    )
    return H, s


# ------------------------------------------------------------------------------------------- local states
@triton.jit
def _local_states_kernel(
    FK, V, KM, HALL, SALL, HS, SS,
    N, NB, n_ev, C, W, F2, D, G,
    s_fk_b, s_fk_h, s_fk_n,
    s_v_b, s_v_h, s_v_n,
    s_km_b,
    s_ha_c, s_ha_b, s_ha_h, s_ha_f,
    s_sa_c, s_sa_b, s_sa_h,
    s_hs_b, s_hs_h, s_hs_n, s_hs_f,
    s_ss_b, s_ss_h, s_ss_n,
    HQ: tl.constexpr, CS: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr,
    HAS_KM: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr = INTERPRET,
):
    """HS[:, :, n] = H_all[c] + sum of phi(k) v^T over the keys from chunk c's first buffered key
    (c*C - W, or 0) to n*CS, for the blocks n of chunk c (block n holds keys of chunk (n*CS + W) // C)."""
    pid_bh = tl.program_id(0).to(tl.int64)  # 64-bit base offsets (docs/PERFORMANCE.md, "Large shapes")
    c = tl.program_id(1)
    pid_kv = tl.program_id(2)
    pid_k = pid_kv // NV
    pid_v = pid_kv % NV
    b = pid_bh // HQ
    h = pid_bh % HQ
    offs_k = pid_k * BK + tl.arange(0, BK)
    offs_v = pid_v * BV + tl.arange(0, BV)
    mk = offs_k < F2
    mv = offs_v < D
    n_lo = tl.maximum(c * C - W, 0) // CS
    # a chunk that starts before key W reads block 0 (its H is 0, nothing evicted yet): each such chunk
    # writes it (the same values), since the chunk that block 0 belongs to, W // C, may lie past the end
    n_hi = tl.minimum(tl.maximum((c + 1) * C - W, CS) // CS, NB)
    slot = tl.minimum(c, n_ev).to(tl.int64)  # H_all has n_ev + 1 slots of B*Hq*F2*D: 2^31 at 32k, chunk 64
    hacc = tl.load(HALL + slot * s_ha_c + b * s_ha_b + h * s_ha_h + offs_k[:, None] * s_ha_f + offs_v[None, :],
                   mask=mk[:, None] & mv[None, :], other=0.0)
    sacc = tl.load(SALL + slot * s_sa_c + b * s_sa_b + h * s_sa_h + offs_k, mask=mk, other=0.0)
    for n in range(n_lo, n_hi):
        n64 = tl.cast(n, tl.int64)  # n is a Python int in the interpreter
        tl.store(HS + b * s_hs_b + h * s_hs_h + n64 * s_hs_n + offs_k[:, None] * s_hs_f + offs_v[None, :], hacc,
                 mask=mk[:, None] & mv[None, :])
        if pid_v == 0:
            tl.store(SS + b * s_ss_b + h * s_ss_h + n64 * s_ss_n + offs_k, sacc, mask=mk)
        for t0 in range(0, CS, BT):
            offs_t = n * CS + t0 + tl.arange(0, BT)
            mt = offs_t < N
            if HAS_KM:
                mt = mt & (tl.load(KM + b * s_km_b + offs_t, mask=offs_t < N, other=0) != 0)
            fk = tl.load(FK + b * s_fk_b + h * s_fk_h + offs_t[:, None] * s_fk_n + offs_k[None, :],
                         mask=mt[:, None] & mk[None, :], other=0.0)
            vv = tl.load(V + b * s_v_b + (h // G) * s_v_h + offs_t[:, None] * s_v_n + offs_v[None, :],
                         mask=mt[:, None] & mv[None, :], other=0.0)
            hacc += dot(tl.trans(fk.to(vv.dtype)), vv, PREC, UPCAST)
            sacc += tl.sum(fk.to(tl.float32), 0)


def local_states(fk, v, key_mask, H_all, s_all, *, state_chunk: int, chunk: int, window: int):
    """Per block of `state_chunk` keys, the linear state a query block of a LoLA prefill starts from: the
    state its chunk c starts with (H_all[c], after eviction c - 1) plus the keys since chunk c's first
    buffered key (c * chunk - window). state_chunk must divide chunk and window.
    Returns (Hs [B, Hq, NB, F2, D], Ss [B, Hq, NB, F2]), NB = ceil(N / state_chunk)."""
    B, Hq, N, F2 = fk.shape
    D = v.shape[-1]
    G = Hq // v.shape[1]
    CS = state_chunk
    assert chunk % CS == 0 and window % CS == 0
    NB = max(1, math.ceil(N / CS))
    n_ev = H_all.shape[0] - 1
    Hs = torch.empty(B, Hq, NB, F2, D, device=fk.device, dtype=torch.float32)
    Ss = torch.empty(B, Hq, NB, F2, device=fk.device, dtype=torch.float32)
    BK = min(64, np2(F2))
    BV = min(64, np2(D))
    NV = triton.cdiv(D, BV)
    km = key_mask.to(torch.int8).contiguous() if key_mask is not None else None
    grid = (B * Hq, math.ceil(N / chunk), triton.cdiv(F2, BK) * NV)
    _local_states_kernel[grid](
        fk, v, km if km is not None else fk, H_all, s_all, Hs, Ss,
        N, NB, n_ev, chunk, window, F2, D, G,
        fk.stride(0), fk.stride(1), fk.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        km.stride(0) if km is not None else 0,
        H_all.stride(0), H_all.stride(1), H_all.stride(2), H_all.stride(3),
        s_all.stride(0), s_all.stride(1), s_all.stride(2),
        Hs.stride(0), Hs.stride(1), Hs.stride(2), Hs.stride(3),
        Ss.stride(0), Ss.stride(1), Ss.stride(2),
        HQ=Hq, CS=CS, BT=min(64, CS), BK=BK, BV=BV, NV=NV, HAS_KM=km is not None, PREC=dot_precision(fk, v),
    )
    return Hs, Ss
