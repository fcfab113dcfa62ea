"""Triton kernels of the LoLCATs hybrid and the LoLA cache manager (forward only).

Each kernel has a PyTorch reference in `reference.py` that it must match (tests/test_lola_kernels.py):

  chunk_states      prefix linear states at every `state_chunk` keys      <- cumsum in hybrid_attention_chunked
  hybrid_fwd        window softmax + sparse softmax + linear, one normaliser <- lola_attention / hybrid_attention_*
  sre_score         self-recall error of candidate pairs                   <- sre_scores
  fold_into_state   H += sum w phi(k) v^T, s += sum w phi(k)               <- fold
  decode_step       one query per (batch, head) against window/sparse/state <- lola_attention with S == 1

They run under TRITON_INTERPRET=1 on the CPU (small shapes) and on CUDA. Works with triton 3.6 and 3.9.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..graphs import run_steps
from ..backend import INTERPRET
from ..triton_lib import LOG2E, dot, dot_bf16x3, dot_precision, np2, online_softmax, online_softmax_row
from .reference import feature_rows


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
    pid_bh = tl.program_id(0)
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
    tl.store(OUT + b * s_o_b + h * s_o_h + (c + 1) * s_o_n + offs_k[:, None] * s_o_f + offs_v[None, :],
             hacc, mask=mk[:, None] & mv[None, :])
    if pid_v == 0:
        tl.store(OUTS + b * s_os_b + h * s_os_h + (c + 1) * s_os_n + offs_k, sacc, mask=mk)


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


# ------------------------------------------------------------------------------------------- hybrid forward
@triton.jit
def _hybrid_fwd_kernel(
    Q, K, V, FQ, FK, KM, GW, LFW, HS, SS, SPK, SPV, SPM, O,
    M, N, NF, L, D, F2, G, GS, q_off, window, scale_log2, sp_chunk,
    s_q_b, s_q_h, s_q_m,
    s_k_b, s_k_h, s_k_n,
    s_v_b, s_v_h, s_v_n,
    s_fq_b, s_fq_h, s_fq_m,
    s_fk_b, s_fk_h, s_fk_n,
    s_km_b,
    s_hs_b, s_hs_h, s_hs_n, s_hs_f,
    s_ss_b, s_ss_h, s_ss_n,
    s_spk_b, s_spk_h, s_spk_l, s_spk_c,
    s_spv_b, s_spv_h, s_spv_l, s_spv_c,
    s_spm_b, s_spm_h, s_spm_c,
    s_o_b, s_o_m, s_o_h,
    HQ: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, BF: tl.constexpr, BKS: tl.constexpr,
    CS: tl.constexpr, PER_BLOCK: tl.constexpr, HAS_KM: tl.constexpr, HAS_SP: tl.constexpr,
    PREC: tl.constexpr, UPCAST: tl.constexpr = INTERPRET,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // HQ
    h = pid_bh % HQ
    hk = h // G
    hs = h // GS
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, BD)
    offs_f = tl.arange(0, BF)
    mm = offs_m < M
    md = offs_d < D
    mf = offs_f < F2
    q = tl.load(Q + b * s_q_b + h * s_q_h + offs_m[:, None] * s_q_m + offs_d[None, :],
                mask=mm[:, None] & md[None, :], other=0.0)
    fq = tl.load(FQ + b * s_fq_b + h * s_fq_h + offs_m[:, None] * s_fq_m + offs_f[None, :],
                 mask=mm[:, None] & mf[None, :], other=0.0)
    qpos = q_off + offs_m  # key index of each query

    # the running max starts finite: a fully masked tile adds 0 (online_softmax without its EMPTY guard)
    m_i = tl.full([BM], -1.0e30, dtype=tl.float32)
    l_e = tl.zeros([BM], dtype=tl.float32)
    l_l = tl.zeros([BM], dtype=tl.float32)
    acc_e = tl.zeros([BM, BD], dtype=tl.float32)
    acc_l = tl.zeros([BM, BD], dtype=tl.float32)

    # 1. linear state of every token before the first explicit key
    a0 = q_off + pid_m * BM
    if PER_BLOCK:
        n_state = tl.maximum(a0 - window, 0) // CS
        lo = n_state * CS
    else:
        n_state = 0
        lo = 0
    for f0 in range(0, F2, BKS):  # fp32 state, read in slices of BKS features (bounded shared memory)
        offs_ks = f0 + tl.arange(0, BKS)
        mks = offs_ks < F2
        fqs = tl.load(FQ + b * s_fq_b + h * s_fq_h + offs_m[:, None] * s_fq_m + offs_ks[None, :],
                      mask=mm[:, None] & mks[None, :], other=0.0).to(tl.float32)
        hst = tl.load(HS + b * s_hs_b + h * s_hs_h + n_state * s_hs_n + offs_ks[:, None] * s_hs_f + offs_d[None, :],
                      mask=mks[:, None] & md[None, :], other=0.0)
        sst = tl.load(SS + b * s_ss_b + h * s_ss_h + n_state * s_ss_n + offs_ks, mask=mks, other=0.0)
        acc_l += dot(fqs, hst, PREC, UPCAST)
        l_l += tl.sum(fqs * sst[None, :], 1)

    # 2. sparse cache: exact keys of this query head's sparse head
    if HAS_SP:
        spc = a0 // sp_chunk  # the sparse set of this block's chunk (one set for all when sp_chunk is huge)
        for l0 in range(0, L, BN):
            offs_l = l0 + tl.arange(0, BN)
            ml = offs_l < L
            ml = ml & (tl.load(SPM + b * s_spm_b + hs * s_spm_h + spc * s_spm_c + offs_l, mask=offs_l < L,
                               other=0) != 0)
            sk = tl.load(SPK + b * s_spk_b + hs * s_spk_h + spc * s_spk_c + offs_l[:, None] * s_spk_l
                         + offs_d[None, :], mask=ml[:, None] & md[None, :], other=0.0)
            sv = tl.load(SPV + b * s_spv_b + hs * s_spv_h + spc * s_spv_c + offs_l[:, None] * s_spv_l
                         + offs_d[None, :], mask=ml[:, None] & md[None, :], other=0.0)
            sc = dot(q, tl.trans(sk.to(q.dtype)), PREC, UPCAST) * scale_log2
            sc = tl.where(ml[None, :], sc, float("-inf"))
            m_i, l_e, acc_e = online_softmax(sc, sv, m_i, l_e, acc_e, PREC, UPCAST, True, False)

    # 3. explicit keys: window softmax or linear by distance. A tile whose query-key distances all lie
    # beyond the window skips the softmax products, one whose distances all lie inside skips the linear ones
    # (distances in the tile: from a0 - (n0 + BN - 1) to a0 + BM - 1 - n0)
    hi = tl.minimum(N, a0 + BM)
    for n0 in range(lo, hi, BN):
        offs_n = n0 + tl.arange(0, BN)
        mn = offs_n < N
        if HAS_KM:
            mn = mn & (tl.load(KM + b * s_km_b + offs_n, mask=offs_n < N, other=0) != 0)
        v = tl.load(V + b * s_v_b + hk * s_v_h + offs_n[:, None] * s_v_n + offs_d[None, :],
                    mask=mn[:, None] & md[None, :], other=0.0)
        diff = qpos[:, None] - offs_n[None, :]
        if a0 - (n0 + BN - 1) < window:  # some pair inside the window (the loop stops at the causal edge)
            k = tl.load(K + b * s_k_b + hk * s_k_h + offs_n[:, None] * s_k_n + offs_d[None, :],
                        mask=mn[:, None] & md[None, :], other=0.0)
            win = (diff >= 0) & (diff < window) & mn[None, :]
            sc = dot(q, tl.trans(k.to(q.dtype)), PREC, UPCAST) * scale_log2
            sc = tl.where(win, sc, float("-inf"))
            m_i, l_e, acc_e = online_softmax(sc, v, m_i, l_e, acc_e, PREC, UPCAST, True, False)
        if a0 + BM - 1 - n0 >= window:  # some pair beyond it
            fk = tl.load(FK + b * s_fk_b + h * s_fk_h + offs_n[:, None] * s_fk_n + offs_f[None, :],
                         mask=(mn & (offs_n < NF))[:, None] & mf[None, :], other=0.0)
            lin = (diff >= window) & mn[None, :]
            a = dot(fq, tl.trans(fk.to(fq.dtype)), PREC, UPCAST)
            a = tl.where(lin, a, 0.0)
            acc_l += dot(a.to(v.dtype), v, PREC, UPCAST)
            l_l += tl.sum(a, 1)

    gw = tl.load(GW + h).to(tl.float32)
    lw = tl.load(LFW + h).to(tl.float32)
    num = gw * acc_e + lw * acc_l
    den = gw * l_e + lw * l_l
    den = tl.where(den > 0, den, 1.0)
    out = num / den[:, None]
    tl.store(O + b * s_o_b + offs_m[:, None] * s_o_m + h * s_o_h + offs_d[None, :],
             out.to(O.dtype.element_ty), mask=mm[:, None] & md[None, :])


# None: the defaults written in the wrappers (benchmarks set these to compare variants)
TUNE = {"hybrid_num_warps": None, "hybrid_num_stages": None, "fold_block": None, "piece_block_m": None,
        # the evictions of the two-pass prefill (PrefillEvictions)
        "score_prec": None, "ev_score_bn": None, "ev_score_warps": None, "ev_score_stages": None, "ev_select_bits": None, "ev_fold_block": None, "ev_fold_bn": None,
        "ev_fold_warps": None, "ev_select_warps": None}


def hybrid_fwd(q, k, v, fq, fk, g, lf, Hs, Ss, *, window: int, scale: float, q_offset: int,
               key_mask=None, state_chunk: int = 0, sparse_k=None, sparse_v=None, sparse_valid=None,
               sparse_chunk: int = 0, block_m: int = 64, block_n: int = 64, out=None):
    """Hybrid attention forward. Returns o [B, S, Hq, D] in q.dtype (or writes `out`).

    Hs/Ss: per-block prefix states [B, Hq, NS, F2, D] / [B, Hq, NS, F2] when state_chunk > 0 (block of
    queries starting at key index a reads state max(a - window, 0) // state_chunk and explicit keys from
    there), else one state [B, Hq, F2, D] of the tokens before key 0 (all local keys explicit).
    fk [B, Hq, NF, F2] may cover only the first NF local keys: those some query attends linearly
    (`reference.linear_rows`). sparse_k/v [B, Hs, L, D], sparse_valid [B, Hs, L] with Hq % Hs == 0; with
    sparse_chunk > 0 one sparse set per chunk instead, sparse_k/v [B, Hs, NC, L, D], sparse_valid [B, Hs, NC, L]:
    the block of queries starting at key index a reads set a // sparse_chunk (block_m must divide sparse_chunk).
    """
    B, Hq, M, D = q.shape
    N = k.shape[2]
    F2 = fq.shape[-1]
    G = Hq // k.shape[1]
    NF = feature_rows(fk, q_offset, M, window)
    per_block = state_chunk > 0
    if not per_block:
        Hs, Ss = Hs.unsqueeze(2), Ss.unsqueeze(2)
    BM = min(block_m, np2(M))
    BN = block_n
    if per_block:
        assert state_chunk % BN == 0, "state_chunk must be a multiple of block_n"
    BD, BF = np2(D), np2(F2)
    if out is None:
        out = torch.empty(B, M, Hq, D, device=q.device, dtype=q.dtype)
    km = key_mask.to(torch.int8).contiguous() if key_mask is not None else None
    per_chunk = sparse_chunk > 0
    has_sp = sparse_k is not None and sparse_k.shape[-2] > 0
    L = sparse_k.shape[-2] if has_sp else 0
    GS = Hq // sparse_k.shape[1] if has_sp else 1
    spm = sparse_valid.to(torch.int8).contiguous() if has_sp else None
    if per_chunk:
        assert sparse_chunk % BM == 0 and q_offset % BM == 0, "block_m must divide sparse_chunk and q_offset"
        assert sparse_k.dim() == 5, "per-chunk sparse sets are [B, Hs, NC, L, D]"
    cst = lambda t, i: t.stride(i) if (has_sp and per_chunk) else 0  # noqa: E731
    if NF == 0:
        fk = fq  # nothing is read from it
    gw = g.float().contiguous()
    lw = lf.float().contiguous()
    dummy = q
    grid = (triton.cdiv(M, BM), B * Hq)
    _hybrid_fwd_kernel[grid](
        q, k, v, fq, fk, km if km is not None else dummy, gw, lw, Hs, Ss,
        sparse_k if has_sp else dummy, sparse_v if has_sp else dummy, spm if has_sp else dummy, out,
        M, N, NF, L, D, F2, G, GS, q_offset, window, scale * LOG2E, sparse_chunk if per_chunk else 1 << 30,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        fq.stride(0), fq.stride(1), fq.stride(2),
        fk.stride(0), fk.stride(1), fk.stride(2),
        km.stride(0) if km is not None else 0,
        Hs.stride(0), Hs.stride(1), Hs.stride(2), Hs.stride(3),
        Ss.stride(0), Ss.stride(1), Ss.stride(2),
        sparse_k.stride(0) if has_sp else 0, sparse_k.stride(1) if has_sp else 0,
        sparse_k.stride(-2) if has_sp else 0, cst(sparse_k, 2),
        sparse_v.stride(0) if has_sp else 0, sparse_v.stride(1) if has_sp else 0,
        sparse_v.stride(-2) if has_sp else 0, cst(sparse_v, 2),
        spm.stride(0) if has_sp else 0, spm.stride(1) if has_sp else 0, cst(spm, 2),
        out.stride(0), out.stride(1), out.stride(2),
        HQ=Hq, BM=BM, BN=BN, BD=BD, BF=BF, BKS=min(BF, 32), CS=max(state_chunk, 1), PER_BLOCK=per_block,
        HAS_KM=km is not None, HAS_SP=has_sp, PREC=dot_precision(q, k, fq),
        num_warps=TUNE["hybrid_num_warps"] or 4,
        num_stages=TUNE["hybrid_num_stages"] or (2 if max(BD, BF) >= 128 or q.dtype == torch.float32 else 3),
    )
    return out


# ------------------------------------------------------------------------------------------- SRE score
@triton.jit
def _sre_rows(FKB, rows, ok, s_fk_n, HB, s_h_f, SB, vv, F2, D, eps,
              BN: tl.constexpr, BD: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """|| phi(k)^T H / (phi(k)^T s + eps) - v ||^2 of BN pairs: phi(k) of row rows[i] at FKB + rows[i] * s_fk_n
    (rows with ok False read as 0), H at HB (row stride s_h_f), s at SB, vv [BN, BD] fp32 values."""
    offs_d = tl.arange(0, BD)
    md = offs_d < D
    num = tl.zeros([BN, BD], dtype=tl.float32)
    den = tl.zeros([BN], dtype=tl.float32)
    for f0 in range(0, F2, BK):
        offs_k = f0 + tl.arange(0, BK)
        mk = offs_k < F2
        fk = tl.load(FKB + rows[:, None] * s_fk_n + offs_k[None, :], mask=ok[:, None] & mk[None, :], other=0.0)
        hh = tl.load(HB + offs_k[:, None] * s_h_f + offs_d[None, :], mask=mk[:, None] & md[None, :], other=0.0)
        ss = tl.load(SB + offs_k, mask=mk, other=0.0)
        if PREC == "bf16x3":
            # phi(k) is bf16 (exact as a tensor-core operand), H fp32 in three bf16 parts: fp32-accurate products
            num = dot_bf16x3(fk.to(tl.bfloat16), hh, num, "ieee", UPCAST)
        else:
            num += dot(fk.to(tl.float32), hh, PREC, UPCAST)
        den += tl.sum(fk.to(tl.float32) * ss[None, :], 1)
    err = vv - num / (den[:, None] + eps)
    err = tl.where(md[None, :], err, 0.0)
    return tl.sum(err * err, 1)


@triton.jit
def _sre_kernel(
    FK, V, VALID, H, S, OUT,
    N, F2, D, G, eps,
    s_fk_b, s_fk_h, s_fk_n,
    s_v_b, s_v_h, s_v_n,
    s_va_b, s_va_h,
    s_h_b, s_h_h, s_h_f,
    s_s_b, s_s_h,
    s_o_b, s_o_h,
    HQ: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, BK: tl.constexpr, HAS_VALID: tl.constexpr,
    PREC: tl.constexpr, UPCAST: tl.constexpr = INTERPRET,
):
    pid_bh = tl.program_id(0)
    pid_n = tl.program_id(1)
    b = pid_bh // HQ
    h = pid_bh % HQ
    hv = h // G
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_d = tl.arange(0, BD)
    mn = offs_n < N
    md = offs_d < D
    vv = tl.load(V + b * s_v_b + hv * s_v_h + offs_n[:, None] * s_v_n + offs_d[None, :],
                 mask=mn[:, None] & md[None, :], other=0.0).to(tl.float32)
    sc = _sre_rows(FK + b * s_fk_b + h * s_fk_h, offs_n, mn, s_fk_n, H + b * s_h_b + h * s_h_h, s_h_f,
                   S + b * s_s_b + h * s_s_h, vv, F2, D, eps, BN, BD, BK, PREC, UPCAST)
    if HAS_VALID:
        ok = tl.load(VALID + b * s_va_b + h * s_va_h + offs_n, mask=mn, other=0) != 0
        sc = tl.where(ok, sc, float("-inf"))
    tl.store(OUT + b * s_o_b + h * s_o_h + offs_n, sc, mask=mn)


def sre_score(fk, v, H, s, valid=None, eps: float = 1e-6, precise: bool = True):
    """SRE of N candidate pairs per query head. fk [B, Hq, N, F2], v [B, Hv, N, D] (Hv = Hq or Hkv),
    H [B, Hq, F2, D] fp32, s [B, Hq, F2] fp32, valid [B, Hq, N] bool (invalid -> -inf). Returns [B, Hq, N] fp32."""
    B, Hq, N, F2 = fk.shape
    D = v.shape[-1]
    G = Hq // v.shape[1]
    out = torch.empty(B, Hq, N, device=fk.device, dtype=torch.float32)
    if N == 0:
        return out
    va = valid.to(torch.int8).contiguous() if valid is not None else None
    H = H.contiguous()
    s = s.contiguous()
    BN = min(64, np2(N))
    BK = min(64, np2(F2))
    grid = (B * Hq, triton.cdiv(N, BN))
    _sre_kernel[grid](
        fk, v, va if va is not None else out, H, s, out,
        N, F2, D, G, eps,
        fk.stride(0), fk.stride(1), fk.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        va.stride(0) if va is not None else 0, va.stride(1) if va is not None else 0,
        H.stride(0), H.stride(1), H.stride(2),
        s.stride(0), s.stride(1),
        out.stride(0), out.stride(1),
        HQ=Hq, BN=BN, BD=np2(D), BK=BK, HAS_VALID=va is not None,
        PREC=_score_prec(fk, precise),
    )
    return out


def _score_prec(fk, precise: bool = True) -> str:
    """Precision of the SRE dots phi(k) . H (H fp32): fp32-accurate unless `precise` is False (tf32). bf16 features
    use three bf16 tensor-core dots against a 3-way bf16 split of H ("bf16x3"), other dtypes fp32 FMA ("ieee")."""
    if not precise:
        return "tf32"
    return "bf16x3" if fk.dtype == torch.bfloat16 else "ieee"


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
    pid_bh = tl.program_id(0)
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


def fold_into_state(fk, v, w, H, s):
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
    blk = TUNE["fold_block"] or 32
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


# ------------------------------------------------------------------------------------------- decode
@triton.jit
def _decode_kernel(
    Q, K, V, FQ, FK, KM, GW, LFW, H, S, SPK, SPV, SPM, O,
    N, NF, L, D, F2, G, GS, window, scale_log2,
    s_q_b, s_q_h,
    s_k_b, s_k_h, s_k_n,
    s_v_b, s_v_h, s_v_n,
    s_fq_b, s_fq_h,
    s_fk_b, s_fk_h, s_fk_n,
    s_km_b,
    s_h_b, s_h_h, s_h_f,
    s_s_b, s_s_h,
    s_spk_b, s_spk_h, s_spk_l,
    s_spv_b, s_spv_h, s_spv_l,
    s_spm_b, s_spm_h,
    s_o_b, s_o_h,
    HQ: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, BK: tl.constexpr,
    HAS_KM: tl.constexpr, HAS_SP: tl.constexpr,
):
    pid = tl.program_id(0)
    b = pid // HQ
    h = pid % HQ
    hk = h // G
    hs = h // GS
    offs_d = tl.arange(0, BD)
    md = offs_d < D
    q = tl.load(Q + b * s_q_b + h * s_q_h + offs_d, mask=md, other=0.0).to(tl.float32)
    qpos = N - 1
    # linear state
    acc_l = tl.zeros([BD], dtype=tl.float32)
    l_l = tl.zeros([1], dtype=tl.float32)
    for f0 in range(0, F2, BK):
        offs_k = f0 + tl.arange(0, BK)
        mk = offs_k < F2
        fq = tl.load(FQ + b * s_fq_b + h * s_fq_h + offs_k, mask=mk, other=0.0).to(tl.float32)
        hh = tl.load(H + b * s_h_b + h * s_h_h + offs_k[:, None] * s_h_f + offs_d[None, :],
                     mask=mk[:, None] & md[None, :], other=0.0)
        ss = tl.load(S + b * s_s_b + h * s_s_h + offs_k, mask=mk, other=0.0)
        acc_l += tl.sum(fq[:, None] * hh, 0)
        l_l += tl.sum(fq * ss, 0)
    m_i = tl.full([1], -1.0e30, dtype=tl.float32)
    l_e = tl.zeros([1], dtype=tl.float32)
    acc_e = tl.zeros([BD], dtype=tl.float32)
    if HAS_SP:
        for l0 in range(0, L, BN):
            offs_l = l0 + tl.arange(0, BN)
            ml = offs_l < L
            ml = ml & (tl.load(SPM + b * s_spm_b + hs * s_spm_h + offs_l, mask=offs_l < L, other=0) != 0)
            sk = tl.load(SPK + b * s_spk_b + hs * s_spk_h + offs_l[:, None] * s_spk_l + offs_d[None, :],
                         mask=ml[:, None] & md[None, :], other=0.0).to(tl.float32)
            sv = tl.load(SPV + b * s_spv_b + hs * s_spv_h + offs_l[:, None] * s_spv_l + offs_d[None, :],
                         mask=ml[:, None] & md[None, :], other=0.0).to(tl.float32)
            sc = tl.sum(sk * q[None, :], 1) * scale_log2
            sc = tl.where(ml, sc, float("-inf"))
            m_i, l_e, acc_e = online_softmax_row(sc, sv, m_i, l_e, acc_e)
    for n0 in range(0, N, BN):
        offs_n = n0 + tl.arange(0, BN)
        mn = offs_n < N
        if HAS_KM:
            mn = mn & (tl.load(KM + b * s_km_b + offs_n, mask=offs_n < N, other=0) != 0)
        k = tl.load(K + b * s_k_b + hk * s_k_h + offs_n[:, None] * s_k_n + offs_d[None, :],
                    mask=mn[:, None] & md[None, :], other=0.0).to(tl.float32)
        v = tl.load(V + b * s_v_b + hk * s_v_h + offs_n[:, None] * s_v_n + offs_d[None, :],
                    mask=mn[:, None] & md[None, :], other=0.0).to(tl.float32)
        diff = qpos - offs_n
        win = (diff < window) & mn
        lin = (diff >= window) & mn
        sc = tl.sum(k * q[None, :], 1) * scale_log2
        sc = tl.where(win, sc, float("-inf"))
        m_i, l_e, acc_e = online_softmax_row(sc, v, m_i, l_e, acc_e)
        # linear part of the local keys older than the window: phi(q) . phi(k) per key
        a = tl.zeros([BN], dtype=tl.float32)
        for f0 in range(0, F2, BK):
            offs_k = f0 + tl.arange(0, BK)
            mk = offs_k < F2
            fq = tl.load(FQ + b * s_fq_b + h * s_fq_h + offs_k, mask=mk, other=0.0).to(tl.float32)
            fk = tl.load(FK + b * s_fk_b + h * s_fk_h + offs_n[:, None] * s_fk_n + offs_k[None, :],
                         mask=(lin & (offs_n < NF))[:, None] & mk[None, :], other=0.0).to(tl.float32)
            a += tl.sum(fk * fq[None, :], 1)
        a = tl.where(lin, a, 0.0)
        acc_l += tl.sum(a[:, None] * v, 0)
        l_l += tl.sum(a, 0)
    gw = tl.load(GW + h).to(tl.float32)
    lw = tl.load(LFW + h).to(tl.float32)
    num = gw * acc_e + lw * acc_l
    den = gw * l_e + lw * l_l
    den = tl.where(den > 0, den, 1.0)
    out = num / den
    tl.store(O + b * s_o_b + h * s_o_h + offs_d, out.to(O.dtype.element_ty), mask=md)


def decode_step(q, k, v, fq, fk, g, lf, H, s, *, window: int, scale: float, key_mask=None,
                sparse_k=None, sparse_v=None, sparse_valid=None, out=None):
    """One decode token: q [B, Hq, 1, D], fq [B, Hq, 1, F2]; local keys k/v [B, Hkv, N, D] (the new token is
    the last local key), fk [B, Hq, NF, F2] the features of the first NF >= N - window of them (the ones
    attended linearly); state H/s; optional sparse cache [B, Hs, L, *]. Returns [B, 1, Hq, D]."""
    B, Hq, _, D = q.shape
    N = k.shape[2]
    F2 = fq.shape[-1]
    G = Hq // k.shape[1]
    NF = feature_rows(fk, N - 1, 1, window)
    if out is None:
        out = torch.empty(B, 1, Hq, D, device=q.device, dtype=q.dtype)
    km = key_mask.to(torch.int8).contiguous() if key_mask is not None else None
    has_sp = sparse_k is not None and sparse_k.shape[2] > 0
    L = sparse_k.shape[2] if has_sp else 0
    GS = Hq // sparse_k.shape[1] if has_sp else 1
    spm = sparse_valid.to(torch.int8).contiguous() if has_sp else None
    dummy = q
    if NF == 0:
        fk = fq  # nothing is read from it
    _decode_kernel[(B * Hq,)](
        q, k, v, fq, fk, km if km is not None else dummy, g.float().contiguous(), lf.float().contiguous(), H, s,
        sparse_k if has_sp else dummy, sparse_v if has_sp else dummy, spm if has_sp else dummy, out,
        N, NF, L, D, F2, G, GS, window, scale * LOG2E,
        q.stride(0), q.stride(1),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        fq.stride(0), fq.stride(1),
        fk.stride(0), fk.stride(1), fk.stride(2),
        km.stride(0) if km is not None else 0,
        H.stride(0), H.stride(1), H.stride(2),
        s.stride(0), s.stride(1),
        sparse_k.stride(0) if has_sp else 0, sparse_k.stride(1) if has_sp else 0, sparse_k.stride(2) if has_sp else 0,
        sparse_v.stride(0) if has_sp else 0, sparse_v.stride(1) if has_sp else 0, sparse_v.stride(2) if has_sp else 0,
        spm.stride(0) if has_sp else 0, spm.stride(1) if has_sp else 0,
        out.stride(0), out.stride(2),
        HQ=Hq, BN=min(64, np2(N)), BD=np2(D), BK=min(64, np2(F2)),
        HAS_KM=km is not None, HAS_SP=has_sp,
    )
    return out


# ------------------------------------------------------------------------------------------- feature map
@triton.jit
def _feature_map_kernel(
    X, W, O,
    N, D, F, G, eps,
    s_x_b, s_x_h, s_x_n,
    s_w_h, s_w_d,
    s_o_b, s_o_h, s_o_n,
    H: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr, BF: tl.constexpr, PREC: tl.constexpr,
    UPCAST: tl.constexpr = INTERPRET,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    hx = h // G
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, BD)
    offs_f = tl.arange(0, BF)
    mm = offs_m < N
    md = offs_d < D
    mf = offs_f < F
    x = tl.load(X + b * s_x_b + hx * s_x_h + offs_m[:, None] * s_x_n + offs_d[None, :],
                mask=mm[:, None] & md[None, :], other=0.0)
    w = tl.load(W + h * s_w_h + offs_d[:, None] * s_w_d + offs_f[None, :], mask=md[:, None] & mf[None, :], other=0.0)
    p = dot(x.to(w.dtype), w, PREC, UPCAST)  # [BM, BF] fp32
    pp = tl.where(mf[None, :], p, float("-inf"))
    pn = tl.where(mf[None, :], -p, float("-inf"))
    ep = tl.exp(pp - tl.max(pp, 1)[:, None])
    en = tl.exp(pn - tl.max(pn, 1)[:, None])
    ep = tl.maximum(ep / tl.sum(ep, 1)[:, None], eps)
    en = tl.maximum(en / tl.sum(en, 1)[:, None], eps)
    base = O + b * s_o_b + h * s_o_h + offs_m[:, None] * s_o_n
    msk = mm[:, None] & mf[None, :]
    tl.store(base + offs_f[None, :], ep.to(O.dtype.element_ty), mask=msk)
    tl.store(base + F + offs_f[None, :], en.to(O.dtype.element_ty), mask=msk)


def feature_map(x, weight, eps: float = 1e-12, out_dtype=None):
    """phi(x) = [softmax(x W), softmax(-x W)] per head (forward only). x [B, Hx, N, D] (Hx divides H),
    weight [H, D, F]. The projection runs in the weight's dtype (fp32 weights: exact fp32 dot) with fp32
    accumulation; softmax in fp32. Returns [B, H, N, 2F] in out_dtype (default x.dtype)."""
    B, Hx, N, D = x.shape
    H, _, F = weight.shape
    out = torch.empty(B, H, N, 2 * F, device=x.device, dtype=out_dtype or x.dtype)
    w = weight.contiguous()
    BM = 64
    grid = (triton.cdiv(N, BM), B * H)
    _feature_map_kernel[grid](
        x, w, out, N, D, F, H // Hx, eps,
        x.stride(0), x.stride(1), x.stride(2),
        w.stride(0), w.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        H=H, BM=BM, BD=np2(D), BF=np2(F), PREC=dot_precision(w),
    )
    return out


# ------------------------------------------------------------------------------------------- prefill evictions
# The evictions of a whole LoLA prefill (ops._lola_parallel, pass 1): eviction c (at the end of chunk c)
# scores the sparse slots of slot c and the pairs at positions c*C - W .. (c+1)*C - W - 1 (those >= 0 and
# not padding) against the state H_all[c], keeps the lam best per sparse head (SPIDX[c + 1]) and folds the
# others into H_all[c + 1]. The fold does not add the folded pairs one eviction at a time: the state after
# eviction c is exactly the sum over every pair evicted so far minus the pairs in the sparse set (a pair
# leaves the window once, then is either folded or held exact), so it is the running sum of the evictions'
# ranges (summed for all evictions in one parallel launch up front) minus the lam sparse pairs: lam pairs per
# eviction instead of lam + C. Three kernels per eviction (score, select, fold); the eviction index is read
# from a device counter so that one captured CUDA graph replays every eviction.
@triton.jit
def _ev_candidates(SPIDX, KM, c, b, hs, offs_j, NC, lam, C, W,
                   s_spi_c, s_spi_b, s_spi_h, s_km_b, HAS_KM: tl.constexpr):
    """Token position of each candidate j (the lam sparse slots, then the evicted pairs), -1 if invalid."""
    is_sp = offs_j < lam
    sp = tl.load(SPIDX + c * s_spi_c + b * s_spi_b + hs * s_spi_h + offs_j, mask=is_sp, other=-1)
    pos = c * C - W + (offs_j - lam)
    ok = (~is_sp) & (offs_j < NC) & (pos >= 0)
    if HAS_KM:
        ok = ok & (tl.load(KM + b * s_km_b + pos, mask=ok, other=0) != 0)
    return tl.where(is_sp, sp, tl.where(ok, pos, -1))


@triton.jit
def _ev_score_kernel(
    CNT, SPIDX, KM, FK, V, HALL, SALL, SC,
    NC, lam, C, W, F2, D, G, GS, eps,
    s_spi_c, s_spi_b, s_spi_h, s_km_b,
    s_fk_b, s_fk_h, s_fk_n,
    s_v_b, s_v_h, s_v_n,
    s_ha_c, s_ha_b, s_ha_h, s_ha_f,
    s_sa_c, s_sa_b, s_sa_h,
    s_sc_b, s_sc_h,
    HQ: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, BK: tl.constexpr, HAS_KM: tl.constexpr,
    PREC: tl.constexpr, UPCAST: tl.constexpr = INTERPRET,
):
    """SC[b, h, j] = SRE of candidate j under query head h's state H_all[c] (-inf for invalid candidates)."""
    pid_bh = tl.program_id(0)
    pid_n = tl.program_id(1)
    b = pid_bh // HQ
    h = pid_bh % HQ
    c = tl.load(CNT)
    offs_j = pid_n * BN + tl.arange(0, BN)
    idx = _ev_candidates(SPIDX, KM, c, b, h // GS, offs_j, NC, lam, C, W, s_spi_c, s_spi_b, s_spi_h, s_km_b, HAS_KM)
    ok = idx >= 0
    idx = tl.where(ok, idx, 0)
    offs_d = tl.arange(0, BD)
    md = offs_d < D
    vv = tl.load(V + b * s_v_b + (h // G) * s_v_h + idx[:, None] * s_v_n + offs_d[None, :],
                 mask=ok[:, None] & md[None, :], other=0.0).to(tl.float32)
    sc = _sre_rows(FK + b * s_fk_b + h * s_fk_h, idx, ok, s_fk_n, HALL + c * s_ha_c + b * s_ha_b + h * s_ha_h,
                   s_ha_f, SALL + c * s_sa_c + b * s_sa_b + h * s_sa_h, vv, F2, D, eps, BN, BD, BK, PREC, UPCAST)
    sc = tl.where(ok, sc, float("-inf"))
    tl.store(SC + b * s_sc_b + h * s_sc_h + offs_j, sc, mask=offs_j < NC)


@triton.jit
def _ev_select_kernel(
    CNT, SPIDX, SPSC, KM, SC, NFOLD,
    NC, lam, C, W,
    s_spi_c, s_spi_b, s_spi_h, s_km_b,
    s_sc_b, s_sc_h,
    HS: tl.constexpr, GS: tl.constexpr, NCP: tl.constexpr, HAS_KM: tl.constexpr, RB: tl.constexpr = 8,
    NBIN: tl.constexpr = 256,
):
    """Per sparse head: sum the SRE over its query heads and keep the lam highest (ties: lowest index) as the
    slots SPIDX[c + 1] (scores in SPSC[c + 1], empty slots -1 / -inf); the others are folded (_ev_fold_kernel),
    and NFOLD[b, hs] counts them (all evictions so far)."""
    pid = tl.program_id(0)
    b = pid // HS
    hs = pid % HS
    c = tl.load(CNT)
    offs = tl.arange(0, NCP)
    m = offs < NC
    tot = tl.zeros([NCP], dtype=tl.float32)
    for i in range(GS):
        tot += tl.load(SC + b * s_sc_b + (hs * GS + i) * s_sc_h + offs, mask=m, other=float("-inf"))
    idx = _ev_candidates(SPIDX, KM, c, b, hs, offs, NC, lam, C, W, s_spi_c, s_spi_b, s_spi_h, s_km_b, HAS_KM)
    valid = (idx >= 0) & m
    tot = tl.where(valid, tot, float("-inf"))
    # radix select of the lam-th highest score on the float bits (SRE >= 0: the bits order like the values),
    # RB bits per pass from the top (8: a 256-bin tl.histogram per pass, 4 passes; 4: 16 bins counted by
    # comparison, 8 passes): `need` is how many of the keys that share `prefix` are still to keep
    key = tl.where(valid, tot.to(tl.int32, bitcast=True), -1)
    bins = tl.arange(0, NBIN)
    prefix = 0
    need = lam
    for p in tl.static_range(32 // RB):
        shift = 32 - RB * (p + 1)
        if p == 0:
            active = valid
        else:
            active = valid & ((key >> (shift + RB)) == prefix)
        digit = (key >> shift) & (NBIN - 1)
        if RB == 8:
            cnt = tl.histogram(digit, NBIN, mask=active)  # [NBIN]
            incl = tl.cumsum(cnt, 0, reverse=True)  # active keys in this bin or higher
            above = incl - cnt
        else:
            cnt = tl.sum(((digit[:, None] == bins[None, :]) & active[:, None]).to(tl.int32), 0)  # [NBIN]
            above = tl.sum(tl.where(bins[None, :] > bins[:, None], cnt[None, :], 0), 1)  # active keys in higher bins
            incl = above + cnt
        bstar = tl.max(tl.where(incl >= need, bins, -1), 0)
        need = need - tl.sum(tl.where(bins == bstar, above, 0), 0)
        prefix = prefix * NBIN + bstar
    n_valid = tl.sum(valid.to(tl.int32), 0)
    gt = valid & (key > prefix)
    eq = valid & (key == prefix)
    rank = tl.cumsum(eq.to(tl.int32), 0)
    keep = gt | (eq & (rank <= need))
    keep = tl.where(n_valid <= lam, valid, keep)  # fewer valid candidates than slots: keep them all
    slot = tl.cumsum(keep.to(tl.int32), 0) - 1
    base = (c + 1) * s_spi_c + b * s_spi_b + hs * s_spi_h
    n_keep = tl.sum(keep.to(tl.int32), 0)
    nf = NFOLD + b * HS + hs
    tl.store(nf, tl.load(nf) + n_valid - n_keep)
    empty = (offs >= n_keep) & (offs < lam)
    tl.store(SPIDX + base + offs, tl.full([NCP], -1, tl.int32), mask=empty)
    tl.store(SPSC + base + offs, tl.full([NCP], float("-inf"), tl.float32), mask=empty)
    tl.store(SPIDX + base + slot, idx, mask=keep)
    tl.store(SPSC + base + slot, tot, mask=keep)


@triton.jit
def _ev_fold_kernel(
    CNT, SPIDX, FK, V, HALL, SALL, PH, PS, NFOLD,
    lam, F2, D, G, GS, HS,
    s_spi_c, s_spi_b, s_spi_h,
    s_fk_b, s_fk_h, s_fk_n,
    s_v_b, s_v_h, s_v_n,
    s_ha_c, s_ha_b, s_ha_h, s_ha_f,
    s_sa_c, s_sa_b, s_sa_h,
    HQ: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    PREC: tl.constexpr, UPCAST: tl.constexpr = INTERPRET,
):
    """H_all[c + 1] = P - sum over the sparse slots SPIDX[c + 1] of phi(k) v^T (and s_all), per query head, where
    P = (PH += H_all[c + 1]) is the sum of every pair evicted by eviction c and before (H_all[c + 1] holds the
    sum of eviction c's pairs on entry): the linear state holds exactly the evicted pairs not in the sparse set."""
    pid_bh = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_v = tl.program_id(2)
    b = pid_bh // HQ
    h = pid_bh % HQ
    hs = h // GS
    c = tl.load(CNT)
    offs_k = pid_k * BK + tl.arange(0, BK)
    offs_v = pid_v * BV + tl.arange(0, BV)
    mk = offs_k < F2
    mv = offs_v < D
    mkv = mk[:, None] & mv[None, :]
    hoff = b * s_ha_b + h * s_ha_h + offs_k[:, None] * s_ha_f + offs_v[None, :]
    hacc = tl.zeros([BK, BV], dtype=tl.float32)
    # the sum of phi(k) is taken as a dot with ones, so that it has H's 2-D layout (every column holds it) and
    # is stored from column 0 of the pid_v == 0 programs. The earlier form (a [BK] `tl.sum` in a slice layout,
    # stored under `if pid_v == 0`) compiled, on the H200 with Triton 3.6, to a shared-memory race
    # (compute-sanitizer racecheck: write-write hazards at that store), which made s_all depend on timing
    sacc = tl.zeros([BK, BV], dtype=tl.float32)
    ones = tl.full([BN, BV], 1.0, tl.float32)
    base = (c + 1) * s_spi_c + b * s_spi_b + hs * s_spi_h
    for j0 in range(0, lam, BN):
        offs_j = j0 + tl.arange(0, BN)
        idx = tl.load(SPIDX + base + offs_j, mask=offs_j < lam, other=-1)
        ok = idx >= 0
        idx = tl.where(ok, idx, 0)
        fk = tl.load(FK + b * s_fk_b + h * s_fk_h + idx[:, None] * s_fk_n + offs_k[None, :],
                     mask=ok[:, None] & mk[None, :], other=0.0)
        vv = tl.load(V + b * s_v_b + (h // G) * s_v_h + idx[:, None] * s_v_n + offs_v[None, :],
                     mask=ok[:, None] & mv[None, :], other=0.0)
        hacc += dot(tl.trans(fk.to(vv.dtype)), vv, PREC, UPCAST)
        sacc += tl.dot(tl.trans(fk.to(tl.float32)), ones, input_precision="ieee")
    # PH / PS: [B, Hq, F2, D] / [B, Hq, F2] contiguous, the running sum of the evicted pairs
    poff = (b * HQ + h) * F2 * D + offs_k[:, None] * D + offs_v[None, :]
    # while no pair has been folded (every evicted pair is held exact) the state is exactly 0, as the sequential
    # fold leaves it; P - sum(kept) would leave rounding noise there, and the SRE divides by phi(k) . s
    folded = tl.load(NFOLD + b * HS + hs) > 0
    p = tl.load(PH + poff, mask=mkv, other=0.0) + tl.load(HALL + (c + 1) * s_ha_c + hoff, mask=mkv, other=0.0)
    tl.store(PH + poff, p, mask=mkv)
    tl.store(HALL + (c + 1) * s_ha_c + hoff, tl.where(folded, p - hacc, 0.0), mask=mkv)
    # s: column 0 of the pid_v == 0 programs ([BK, BV] pointers that repeat along the columns, masked to one)
    col0 = mk[:, None] & (offs_v[None, :] == 0)
    soff = (b * HQ + h) * F2 + offs_k[:, None] + 0 * offs_v[None, :]
    so = b * s_sa_b + h * s_sa_h + offs_k[:, None] + 0 * offs_v[None, :]
    ps = tl.load(PS + soff, mask=col0, other=0.0) + tl.load(SALL + (c + 1) * s_sa_c + so, mask=col0, other=0.0)
    tl.store(PS + soff, ps, mask=col0)
    tl.store(SALL + (c + 1) * s_sa_c + so, tl.where(folded, ps - sacc, 0.0), mask=col0)


class PrefillEvictions:
    """Buffers and launches of the evictions of one LoLA prefill (see the comment above `_ev_candidates`).

    fk [B, Hq, S, F2] (phi(k) of every token), v [B, Hkv, S, D], key_mask [B, S] bool or None; n_ev evictions
    at the ends of chunks 0 .. n_ev - 1. After `run()`: H_all [n_ev + 1, B, Hq, F2, D], s_all, and the sparse
    slots SPIDX / SPSC [n_ev + 1, B, Hs, lam] (token positions, -1 = empty) that chunk c attends in slot c.
    """

    def __init__(self, fk, v, key_mask, *, n_ev: int, lam: int, chunk: int, window: int, sparse_heads: int,
                 eps: float = 1e-6):
        B, Hq, S, F2 = fk.shape
        D = v.shape[-1]
        dev = fk.device
        self.fk, self.v = fk, v
        self.km = key_mask.to(torch.int8).contiguous() if key_mask is not None else None
        self.B, self.Hq, self.Hs, self.F2, self.D = B, Hq, sparse_heads, F2, D
        self.G, self.GS = Hq // v.shape[1], Hq // sparse_heads
        self.n_ev, self.lam, self.C, self.W, self.eps = n_ev, lam, chunk, window, eps
        self.NC = lam + chunk
        self.H_all = torch.zeros(n_ev + 1, B, Hq, F2, D, device=dev, dtype=torch.float32)
        self.s_all = torch.zeros(n_ev + 1, B, Hq, F2, device=dev, dtype=torch.float32)
        self.SPIDX = torch.full((n_ev + 1, B, sparse_heads, lam), -1, device=dev, dtype=torch.int32)
        self.SPSC = torch.full((n_ev + 1, B, sparse_heads, lam), float("-inf"), device=dev, dtype=torch.float32)
        self.SC = torch.empty(B, Hq, self.NC, device=dev, dtype=torch.float32)
        self.cnt = torch.zeros(1, device=dev, dtype=torch.int32)
        # the running sum of the evicted pairs (the fold kernel adds eviction c's range sum, then subtracts the
        # sparse set: the state after eviction c is every evicted pair not kept exact)
        self.PH = torch.zeros(B, Hq, F2, D, device=dev, dtype=torch.float32)
        self.PS = torch.zeros(B, Hq, F2, device=dev, dtype=torch.float32)
        self.NFOLD = torch.zeros(B, sparse_heads, device=dev, dtype=torch.int32)  # pairs folded so far
        # SRE fp32-accurate: bf16 features as three bf16 tensor-core dots ("bf16x3"), else fp32 FMA ("ieee");
        # tf32 and tf32x3 were no faster than fp32 FMA on the H200 (evals/results/lola-prefill-profile-tune.json)
        self.score_prec = TUNE["score_prec"] or _score_prec(fk)
        self._evicted_range_sums()

    def _evicted_range_sums(self) -> None:
        """H_all[c + 1] / s_all[c + 1] = the sums over the pairs eviction c takes out of the window (positions
        c*C - W .. (c+1)*C - W - 1, those >= 0 and not padding), all evictions in one parallel launch."""
        if self.n_ev == 0:
            return
        H, S = self.H_all, self.s_all
        _range_sums(self.fk, self.v, self.km, H, S, self.n_ev, self.C, self.W,
                    (H.stride(1), H.stride(2), H.stride(0), H.stride(3)), (S.stride(1), S.stride(2), S.stride(0)))

    def _common(self):
        km = self.km
        return (self.SPIDX.stride(0), self.SPIDX.stride(1), self.SPIDX.stride(2), km.stride(0) if km is not None else 0)

    def step(self) -> None:
        """One eviction (index = the device counter), then counter += 1."""
        fk, v, km = self.fk, self.v, self.km
        Hq, D, F2, NC = self.Hq, self.D, self.F2, self.NC
        dummy = self.cnt
        spi = self._common()
        ha = (self.H_all.stride(0), self.H_all.stride(1), self.H_all.stride(2), self.H_all.stride(3))
        sa = (self.s_all.stride(0), self.s_all.stride(1), self.s_all.stride(2))
        # tiles from the sweep at 32k, D = 64 (evals/results/lola-prefill-profile-tune.json): 128 candidates per
        # score program, a 8-warp select above 1024 candidates (16 and 4 were slower there), 4 warps below
        BN = min(TUNE["ev_score_bn"] or 128, np2(NC))
        _ev_score_kernel[(self.B * Hq, triton.cdiv(NC, BN))](
            self.cnt, self.SPIDX, km if km is not None else dummy, fk, v, self.H_all, self.s_all, self.SC,
            NC, self.lam, self.C, self.W, F2, D, self.G, self.GS, self.eps,
            *spi, fk.stride(0), fk.stride(1), fk.stride(2), v.stride(0), v.stride(1), v.stride(2),
            *ha, *sa, self.SC.stride(0), self.SC.stride(1),
            HQ=Hq, BN=BN, BD=np2(D), BK=min(64, np2(F2)), HAS_KM=km is not None, PREC=self.score_prec,
            num_warps=TUNE["ev_score_warps"] or 4, **({"num_stages": TUNE["ev_score_stages"]}
                                                       if TUNE["ev_score_stages"] else {}),
        )
        rb = TUNE["ev_select_bits"] or 8
        _ev_select_kernel[(self.B * self.Hs,)](
            self.cnt, self.SPIDX, self.SPSC, km if km is not None else dummy, self.SC, self.NFOLD,
            NC, self.lam, self.C, self.W, *spi,
            self.SC.stride(0), self.SC.stride(1),
            HS=self.Hs, GS=self.GS, NCP=np2(NC), HAS_KM=km is not None, RB=rb, NBIN=1 << rb,
            num_warps=TUNE["ev_select_warps"] or (8 if NC > 1024 else 4),
        )
        blk = TUNE["ev_fold_block"] or 32
        BK, BV = min(blk, np2(F2)), min(blk, np2(D))
        _ev_fold_kernel[(self.B * Hq, triton.cdiv(F2, BK), triton.cdiv(D, BV))](
            self.cnt, self.SPIDX, fk, v, self.H_all, self.s_all, self.PH, self.PS, self.NFOLD,
            self.lam, F2, D, self.G, self.GS, self.Hs,
            *spi[:3], fk.stride(0), fk.stride(1), fk.stride(2), v.stride(0), v.stride(1), v.stride(2),
            *ha, *sa,
            HQ=Hq, BN=min(TUNE["ev_fold_bn"] or 128, np2(self.lam)), BK=BK, BV=BV,
            PREC=dot_precision(fk, v), num_warps=TUNE["ev_fold_warps"] or 4,
        )
        self.cnt += 1

    def _key(self):
        """What the kernels are specialised on: a graph captured for one key can be captured again without a
        compile (the launches are already warm)."""
        t = lambda x: None if x is None else (x.dtype, tuple(x.shape), tuple(x.stride()))  # noqa: E731
        return (self.fk.device, t(self.fk), t(self.v), t(self.km), self.n_ev, self.lam, self.C, self.W, self.Hs,
                self.score_prec, tuple(sorted(TUNE.items())))

    def run(self, graph: bool = True) -> None:
        """All evictions. On CUDA one eviction is captured in a CUDA graph and replayed for every eviction (same
        kernels, same order); the first time a configuration runs in this process, its first eviction runs
        eagerly before the capture (that compiles the kernels), later times the capture comes first, while
        the GPU still works on what was queued before. Elsewhere, or if the capture fails: eagerly."""
        key = self._key() if graph and self.fk.is_cuda else None
        self.graph = run_steps(self.step, self.n_ev, self.fk.device, graph=graph,
                               eager_first=key not in _WARM_EVICTIONS)
        if self.graph is not None:  # kept for the benchmark (replay cost alone)
            _WARM_EVICTIONS.add(key)


_WARM_EVICTIONS: set = set()  # PrefillEvictions keys whose kernels have run once (compiled)


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
    pid_bh = tl.program_id(0)
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
    slot = tl.minimum(c, n_ev)
    hacc = tl.load(HALL + slot * s_ha_c + b * s_ha_b + h * s_ha_h + offs_k[:, None] * s_ha_f + offs_v[None, :],
                   mask=mk[:, None] & mv[None, :], other=0.0)
    sacc = tl.load(SALL + slot * s_sa_c + b * s_sa_b + h * s_sa_h + offs_k, mask=mk, other=0.0)
    for n in range(n_lo, n_hi):
        tl.store(HS + b * s_hs_b + h * s_hs_h + n * s_hs_n + offs_k[:, None] * s_hs_f + offs_v[None, :], hacc,
                 mask=mk[:, None] & mv[None, :])
        if pid_v == 0:
            tl.store(SS + b * s_ss_b + h * s_ss_h + n * s_ss_n + offs_k, sacc, mask=mk)
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
