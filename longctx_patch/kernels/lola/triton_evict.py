"""Triton kernels of the LoLA evictions (forward only), each matched against `reference.py`
(tests/test_lola_kernels.py, tests/test_lola_cache.py):

  sre_score          self-recall error of candidate pairs                 <- sre_scores
  PrefillEvictions   every eviction of a two-pass prefill (`EvictionPlan`): score, select, fold, replayed from
                     one CUDA graph  <- select_and_fold, eviction by eviction

They run under TRITON_INTERPRET=1 on the CPU (small shapes) and on CUDA. Works with triton 3.6 and 3.9.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..backend import INTERPRET
from ..graphs import run_steps
from ..triton_lib import dot, dot_bf16x3, dot_precision, np2
from .reference import EPS_SRE, check_ints
from .triton_state import _range_sums, fold_into_state
from .tuning import DEFAULT_TUNING, LolaTuning


# ------------------------------------------------------------------------------------------- SRE score
@triton.jit
def _sre_rows(FKB, rows, ok, s_fk_n, HB, s_h_f, SB, vv, F2, D, eps,
              BN: tl.constexpr, BD: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """|| phi(k)^T H / (phi(k)^T s + eps) - v || of BN pairs: phi(k) of row rows[i] at FKB + rows[i] * s_fk_n
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
    return tl.sqrt(tl.sum(err * err, 1))


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
    pid_bh = tl.program_id(0).to(tl.int64)  # 64-bit base offsets (docs/PERFORMANCE.md, "Large shapes")
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


# ------------------------------------------------------------------------------------------- prefill evictions
# The evictions of a whole LoLA prefill (prefill.lola_parallel, pass 1): eviction c (at the end of chunk c)
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
    sp = tl.load(SPIDX + c.to(tl.int64) * s_spi_c + b * s_spi_b + hs * s_spi_h + offs_j, mask=is_sp, other=-1)
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
    pid_bh = tl.program_id(0).to(tl.int64)  # 64-bit base offsets (docs/PERFORMANCE.md, "Large shapes")
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
    c64 = c.to(tl.int64)
    sc = _sre_rows(FK + b * s_fk_b + h * s_fk_h, idx, ok, s_fk_n, HALL + c64 * s_ha_c + b * s_ha_b + h * s_ha_h,
                   s_ha_f, SALL + c64 * s_sa_c + b * s_sa_b + h * s_sa_h, vv, F2, D, eps, BN, BD, BK, PREC, UPCAST)
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
    pid = tl.program_id(0).to(tl.int64)  # 64-bit base offsets (docs/PERFORMANCE.md, "Large shapes")
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
    base = (c + 1).to(tl.int64) * s_spi_c + b * s_spi_b + hs * s_spi_h
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
    pid_bh = tl.program_id(0).to(tl.int64)  # 64-bit base offsets (docs/PERFORMANCE.md, "Large shapes")
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
    base = (c + 1).to(tl.int64) * s_spi_c + b * s_spi_b + hs * s_spi_h
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
    p = tl.load(PH + poff, mask=mkv, other=0.0) + tl.load(HALL + (c + 1).to(tl.int64) * s_ha_c + hoff, mask=mkv, other=0.0)
    tl.store(PH + poff, p, mask=mkv)
    tl.store(HALL + (c + 1).to(tl.int64) * s_ha_c + hoff, tl.where(folded, p - hacc, 0.0), mask=mkv)
    # s: column 0 of the pid_v == 0 programs ([BK, BV] pointers that repeat along the columns, masked to one)
    col0 = mk[:, None] & (offs_v[None, :] == 0)
    soff = (b * HQ + h) * F2 + offs_k[:, None] + 0 * offs_v[None, :]
    so = b * s_sa_b + h * s_sa_h + offs_k[:, None] + 0 * offs_v[None, :]
    ps = tl.load(PS + soff, mask=col0, other=0.0) + tl.load(SALL + (c + 1).to(tl.int64) * s_sa_c + so, mask=col0, other=0.0)
    tl.store(PS + soff, ps, mask=col0)
    tl.store(SALL + (c + 1).to(tl.int64) * s_sa_c + so, tl.where(folded, ps - sacc, 0.0), mask=col0)


@dataclass(frozen=True)
class EvictionPlan:
    """Which evictions a `PrefillEvictions` runs: the LoLA grid (`window`, `chunk`, `lam` sparse pairs per sparse head,
    `sparse_heads` Hs, the heads of the sparse cache), `n_ev` evictions at the ends of chunks 0 .. n_ev - 1, from
    eviction `first` on (> 0: a continued prefill, the evictions before it done), with the self-recall error's
    denominator guard `eps`. Refused when built (ValueError): a count that is no int in range, first past n_ev, an
    eps that is no positive number."""

    window: int
    chunk: int
    lam: int
    sparse_heads: int
    n_ev: int
    first: int = 0
    eps: float = EPS_SRE

    def __post_init__(self):
        check_ints(self, window=0, chunk=1, lam=0, sparse_heads=1, n_ev=0, first=0)
        if self.first > self.n_ev:
            raise ValueError(f"EvictionPlan.first={self.first}: first eviction outside 0 .. n_ev={self.n_ev}")
        if not (isinstance(self.eps, numbers.Real) and not isinstance(self.eps, bool) and self.eps > 0):
            raise ValueError(f"EvictionPlan.eps={self.eps!r}: allowed a number > 0")


class PrefillEvictions:
    """Buffers and launches of the evictions of one LoLA prefill (see the comment above `_ev_candidates`).

    fk [B, Hq, S, F2] (phi(k) of every token), v [B, Hkv, S, D], key_mask [B, S] bool or None; `plan`
    (`EvictionPlan`): n_ev evictions at the ends of chunks 0 .. n_ev - 1 on its grid. After `run()`: H_all
    [n_ev + 1, B, Hq, F2, D], s_all, and the sparse slots SPIDX / SPSC [n_ev + 1, B, Hs, lam] (token positions,
    -1 = empty) that chunk c attends in slot c. tuning: the launches' tiles and warps (ev_*), the SRE precision
    (score_prec).

    plan.first > 0 (a continued prefill): the evictions before chunk `first` are done; `start` puts the state they
    left in slot `first` and `run()` runs evictions first .. n_ev - 1 only (slots before `first` stay unused).
    """

    def __init__(self, fk, v, key_mask, plan: EvictionPlan, *, tuning: LolaTuning = DEFAULT_TUNING):
        B, Hq, S, F2 = fk.shape
        D = v.shape[-1]
        dev = fk.device
        n_ev, lam, chunk, sparse_heads, first = plan.n_ev, plan.lam, plan.chunk, plan.sparse_heads, plan.first
        self.fk, self.v = fk, v
        self.km = key_mask.to(torch.int8).contiguous() if key_mask is not None else None
        self.B, self.Hq, self.Hs, self.F2, self.D = B, Hq, sparse_heads, F2, D
        self.G, self.GS = Hq // v.shape[1], Hq // sparse_heads
        self.n_ev, self.lam, self.C, self.W, self.eps = n_ev, lam, chunk, plan.window, plan.eps
        self.first = first
        self.NC = lam + chunk
        self.H_all = torch.zeros(n_ev + 1, B, Hq, F2, D, device=dev, dtype=torch.float32)
        self.s_all = torch.zeros(n_ev + 1, B, Hq, F2, device=dev, dtype=torch.float32)
        self.SPIDX = torch.full((n_ev + 1, B, sparse_heads, lam), -1, device=dev, dtype=torch.int32)
        self.SPSC = torch.full((n_ev + 1, B, sparse_heads, lam), float("-inf"), device=dev, dtype=torch.float32)
        self.SC = torch.empty(B, Hq, self.NC, device=dev, dtype=torch.float32)
        self.cnt = torch.full((1,), first, device=dev, dtype=torch.int32)
        # the running sum of the evicted pairs (the fold kernel adds eviction c's range sum, then subtracts the
        # sparse set: the state after eviction c is every evicted pair not kept exact)
        self.PH = torch.zeros(B, Hq, F2, D, device=dev, dtype=torch.float32)
        self.PS = torch.zeros(B, Hq, F2, device=dev, dtype=torch.float32)
        self.NFOLD = torch.zeros(B, sparse_heads, device=dev, dtype=torch.int32)  # pairs folded so far
        # SRE fp32-accurate: bf16 features as three bf16 tensor-core dots ("bf16x3"), else fp32 FMA ("ieee");
        # tf32 and tf32x3 were no faster than fp32 FMA on the H200 (benchmarks/results/lola/prefill-profile-tune-h200.json)
        self.tuning = tuning  # the launches' tiles and warps (ev_*), the SRE precision (score_prec)
        self.score_prec = tuning.score_prec or _score_prec(fk)
        self._evicted_range_sums()

    def _evicted_range_sums(self) -> None:
        """H_all[c + 1] / s_all[c + 1] = the sums over the pairs eviction c takes out of the window (positions
        c*C - W .. (c+1)*C - W - 1, those >= 0 and not padding), all evictions from `first` on in one parallel
        launch (on the slots from `first`: slot c + 1 - first of that view, keys offset by first * C)."""
        n = self.n_ev - self.first
        if n == 0:
            return
        H, S = self.H_all[self.first:], self.s_all[self.first:]
        _range_sums(self.fk, self.v, self.km, H, S, n, self.C, self.W - self.first * self.C,
                    (H.stride(1), H.stride(2), H.stride(0), H.stride(3)), (S.stride(1), S.stride(2), S.stride(0)))

    def start(self, H, s, sp_idx, sp_score) -> None:
        """The state the evictions before chunk `first` left (a continued prefill): (H, s) [B, Hq, F2, D] /
        [B, Hq, F2] fp32, the sparse slots sp_idx [B, Hs, lam] (rows of fk / v, -1 = empty) and their scores
        sp_score. The running sum of the evicted pairs starts at (H, s) plus the slots' pairs (every pair evicted so
        far is folded or in the sparse set: the fold keeps H = that sum minus the sparse set), and a sparse head
        counts as having folded pairs when its state is not 0 (until then its state stays exactly 0)."""
        f = self.first
        idx = sp_idx.to(torch.int32)
        self.H_all[f].copy_(H)
        self.s_all[f].copy_(s)
        self.SPIDX[f].copy_(idx)
        self.SPSC[f].copy_(torch.where(idx >= 0, sp_score.float(), float("-inf")))
        B, Hq, Hs, lam, F2 = self.B, self.Hq, self.Hs, self.lam, self.F2
        ok = idx >= 0
        il = idx.long().clamp_min(0)
        # phi(k) of each query head's sparse pairs, the values of each sparse head's pairs (kv head hs * Hkv // Hs)
        fks = torch.gather(self.fk, 2, il.repeat_interleave(self.GS, 1)[..., None].expand(B, Hq, lam, F2))
        hk = (torch.arange(Hs, device=idx.device) * self.v.shape[1] // Hs).view(1, Hs, 1)
        vs = self.v[torch.arange(B, device=idx.device).view(B, 1, 1), hk, il]  # [B, Hs, lam, D]
        self.PH.copy_(H)
        self.PS.copy_(s)
        fold_into_state(fks, vs, ok.float(), self.PH, self.PS, tuning=self.tuning)
        self.NFOLD.copy_((s != 0).view(B, Hs, self.GS, F2).flatten(2).any(-1).to(torch.int32))

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
        # tiles from the sweep at 32k, D = 64 (benchmarks/results/lola/prefill-profile-tune-h200.json): 128 candidates per
        # score program, a 8-warp select above 1024 candidates (16 and 4 were slower there), 4 warps below
        tn = self.tuning
        BN = min(tn.ev_score_bn or 128, np2(NC))
        _ev_score_kernel[(self.B * Hq, triton.cdiv(NC, BN))](
            self.cnt, self.SPIDX, km if km is not None else dummy, fk, v, self.H_all, self.s_all, self.SC,
            NC, self.lam, self.C, self.W, F2, D, self.G, self.GS, self.eps,
            *spi, fk.stride(0), fk.stride(1), fk.stride(2), v.stride(0), v.stride(1), v.stride(2),
            *ha, *sa, self.SC.stride(0), self.SC.stride(1),
            HQ=Hq, BN=BN, BD=np2(D), BK=min(64, np2(F2)), HAS_KM=km is not None, PREC=self.score_prec,
            num_warps=tn.ev_score_warps or 4, **({"num_stages": tn.ev_score_stages} if tn.ev_score_stages else {}),
        )
        rb = tn.ev_select_bits or 8
        _ev_select_kernel[(self.B * self.Hs,)](
            self.cnt, self.SPIDX, self.SPSC, km if km is not None else dummy, self.SC, self.NFOLD,
            NC, self.lam, self.C, self.W, *spi,
            self.SC.stride(0), self.SC.stride(1),
            HS=self.Hs, GS=self.GS, NCP=np2(NC), HAS_KM=km is not None, RB=rb, NBIN=1 << rb,
            num_warps=tn.ev_select_warps or (8 if NC > 1024 else 4),
        )
        blk = tn.ev_fold_block or 32
        BK, BV = min(blk, np2(F2)), min(blk, np2(D))
        _ev_fold_kernel[(self.B * Hq, triton.cdiv(F2, BK), triton.cdiv(D, BV))](
            self.cnt, self.SPIDX, fk, v, self.H_all, self.s_all, self.PH, self.PS, self.NFOLD,
            self.lam, F2, D, self.G, self.GS, self.Hs,
            *spi[:3], fk.stride(0), fk.stride(1), fk.stride(2), v.stride(0), v.stride(1), v.stride(2),
            *ha, *sa,
            HQ=Hq, BN=min(tn.ev_fold_bn or 128, np2(self.lam)), BK=BK, BV=BV,
            PREC=dot_precision(fk, v), num_warps=tn.ev_fold_warps or 4,
        )
        self.cnt += 1

    def _key(self):
        """What the kernels are specialised on: a graph captured for one key can be captured again without a
        compile (the launches are already warm)."""
        t = lambda x: None if x is None else (x.dtype, tuple(x.shape), tuple(x.stride()))  # noqa: E731
        return (self.fk.device, t(self.fk), t(self.v), t(self.km), self.n_ev, self.lam, self.C, self.W, self.Hs,
                self.score_prec, self.tuning)

    def run(self, graph: bool = True) -> None:
        """All evictions. On CUDA one eviction is captured in a CUDA graph and replayed for every eviction (same
        kernels, same order); the first time a configuration runs in this process, its first eviction runs
        eagerly before the capture (that compiles the kernels), later times the capture comes first, while
        the GPU still works on what was queued before. Elsewhere, or if the capture fails: eagerly."""
        key = self._key() if graph and self.fk.is_cuda else None
        self.graph = run_steps(self.step, self.n_ev - self.first, self.fk.device, graph=graph,
                               eager_first=key not in _WARM_EVICTIONS)
        if self.graph is not None:  # kept for the benchmark (replay cost alone)
            _WARM_EVICTIONS.add(key)


_WARM_EVICTIONS: set = set()  # PrefillEvictions keys whose kernels have run once (compiled)
