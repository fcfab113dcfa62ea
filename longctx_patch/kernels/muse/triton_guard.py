"""The Triton kernels of MuSe's run-time guard (`methods/muse/guard.py`): its sample's top rows and its error in a
few launches instead of some 65 small PyTorch ops.

Measured on an H100 at Qwen2.5-Coder-0.5B's shapes (docs/muse.md, "The estimate taken apart"), the PyTorch estimate
kept the GPU busy 0.41 ms of its 1.17 ms a layer at 32k: the rest was the host issuing 65 launches, and since the
guard reads its decision back in every layer, that time was not hidden behind the GPU's work. These kernels compute
the same values (`tests/test_muse_guard_kernels.py` against the PyTorch path, random and real-shaped inputs):

- `_norm_candidates`: one program per (batch row x head, block of BLOCK approximated rows): each row's |o_t| in fp32
  (as `vector_norm(o, dtype=float32)`), and the block's K largest (value, position), the rest of its rows dropped.
  The global top K of a head is among the union of its blocks' top K, so
- `_select_top`: one program per (batch row x head) merges its blocks' candidates into the K largest and writes the
  sample's positions `[ranks..., top rows...]` (the kept stratified ranks, then the head's top rows) in one tensor.
- `_weighted_error`: one program per (batch row x head): the sampled rows of MuSe's output `o` and of the exact rows
  `ref`, the weights (given, or the stratified weights with the rows that are also top rows dropped and the rest
  scaled to stand for the approximated rows that are not top rows), and `sqrt(sum w |o - ref|^2 / sum w |ref|^2)`,
  NaN where nothing is measured.

Ties between equal norms may pick other rows than `torch.topk` does (the estimate is then of an equally valid sample).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .support import GUARD_TOP_MAX, guard_kernels_missing  # noqa: F401  (re-exported)

_BLOCK = 512  # approximated rows per program of _norm_candidates
_CHUNK = 1024  # candidates per step of _select_top
_RB = 16  # sampled rows per step of _weighted_error


@triton.jit
def _norm_candidates(O, CV, CI, sob, sos, soh, S, first, NB, HQ: tl.constexpr, D: tl.constexpr, DC: tl.constexpr,
                     BLOCK: tl.constexpr, K: tl.constexpr, KP: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)
    nb = tl.program_id(1)
    b = bh // HQ
    h = bh % HQ
    r = tl.arange(0, BLOCK)
    rows = first + nb * BLOCK + r
    valid = rows < S
    base = O + b * sob + h * soh
    acc = tl.zeros([BLOCK], tl.float32)
    for d0 in tl.static_range(0, D, DC):
        d = d0 + tl.arange(0, DC)
        x = tl.load(base + rows.to(tl.int64)[:, None] * sos + d[None, :], mask=valid[:, None], other=0.0)
        x = x.to(tl.float32)
        acc += tl.sum(x * x, axis=1)
    vals = tl.where(valid, tl.sqrt(acc), float("-inf"))
    kk = tl.arange(0, KP)
    out_v = tl.full([KP], float("-inf"), tl.float32)
    out_i = tl.zeros([KP], tl.int64)
    for j in tl.static_range(K):
        mx = tl.max(vals, axis=0)
        am = tl.argmax(vals, axis=0)
        out_v = tl.where(kk == j, mx, out_v)
        out_i = tl.where(kk == j, (first + nb * BLOCK + am).to(tl.int64), out_i)
        vals = tl.where(r == am, float("-inf"), vals)
    off = bh * NB * K + nb * K + kk
    tl.store(CV + off, out_v, mask=kk < K)
    tl.store(CI + off, out_i, mask=kk < K)


@triton.jit
def _select_top(CV, CI, RANKS, POS, spb, sph, NC, MS, HQ: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
                MSP: tl.constexpr, CHUNK: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)
    b = bh // HQ
    h = bh % HQ
    prow = POS + b * spb + h * sph
    m = tl.arange(0, MSP)
    tl.store(prow + m, tl.load(RANKS + m, mask=m < MS, other=0), mask=m < MS)
    kk = tl.arange(0, KP)
    best_v = tl.full([KP], float("-inf"), tl.float32)
    best_i = tl.zeros([KP], tl.int64)
    c = tl.arange(0, CHUNK)
    for c0 in range(0, NC, CHUNK):
        cm = c0 + c < NC
        v = tl.load(CV + bh * NC + c0 + c, mask=cm, other=float("-inf"))
        idx = tl.load(CI + bh * NC + c0 + c, mask=cm, other=0)
        bv = tl.where(kk < K, best_v, float("-inf"))
        new_v = tl.full([KP], float("-inf"), tl.float32)
        new_i = tl.zeros([KP], tl.int64)
        for j in tl.static_range(K):  # the K largest of the kept ones and this chunk's
            m1 = tl.max(bv, axis=0)
            a1 = tl.argmax(bv, axis=0)
            m2 = tl.max(v, axis=0)
            a2 = tl.argmax(v, axis=0)
            take1 = m1 >= m2
            sel1 = take1.to(tl.int32)
            i1 = tl.sum(tl.where(kk == a1, best_i, 0), axis=0)
            i2 = tl.sum(tl.where(c == a2, idx, 0), axis=0)
            new_v = tl.where(kk == j, tl.where(take1, m1, m2), new_v)
            new_i = tl.where(kk == j, tl.where(take1, i1, i2), new_i)
            bv = tl.where((kk == a1).to(tl.int32) * sel1 > 0, float("-inf"), bv)
            v = tl.where((c == a2).to(tl.int32) * (1 - sel1) > 0, float("-inf"), v)
        best_v = new_v
        best_i = new_i
    tl.store(prow + MS + kk, best_i, mask=kk < K)


@triton.jit
def _weighted_error(O, REF, POS, W, HM, ERR, sob, sos, soh, srb, srh, sri, spb, sph, swb, swh, swi, M, MS, rest,
                    HQ: tl.constexpr, D: tl.constexpr, TOPS: tl.constexpr, HAS_HM: tl.constexpr, RB: tl.constexpr,
                    TP: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)
    b = bh // HQ
    h = bh % HQ
    prow = POS + b * spb + h * sph
    wrow = W + b * swb + h * swh
    r = tl.arange(0, RB)
    d = tl.arange(0, D)
    if TOPS:  # the stratified rows that are also top rows are dropped, the others scaled to count `rest` rows
        t = tl.arange(0, TP)
        tpos = tl.load(prow + MS + t, mask=t < M - MS, other=-1)
        wsum_v = tl.zeros([RB], tl.float32)
        for i0 in range(0, MS, RB):
            rm = i0 + r < MS
            p = tl.load(prow + i0 + r, mask=rm, other=-2)
            w = tl.load(wrow + (i0 + r) * swi, mask=rm, other=0.0).to(tl.float32)
            taken = tl.sum((p[:, None] == tpos[None, :]).to(tl.int32), axis=1) > 0
            wsum_v += tl.where(taken, 0.0, w)
        scale = rest / tl.maximum(tl.sum(wsum_v, axis=0), 1.0)
    num_v = tl.zeros([RB], tl.float32)
    den_v = tl.zeros([RB], tl.float32)
    used = tl.zeros([RB], tl.int32)
    for i0 in range(0, M, RB):
        i = i0 + r
        rm = i < M
        p = tl.load(prow + i, mask=rm, other=0)
        if TOPS:
            strat = i < MS
            w = tl.load(wrow + i * swi, mask=rm & strat, other=0.0).to(tl.float32)
            taken = tl.sum((p[:, None] == tpos[None, :]).to(tl.int32), axis=1) > 0
            w = tl.where(strat, tl.where(taken, 0.0, w * scale), 1.0)
        else:
            w = tl.load(wrow + i * swi, mask=rm, other=0.0).to(tl.float32)
        w = tl.where(rm, w, 0.0)
        use = w > 0
        got = tl.load(O + b * sob + p.to(tl.int64)[:, None] * sos + h * soh + d[None, :], mask=use[:, None],
                      other=0.0).to(tl.float32)
        ref = tl.load(REF + b * srb + h * srh + i.to(tl.int64)[:, None] * sri + d[None, :], mask=use[:, None],
                      other=0.0).to(tl.float32)
        diff = got - ref
        num_v += tl.where(use, w * tl.sum(diff * diff, axis=1), 0.0)
        den_v += tl.where(use, w * tl.sum(ref * ref, axis=1), 0.0)
        used += use.to(tl.int32)
    num = tl.sum(num_v, axis=0)
    den = tl.sum(den_v, axis=0)
    e = tl.where(den > 0, tl.sqrt(num / tl.maximum(den, 1.1754943508222875e-38)),
                 tl.where(num > 0, float("inf"), 0.0))
    ok = tl.sum(used, axis=0) > 0
    if HAS_HM:
        ok = ok & (tl.load(HM + h) != 0)
    tl.store(ERR + bh, tl.where(ok, e, float("nan")))


def guard_top_sample(o: torch.Tensor, ranks: torch.Tensor, first: int, top: int) -> torch.Tensor:
    """The sample of an unpadded call: positions [B, Hq, ms + top] long, each head's row being the stratified `ranks`
    [ms] (the same for every head), then the head's `top` approximated rows (positions >= first) of largest |o_t|.
    o [B, S, Hq, D] is MuSe's output (last dim contiguous)."""
    B, S, Hq, D = o.shape
    if o.stride(-1) != 1:
        o = o.contiguous()
    ms = ranks.shape[0]
    A = S - first
    NB = triton.cdiv(A, _BLOCK)
    KP = triton.next_power_of_2(max(top, 1))
    cv = torch.empty(B * Hq, NB * top, device=o.device, dtype=torch.float32)
    ci = torch.empty(B * Hq, NB * top, device=o.device, dtype=torch.long)
    _norm_candidates[(B * Hq, NB)](o, cv, ci, o.stride(0), o.stride(1), o.stride(2), S, first, NB,
                                   HQ=Hq, D=D, DC=min(D, 16), BLOCK=_BLOCK, K=top, KP=KP, num_warps=4)
    pos = torch.empty(B, Hq, ms + top, device=o.device, dtype=torch.long)
    _select_top[(B * Hq,)](cv, ci, ranks, pos, pos.stride(0), pos.stride(1), NB * top, ms,
                           HQ=Hq, K=top, KP=KP, MSP=triton.next_power_of_2(max(ms, 1)), CHUNK=_CHUNK, num_warps=4)
    return pos


def guard_weighted_errors(o: torch.Tensor, ref: torch.Tensor, pos: torch.Tensor, w: torch.Tensor, *,
                          stratified: int | None = None, rest: float = 0.0,
                          head_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Each (batch row, head)'s estimated error, [B, Hq] fp32 (NaN where nothing is measured or `head_mask` [Hq] is
    False). o [B, S, Hq, D] MuSe's output; ref [B, Hq, m, D] the sampled rows' exact attention (any dtype, last dim
    contiguous); pos [B, Hq, m] their positions.

    stratified None: w [B, Hq, m] are the rows' weights. stratified = ms: the first ms rows are stratified rows
    with weights w [B, Hq, ms] (broadcast views welcome), the last m - ms each head's top rows (weight 1); a
    stratified row that is also a top row counts 0 and the others are scaled to sum to `rest`."""
    B, S, Hq, D = o.shape
    m = pos.shape[2]
    if o.stride(-1) != 1:
        o = o.contiguous()
    if ref.stride(-1) != 1:
        ref = ref.contiguous()
    tops = stratified is not None
    ms = stratified if tops else m
    err = torch.empty(B, Hq, device=o.device, dtype=torch.float32)
    hm = head_mask if head_mask is not None else err
    _weighted_error[(B * Hq,)](
        o, ref, pos, w, hm, err, o.stride(0), o.stride(1), o.stride(2), ref.stride(0), ref.stride(1), ref.stride(2),
        pos.stride(0), pos.stride(1), w.stride(0), w.stride(1), w.stride(2), m, ms, float(rest),
        HQ=Hq, D=D, TOPS=tops, HAS_HM=head_mask is not None, RB=_RB,
        TP=triton.next_power_of_2(max(m - ms, 1)), num_warps=4)
    return err


__all__ = ["GUARD_TOP_MAX", "guard_kernels_missing", "guard_top_sample", "guard_weighted_errors"]
