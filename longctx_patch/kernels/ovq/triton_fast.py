"""Fused no-grad OVQ path (prefill and decode): dictionary updated in place, no host sync.

Per chunk:

* ``_ovq_fwd_split`` + ``_ovq_combine``: queries of the chunk attend to the dictionary, read directly
  in its sum form (row mean = sum / count, bias log count) and split over programs by rows
  (flash-decoding style, so that a chunk fills the GPU), and to the chunk's keys (causal, padding);
  the partial softmaxes are merged by ``_ovq_combine``;
* ``_ovq_chunk_stats`` (triton_dict.py, row-split): max dot product and nearest row per token;
* ``_ovq_rank``: reduces the splits and ranks the tokens by spread score (while the dictionary grows);
* ``_ovq_absorb``: picks each token's row (new row if selected, else nearest among old and new rows)
  and adds it with atomic adds (sums and counts): each token touches exactly one row;
* ``_ovq_means`` (mean form): the row means of the rows the chunk's tokens joined.

Runs of whole chunks take the chunk index from a device counter (``DEV_T``), so one captured CUDA graph
replays every chunk of a run.

Same maths as ``reference.update_state`` + ``reference.chunk_attention_ref``; see docs/ovq.md.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..backend import INTERPRET
from ..graphs import run_steps
from ..triton_lib import combine_splits, dot
from .options import DEFAULT_OPTIONS, OvqKernelOptions
from .reference import OVQState, target_centroids, target_int
from .triton_dict import _ovq_chunk_stats



# the dictionary's size and the splits over it change with the context (n_dict grows until max_centroids): not
# specialised, so that a decode at another length reuses the compiled kernel (a 16-divisible n_dict compiled a second
# variant at the first step of a 32k decode after a 2k one: 0.6 s, benchmarks/results/speed/*-ovq-calls-h200.json)
@triton.jit(do_not_specialize=["n_dict", "NSPLIT"])
def _ovq_fwd_split(Q, KS, VS, CNT, KC, VC, VALID, PACC, PM, PL, TPTR, NACT,
                   sqb, sqh, sqm, sdb, sdh, sdn, svdb, svdh, svdn, scb, sch,
                   skb, skh, skn, svb, svh, svn, sxb,
                   M, LC, n_dict, q_off, HQ, G, ROWS, NSPLIT, NB,
                   D: tl.constexpr, DV: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, UP: tl.constexpr,
                   DEV_T: tl.constexpr, MEAN: tl.constexpr = False):
    """Partial softmax of one block of queries over one split: dictionary rows
    [p * ROWS, (p + 1) * ROWS) for p < NSPLIT - 1, the chunk's own keys for p == NSPLIT - 1.
    Writes the unnormalised accumulator, running max (log2 units) and sum to PACC / PM / PL.
    DEV_T: the chunk is number ``t = *TPTR`` of a run of whole chunks (Q, KC, VC, VALID point at the run's
    first chunk; M == LC == the chunk size) and its dictionary has ``NACT[t * NB + b]`` rows (``n_dict`` unused).
    MEAN: KS / VS hold the row means in Q's dtype (``_ovq_means``) instead of the float32 sums."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)  # 64-bit base offsets (docs/PERFORMANCE.md, "Large shapes")
    pid_p = tl.program_id(2)
    b = pid_bh // HQ
    hq = pid_bh % HQ
    hk = hq // G
    if DEV_T:
        t = tl.load(TPTR).to(tl.int64)
        n_dict = tl.load(NACT + t * NB + b)
        Q += t * M * sqm
        KC += t * LC * skn
        VC += t * LC * svn
        VALID += t * LC
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, D)
    offs_dv = tl.arange(0, DV)
    mask_m = offs_m < M
    q = tl.load(Q + b * sqb + hq * sqh + offs_m[:, None] * sqm + offs_d[None, :], mask=mask_m[:, None], other=0.0)
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, DV], tl.float32)
    is_chunk = pid_p == NSPLIT - 1
    # -- dictionary rows (sum form: mean = sum / count, bias log2 count) --
    lo = pid_p * ROWS
    hi = tl.where(is_chunk, 0, tl.minimum(lo + ROWS, n_dict))
    ksb = KS + b * sdb + hk * sdh
    vsb = VS + b * svdb + hk * svdh
    cb = CNT + b * scb + hk * sch
    for start in range(lo, hi, BN):
        offs_n = start + tl.arange(0, BN)
        in_n = offs_n < hi
        cnt = tl.load(cb + offs_n, mask=in_n, other=0.0)
        if MEAN:
            ks = tl.load(ksb + offs_n[:, None] * sdn + offs_d[None, :], mask=in_n[:, None], other=0.0)
            s = dot(q, tl.trans(ks), "ieee", UP) * 1.4426950408889634
        else:
            inv = 1.0 / tl.maximum(cnt, 1.0)
            ks = tl.load(ksb + offs_n[:, None] * sdn + offs_d[None, :], mask=in_n[:, None], other=0.0)
            s = dot(q, tl.trans((ks * inv[:, None]).to(q.dtype)), "ieee", UP) * 1.4426950408889634
        bias = tl.where(cnt > 0, tl.log2(tl.maximum(cnt, 1.0)), float("-inf"))
        s = s + bias[None, :]
        # the online-softmax steps of this kernel are written out as in _ovq_attn_fwd (triton_attn.py says why)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        vs = tl.load(vsb + offs_n[:, None] * svdn + offs_dv[None, :], mask=in_n[:, None], other=0.0)
        if MEAN:
            acc = acc * alpha[:, None] + dot(p.to(q.dtype), vs, "ieee", UP)
        else:
            acc = acc * alpha[:, None] + dot(p.to(q.dtype), (vs * inv[:, None]).to(q.dtype), "ieee", UP)
        m_i = m_new
    # -- the chunk's own keys, causal, key padding --
    chi = tl.where(is_chunk, tl.minimum((pid_m + 1) * BM + q_off, LC), 0)
    kb = KC + b * skb + hk * skh
    vb = VC + b * svb + hk * svh
    for start in range(0, chi, BN):
        offs_n = start + tl.arange(0, BN)
        in_n = offs_n < LC
        ok = tl.load(VALID + b * sxb + offs_n, mask=in_n, other=0) != 0
        k = tl.load(kb + offs_n[:, None] * skn + offs_d[None, :], mask=in_n[:, None], other=0.0)
        s = dot(q, tl.trans(k), "ieee", UP) * 1.4426950408889634
        allowed = (offs_n[None, :] <= (offs_m[:, None] + q_off)) & ok[None, :]
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(vb + offs_n[:, None] * svn + offs_dv[None, :], mask=in_n[:, None], other=0.0)
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, "ieee", UP)
        m_i = m_new
    row = (pid_p.to(tl.int64) * tl.num_programs(1) + pid_bh) * M + offs_m  # split-major partials: 64-bit
    tl.store(PM + row, m_i, mask=mask_m)
    tl.store(PL + row, l_i, mask=mask_m)
    tl.store(PACC + row[:, None] * DV + offs_dv[None, :], acc, mask=mask_m[:, None])


@triton.jit(do_not_specialize=["NSPLIT"])
def _ovq_combine(PACC, PM, PL, O, TPTR, sob, soh, som, M, HQ, NSPLIT, DV: tl.constexpr, BM: tl.constexpr,
                 DEV_T: tl.constexpr):
    """Merges the NSPLIT partial softmaxes of ``_ovq_fwd_split`` into O (DEV_T: chunk ``*TPTR`` of the run)."""
    if DEV_T:
        O += tl.load(TPTR).to(tl.int64) * M * som
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)  # 64-bit base offsets (docs/PERFORMANCE.md, "Large shapes")
    b = pid_bh // HQ
    hq = pid_bh % HQ
    BH = tl.num_programs(1)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_dv = tl.arange(0, DV)
    mask_m = offs_m < M
    acc, l = combine_splits(PACC, PM, PL, pid_bh, BH, M, offs_m, mask_m, NSPLIT, DV, BM, True)
    o = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(O + b * sob + hq * soh + offs_m[:, None] * som + offs_dv[None, :], o.to(O.dtype.element_ty),
             mask=mask_m[:, None])


@triton.jit
def _ovq_rank(VALID, PMAXDOT, PBEST, PIDX, NNEW, BEST, IDX, RANK, TPTR, sxb, C, H, NSPLIT, NB, BI: tl.constexpr,
              DEV_T: tl.constexpr):
    """Reduce the row-split statistics of a block of tokens; rank them by spread score (smallest max
    dot product with the old rows first, ties by position) while the dictionary grows.
    DEV_T: chunk ``t = *TPTR`` of a run (VALID at its first chunk, NNEW a ``[T, NB]`` table)."""
    pid = tl.program_id(0).to(tl.int64)  # 64-bit base offsets (docs/PERFORMANCE.md, "Large shapes")
    pid_i = tl.program_id(1)
    b = pid // H
    if DEV_T:
        t = tl.load(TPTR).to(tl.int64)
        VALID += t * C
        NNEW += t * NB
    BH = tl.num_programs(0)
    n_new = tl.load(NNEW + b)
    oi = pid_i * BI + tl.arange(0, BI)
    in_i = oi < C
    si = tl.full([BI], float("-inf"), tl.float32)
    best = tl.full([BI], float("-inf"), tl.float32)
    idx = tl.zeros([BI], tl.int64)
    for p in range(0, NSPLIT):
        off = (p * BH.to(tl.int64) + pid) * C + oi  # split-major partials: 64-bit
        si = tl.maximum(si, tl.load(PMAXDOT + off, mask=in_i, other=float("-inf")))
        bp = tl.load(PBEST + off, mask=in_i, other=float("-inf"))
        ip = tl.load(PIDX + off, mask=in_i, other=0)
        upd = bp > best
        best = tl.where(upd, bp, best)
        idx = tl.where(upd, ip, idx)
    tl.store(BEST + pid * C + oi, best, mask=in_i)
    tl.store(IDX + pid * C + oi, idx, mask=in_i)
    vi = tl.load(VALID + b * sxb + oi, mask=in_i, other=0) != 0
    si = tl.where(vi, si, float("inf"))
    rank = tl.zeros([BI], tl.int32)
    c_grow = tl.where(n_new > 0, C, 0)
    for j0 in range(0, c_grow, BI):
        oj = j0 + tl.arange(0, BI)
        in_j = oj < C
        sj = tl.full([BI], float("-inf"), tl.float32)
        for p in range(0, NSPLIT):
            sj = tl.maximum(sj, tl.load(PMAXDOT + (p * BH.to(tl.int64) + pid) * C + oj, mask=in_j, other=float("-inf")))
        vj = tl.load(VALID + b * sxb + oj, mask=in_j, other=0) != 0
        sj = tl.where(vj, sj, float("inf"))
        before = (sj[None, :] < si[:, None]) | ((sj[None, :] == si[:, None]) & (oj[None, :] < oi[:, None]))
        rank += tl.sum((before & in_j[None, :]).to(tl.int32), 1)
    tl.store(RANK + pid * C + oi, rank, mask=in_i)


@triton.jit
def _ovq_absorb(KC, VC, VALID, BEST, IDX, NNEW, NACT, RANK, KS, VS, CNT, ROW_OUT, TPTR,
                skb, skh, skn, svb, svh, svn, sxb, sdb, sdh, sdn, svdb, svdh, svdn, scb, sch,
                C, H, NB,
                D: tl.constexpr, DV: tl.constexpr, BI: tl.constexpr, IEEE: tl.constexpr,
                ASSIGN_ONLY: tl.constexpr, STORE_ROWS: tl.constexpr, DEV_T: tl.constexpr, ROW_T: tl.constexpr = True):
    """Row of every token of a block (new row if selected, else the nearest among old and new rows),
    then atomic adds of its key, value and 1 into that row: each token touches one row.
    ASSIGN_ONLY: write the rows (-1 for padding) to ROW_OUT ``[B * H, C]`` instead (training path);
    STORE_ROWS: write them and absorb (the chunk-parallel training path's assignment pass).
    DEV_T: chunk ``t = *TPTR`` of a run (KC, VC, VALID at its first chunk; NNEW, NACT ``[T, NB]`` tables;
    ROW_OUT ``[T, NB * H, C]``; ROW_T False: one chunk's ``[NB * H, C]`` scratch, the same for every chunk)."""
    pid = tl.program_id(0).to(tl.int64)  # 64-bit base offsets (docs/PERFORMANCE.md, "Large shapes")
    pid_i = tl.program_id(1)
    b = pid // H
    h = pid % H
    if DEV_T:
        t = tl.load(TPTR).to(tl.int64)
        KC += t * C * skn
        VC += t * C * svn
        VALID += t * C
        NNEW += t * NB
        NACT += t * NB
        if ROW_T:
            ROW_OUT += t * NB * H * C
    n_new = tl.load(NNEW + b)
    n_act = tl.load(NACT + b)
    offs_d = tl.arange(0, D)
    offs_dv = tl.arange(0, DV)
    sbase = pid * C
    c_grow = tl.where(n_new > 0, C, 0)
    oi = pid_i * BI + tl.arange(0, BI)
    in_i = oi < C
    vi = (tl.load(VALID + b * sxb + oi, mask=in_i, other=0) != 0) & in_i
    ri = tl.load(RANK + sbase + oi, mask=in_i, other=0)
    sel_i = vi & (ri < n_new) & (n_new > 0)
    ki = tl.load(KC + b * skb + h * skh + oi[:, None] * skn + offs_d[None, :], mask=in_i[:, None],
                 other=0.0).to(tl.float32)
    best_n = tl.full([BI], float("-inf"), tl.float32)
    rank_n = tl.zeros([BI], tl.int32) + C
    for j0 in range(0, c_grow, BI):
        oj = j0 + tl.arange(0, BI)
        in_j = oj < C
        vj = (tl.load(VALID + b * sxb + oj, mask=in_j, other=0) != 0) & in_j
        rj = tl.load(RANK + sbase + oj, mask=in_j, other=0)
        sel_j = vj & (rj < n_new)
        kj = tl.load(KC + b * skb + h * skh + oj[:, None] * skn + offs_d[None, :], mask=in_j[:, None],
                     other=0.0).to(tl.float32)
        if IEEE:
            dots = tl.dot(ki, tl.trans(kj), input_precision="ieee")
        else:
            dots = tl.dot(ki, tl.trans(kj))
        score = dots - 0.5 * tl.sum(kj * kj, 1)[None, :]
        score = tl.where(sel_j[None, :], score, float("-inf"))
        bm = tl.max(score, 1)
        cand = tl.where((score == bm[:, None]) & sel_j[None, :], rj[None, :], C)
        rk = tl.min(cand, 1)
        upd = (bm > best_n) | ((bm == best_n) & (rk < rank_n))
        best_n = tl.where(upd, bm, best_n)
        rank_n = tl.where(upd, rk, rank_n)
    best_o = tl.load(BEST + sbase + oi, mask=in_i, other=float("-inf"))
    idx_o = tl.load(IDX + sbase + oi, mask=in_i, other=0).to(tl.int32)
    use_new = (best_n > best_o) & (rank_n < C)
    row = tl.where(sel_i, n_act + ri, tl.where(use_new, n_act + rank_n, idx_o))
    if ASSIGN_ONLY or STORE_ROWS:
        tl.store(ROW_OUT + sbase + oi, tl.where(vi, row, -1).to(tl.int64), mask=in_i)
    if ASSIGN_ONLY:
        return
    vv = tl.load(VC + b * svb + h * svh + oi[:, None] * svn + offs_dv[None, :], mask=in_i[:, None],
                 other=0.0).to(tl.float32)
    tl.atomic_add(KS + b * sdb + h * sdh + row[:, None] * sdn + offs_d[None, :], ki, mask=vi[:, None])
    tl.atomic_add(VS + b * svdb + h * svdh + row[:, None] * svdn + offs_dv[None, :], vv, mask=vi[:, None])
    tl.atomic_add(CNT + b * scb + h * sch + row, tl.full([BI], 1.0, tl.float32), mask=vi)


@triton.jit
def _ovq_means(ROWS, KS, VS, CNT, KM, VM, KH, TPTR,
               sdb, sdh, sdn, svdb, svdh, svdn, scb, sch, smb, smh, smn, svmb, svmh, svmn,
               C, H, NB,
               D: tl.constexpr, DV: tl.constexpr, BI: tl.constexpr, FROM_ROWS: tl.constexpr, DEV_T: tl.constexpr,
               ROW_T: tl.constexpr):
    """Row means of the dictionary in the attention's dtype, KM = KS / count and VM = VS / count, and
    KH = |KS / count|^2 / 2 in float32 (the assignment score's norm term). FROM_ROWS: the rows the chunk's
    tokens joined (ROWS ``[NB * H, C]``, -1 for padding; with DEV_T and ROW_T at chunk ``*TPTR`` of a
    ``[T, NB * H, C]`` table), after ``_ovq_absorb``; else rows [pid_i * BI, (pid_i + 1) * BI) of C rows."""
    pid = tl.program_id(0).to(tl.int64)  # 64-bit base offsets (docs/PERFORMANCE.md, "Large shapes")
    pid_i = tl.program_id(1)
    b = pid // H
    h = pid % H
    oi = pid_i * BI + tl.arange(0, BI)
    in_i = oi < C
    if FROM_ROWS:
        if DEV_T:
            if ROW_T:
                ROWS += tl.load(TPTR).to(tl.int64) * NB * H * C
        r = tl.load(ROWS + pid * C + oi, mask=in_i, other=-1)
        ok = in_i & (r >= 0)
        r = tl.where(ok, r, 0)
    else:
        r = oi
        ok = in_i
    offs_d = tl.arange(0, D)
    offs_dv = tl.arange(0, DV)
    cnt = tl.load(CNT + b * scb + h * sch + r, mask=ok, other=1.0)
    inv = 1.0 / tl.maximum(cnt, 1.0)
    mk = tl.load(KS + b * sdb + h * sdh + r[:, None] * sdn + offs_d[None, :], mask=ok[:, None],
                 other=0.0) * inv[:, None]
    mv = tl.load(VS + b * svdb + h * svdh + r[:, None] * svdn + offs_dv[None, :], mask=ok[:, None],
                 other=0.0) * inv[:, None]
    tl.store(KM + b * smb + h * smh + r[:, None] * smn + offs_d[None, :], mk.to(KM.dtype.element_ty), mask=ok[:, None])
    tl.store(VM + b * svmb + h * svmh + r[:, None] * svmn + offs_dv[None, :], mv.to(VM.dtype.element_ty),
             mask=ok[:, None])
    tl.store(KH + b * scb + h * sch + r, 0.5 * tl.sum(mk * mk, 1), mask=ok)  # KH: laid out as CNT


def _blk(M: int, options: OvqKernelOptions = DEFAULT_OPTIONS) -> tuple[int, int]:
    """Query block and warps; `options.block_m` caps the block (benchmarks try 64 and 128)."""
    cap = options.block_m
    if M <= 16:
        return 16, 4
    if M <= 32:
        return 32, 4
    if M <= 64 or cap <= 64:
        return 64, 4
    return 128, 8


def _assign_scratch(splits: int, B: int, H: int, C: int, device):
    """Buffers of the assignment kernels for one chunk of C keys: per dictionary-row split, the best
    similarity, the spread statistic and the row index (pmax, pbest, pidx); reduced, the best similarity,
    its row and the rank of each key (best, idx, rank)."""
    n = B * H * C
    pmax = torch.empty(splits * n, device=device, dtype=torch.float32)
    return (pmax, torch.empty_like(pmax), torch.empty(splits * n, device=device, dtype=torch.int64),
            torch.empty(n, device=device, dtype=torch.float32), torch.empty(n, device=device, dtype=torch.int64),
            torch.empty(n, device=device, dtype=torch.int32))


_UNUSED: dict = {}


def _unused_i32(device) -> torch.Tensor:
    """A one-element int32 tensor per device, passed where a kernel's counter argument is not read."""
    t = _UNUSED.get(device)
    if t is None:
        t = _UNUSED[device] = torch.zeros(1, device=device, dtype=torch.int32)
    return t


def _rows_per_split(M: int, attention: bool = False, options: OvqKernelOptions = DEFAULT_OPTIONS) -> int:
    """Dictionary rows per program: of the attention (``_ovq_fwd_split``) of M queries, or of the assignment
    statistics of a chunk of M keys. H200, 64k prefill, chunk 512 (docs/PERFORMANCE.md, OVQ): 1024 rows per
    attention program beat 512 (fewer partial softmaxes to merge); the statistics keep 512 (with 8 kv heads,
    1024 leaves too few programs). `options.split_rows` sets both."""
    if options.split_rows is not None:
        return options.split_rows
    if M <= 16:
        return 256
    return 1024 if attention else 512


@torch.no_grad()
def ovq_forward_fast(q, kk, vv, valid, off: int, state: OVQState, seen_bound: int, *, chunk_size: int,
                     max_centroids: int, growth: float, exact_assign: bool = False, rows_out=None,
                     options: OvqKernelOptions = DEFAULT_OPTIONS):
    """No-grad OVQ over ``kk``/``vv`` (open chunk + new tokens, ``[B, H, L, D]``; ``valid`` ``[B, L]``).

    ``q``: ``[B, Hq, L - off, D]`` queries of the new tokens, or None (no attention: only the dictionary
    update, ``o`` is None).  ``state`` is updated in place.  ``rows_out``: optional ``[L // C, B, H, C]``
    int64 tensor that receives the row of every token of every complete chunk (-1 for padding).
    Per chunk: ``_ovq_fwd_split`` (dictionary rows split over programs, plus the chunk's keys) and
    ``_ovq_combine``; for a complete chunk also ``_ovq_chunk_stats`` (row-split), ``_ovq_rank`` and
    ``_ovq_absorb``.  No host sync.  The whole chunks whose queries are all new tokens run as one run: the
    kernels read the chunk index from a device counter, so on CUDA one chunk is captured in a CUDA graph and
    replayed (``options.graph_runs``; False: launched one by one, host-bound); with bf16 assignment dots the run reads
    row means kept beside the sums (``options.mean_form``, ``_ovq_means``; False: the sums, the same rows); the
    launch tiles come from ``options`` too (`options.OvqKernelOptions`).  docs/ovq.md, "Kernels".
    Returns ``(o, state, start of the open chunk in kk, seen_bound)``.
    """
    B, H, L, D = kk.shape
    DV = vv.shape[-1]
    HQ, S = (q.shape[1], q.shape[2]) if q is not None else (H, L - off)
    C = chunk_size
    q = q.contiguous() if q is not None else None
    kk, vv = kk.contiguous(), vv.contiguous()
    valid8 = valid.to(torch.int8).contiguous()
    o = torch.empty(B, HQ, S, DV, device=kk.device, dtype=q.dtype) if q is not None else None
    KS, VS, CNT = state.key_sums, state.value_sums, state.counts
    assert KS.is_contiguous() and VS.is_contiguous() and CNT.is_contiguous()
    n_full = L // C
    G = HQ // H
    up = INTERPRET
    Mmax = min(C, S)
    R_att = _rows_per_split(Mmax, attention=True, options=options)
    P_att = triton.cdiv(max_centroids, R_att) + 1
    if q is not None:
        pacc = torch.empty(P_att * B * HQ * Mmax * DV, device=kk.device, dtype=torch.float32)
        pm = torch.empty(P_att * B * HQ * Mmax, device=kk.device, dtype=torch.float32)
        pl = torch.empty_like(pm)
    if n_full > 0:
        m = valid[:, : n_full * C].reshape(B, n_full, C).sum(-1)
        seen_after = state.seen[:, None] + torch.cumsum(m, 1)
        t_after = target_centroids(seen_after, max_centroids, growth)
        t_before = target_centroids(seen_after - m, max_centroids, growth)
        nact_t = t_before.t().to(torch.int32).contiguous()           # [T, B]
        nnew_t = (t_after - t_before).t().to(torch.int32).contiguous()
        R_st = _rows_per_split(C, options=options)
        P_st = triton.cdiv(max_centroids, R_st)
        pmax, pbest, pidx, best, idx, rank = _assign_scratch(P_st, B, H, C, kk.device)
    if rows_out is not None:
        assert rows_out.shape == (n_full, B, H, C) and rows_out.dtype == torch.int64 and rows_out.is_contiguous()
    BI = 64
    BN_D = options.block_n  # dictionary rows per tile (benchmarks try 128)
    # whole chunks whose queries all are new tokens form one run (DEV_T); the chunk holding the open chunk's
    # tail (queries start inside it) and the last, incomplete chunk run on their own
    t_a, n_chunks = -(-off // C), -(-L // C)
    n_run = max(0, n_full - t_a)
    # chunk index of a run (DEV_T launches); calls without a run (decode steps) pass a shared unused int32
    ctr = torch.zeros(1, device=kk.device, dtype=torch.int32) if n_run > 0 else _unused_i32(kk.device)

    def _means(rows, KM, VM, KH, n, *, from_rows, dev_t, row_t):  # all n rows, or the rows a chunk's tokens joined
        _ovq_means[(B * H, triton.cdiv(n, BI))](
            rows, KS, VS, CNT, KM, VM, KH, ctr, KS.stride(0), KS.stride(1), KS.stride(2), VS.stride(0), VS.stride(1),
            VS.stride(2), CNT.stride(0), CNT.stride(1), KM.stride(0), KM.stride(1), KM.stride(2), VM.stride(0),
            VM.stride(1), VM.stride(2), n, H, B, D=D, DV=DV, BI=BI, FROM_ROWS=from_rows, DEV_T=dev_t, ROW_T=row_t)

    # mean form: with a run of chunks and bf16 assignment dots, the attention and the assignment read the row
    # means (in the attention's dtype) and their halved squared norms, refreshed for the rows each chunk touched
    mean = options.mean_form and not exact_assign and n_run >= 2
    if mean:
        NR = KS.shape[2]
        mdt = q.dtype if q is not None else kk.dtype
        KM = torch.empty(B, H, NR, D, device=kk.device, dtype=mdt)
        VM = torch.empty(B, H, NR, DV, device=kk.device, dtype=mdt)
        KH = torch.empty_like(CNT)
        rowbuf = torch.empty(B * H * C, device=kk.device, dtype=torch.int64)
        _means(rowbuf, KM, VM, KH, NR, from_rows=False, dev_t=False, row_t=False)
    DK, DVS = (KM, VM) if mean else (KS, VS)

    def launch(t, n_dict, nsplit, ns, dev_t):
        """The kernels of one chunk. dev_t False: chunk t, pointers sliced on the host. dev_t True: chunk
        t0 + *ctr of the run of whole chunks that starts at chunk t (= t0), the pointers at that chunk; the
        grids are sized for the run's largest dictionary (nsplit, ns) and the kernels read each chunk's
        dictionary size from the tables."""
        s0 = t * C
        e = min(s0 + C, L) if not dev_t else s0 + C
        qs = max(s0, off)
        kc, vc, xc = kk[:, :, s0:], vv[:, :, s0:], valid8[:, s0:]
        LC = e - s0
        full = LC == C
        if e > qs and q is not None:
            qq, oo = q[:, :, qs - off:], o[:, :, qs - off:]
            M = e - qs
            BM, nw = _blk(M, options)
            _ovq_fwd_split[(triton.cdiv(M, BM), B * HQ, nsplit)](
                qq, DK, DVS, CNT, kc, vc, xc, pacc, pm, pl, ctr, nact_t[t:] if full else ctr,
                qq.stride(0), qq.stride(1), qq.stride(2), DK.stride(0), DK.stride(1), DK.stride(2),
                DVS.stride(0), DVS.stride(1), DVS.stride(2), CNT.stride(0), CNT.stride(1),
                kc.stride(0), kc.stride(1), kc.stride(2), vc.stride(0), vc.stride(1), vc.stride(2),
                xc.stride(0), M, LC, n_dict, qs - s0, HQ, G, R_att, nsplit, B,
                D=D, DV=DV, BM=BM, BN=BN_D, UP=up, DEV_T=dev_t, MEAN=mean, num_warps=nw)
            BMc = 64 if M > 32 else (32 if M > 16 else 16)
            _ovq_combine[(triton.cdiv(M, BMc), B * HQ)](
                pacc, pm, pl, oo, ctr, oo.stride(0), oo.stride(1), oo.stride(2), M, HQ, nsplit, DV=DV, BM=BMc,
                DEV_T=dev_t)
        if full:
            row_out = rows_out[t:] if rows_out is not None else (rowbuf if mean else rank)
            BM, nw = _blk(C, options)
            _ovq_chunk_stats[(triton.cdiv(C, BM), B * H, ns)](
                kc, DK, CNT, nact_t[t:], pmax, pbest, pidx, ctr, KH if mean else CNT,
                kc.stride(0), kc.stride(1), kc.stride(2), DK.stride(0), DK.stride(1), DK.stride(2),
                CNT.stride(0), CNT.stride(1), C, H, R_st, B, D=D, BM=BM, BN=BN_D, IEEE=exact_assign, UP=up,
                DEV_T=dev_t, MEAN=mean, num_warps=nw)
            _ovq_rank[(B * H, triton.cdiv(C, BI))](
                xc, pmax, pbest, pidx, nnew_t[t:], best, idx, rank, ctr, xc.stride(0), C, H, ns, B, BI=BI,
                DEV_T=dev_t)
            _ovq_absorb[(B * H, triton.cdiv(C, BI))](
                kc, vc, xc, best, idx, nnew_t[t:], nact_t[t:], rank, KS, VS, CNT, row_out, ctr,
                kc.stride(0), kc.stride(1), kc.stride(2), vc.stride(0), vc.stride(1), vc.stride(2), xc.stride(0),
                KS.stride(0), KS.stride(1), KS.stride(2), VS.stride(0), VS.stride(1), VS.stride(2),
                CNT.stride(0), CNT.stride(1), C, H, B, D=D, DV=DV, BI=BI, IEEE=exact_assign, ASSIGN_ONLY=False,
                STORE_ROWS=rows_out is not None or mean, DEV_T=dev_t, ROW_T=rows_out is not None, num_warps=4)
            if mean:
                _means(row_out, KM, VM, KH, C, from_rows=True, dev_t=dev_t, row_t=rows_out is not None)
        if dev_t:
            ctr.add_(1)

    def one(t):  # a chunk on its own (host-side pointers and sizes)
        nonlocal seen_bound
        n_dict = target_int(seen_bound, max_centroids, growth)
        launch(t, n_dict, triton.cdiv(n_dict, R_att) + 1, max(1, triton.cdiv(n_dict, R_st)) if n_full else 1, False)
        if (t + 1) * C <= L:
            seen_bound += C

    for t in range(0, min(t_a, n_chunks)):
        one(t)
    if n_run > 0:
        n_last = target_int(seen_bound + (n_run - 1) * C, max_centroids, growth)
        args = (t_a, n_last, triton.cdiv(n_last, R_att) + 1, max(1, triton.cdiv(n_last, R_st)), True)
        run_steps(lambda: launch(*args), n_run, kk.device, graph=options.graph_runs)
        seen_bound += n_run * C
    for t in range(max(t_a, n_full), n_chunks):
        one(t)
    if n_full > 0:
        seen = state.seen + m.sum(1)
        state = OVQState(KS, VS, CNT, target_centroids(seen, max_centroids, growth), seen)
    return o, state, n_full * C, seen_bound


@torch.no_grad()
def ovq_open_attention_fast(q, kc, vc, valid, state: OVQState, n_dict: int,
                            options: OvqKernelOptions = DEFAULT_OPTIONS):
    """Queries ``q`` ``[B, Hq, M, D]`` placed after every slot of an open-chunk buffer ``kc``/``vc``
    ``[B, H, C, D]`` (``valid`` ``[B, C]`` marks the slots in use) attend to the first ``n_dict`` dictionary rows
    and to the valid slots: the kernels of a decode step of ``ovq_forward_fast`` with the chunk length fixed at
    the buffer's C and the queries at its end, so that the launch does not depend on how full the buffer is (one
    CUDA graph serves every step of a chunk, decode_graphs.py). Slots a step has not written yet are masked; the
    result equals ``ovq_forward_fast`` with the same ``options`` over the same open tokens bit for bit (a masked key
    adds exact zeros)."""
    B, H, C, D = kc.shape
    DV = vc.shape[-1]
    HQ, M = q.shape[1], q.shape[2]
    q = q.contiguous()
    valid8 = valid.to(torch.int8)
    KS, VS, CNT = state.key_sums, state.value_sums, state.counts
    R = _rows_per_split(M, attention=True, options=options)
    nsplit = triton.cdiv(n_dict, R) + 1
    pacc = torch.empty(nsplit * B * HQ * M * DV, device=kc.device, dtype=torch.float32)
    pm = torch.empty(nsplit * B * HQ * M, device=kc.device, dtype=torch.float32)
    pl = torch.empty_like(pm)
    o = torch.empty(B, HQ, M, DV, device=kc.device, dtype=q.dtype)
    ctr = _unused_i32(kc.device)
    BM, nw = _blk(M, options)
    BN_D = options.block_n
    _ovq_fwd_split[(triton.cdiv(M, BM), B * HQ, nsplit)](
        q, KS, VS, CNT, kc, vc, valid8, pacc, pm, pl, ctr, ctr,
        q.stride(0), q.stride(1), q.stride(2), KS.stride(0), KS.stride(1), KS.stride(2),
        VS.stride(0), VS.stride(1), VS.stride(2), CNT.stride(0), CNT.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2), vc.stride(0), vc.stride(1), vc.stride(2),
        valid8.stride(0), M, C, n_dict, C - 1, HQ, HQ // H, R, nsplit, B,
        D=D, DV=DV, BM=BM, BN=BN_D, UP=INTERPRET, DEV_T=False, MEAN=False, num_warps=nw)
    BMc = 64 if M > 32 else (32 if M > 16 else 16)
    _ovq_combine[(triton.cdiv(M, BMc), B * HQ)](
        pacc, pm, pl, o, ctr, o.stride(0), o.stride(1), o.stride(2), M, HQ, nsplit, DV=DV, BM=BMc, DEV_T=False)
    return o


@torch.no_grad()
def assign_rows_triton(k, valid, state: OVQState, n_new, n_dict: int, exact_assign: bool = True,
                       options: OvqKernelOptions = DEFAULT_OPTIONS):
    """Discrete part of the update for the training path: the row of every token of a chunk.

    ``k``: ``[B, H, C, D]``; ``valid``: ``[B, C]``; ``n_new``: ``[B]``; ``n_dict``: host upper bound of
    the active rows.  Same result as ``reference.select_and_assign`` (``[B, H, C]`` int64, -1 for
    padding); the linear part (``reference.apply_assignments``) stays in PyTorch for autograd. ``options``: the
    launch tiles (block_m, block_n, split_rows).
    """
    B, H, C, D = k.shape
    k = k.contiguous()
    xc = valid.to(torch.int8).contiguous()
    KS, CNT = state.key_sums.detach().contiguous(), state.counts.contiguous()
    nact = state.n_active.to(torch.int32).contiguous()
    nnew = n_new.to(torch.int32).contiguous()
    R = _rows_per_split(C, options=options)
    ns = max(1, triton.cdiv(n_dict, R))
    pmax, pbest, pidx, best, idx, rank = _assign_scratch(ns, B, H, C, k.device)
    rows = torch.empty(B, H, C, device=k.device, dtype=torch.int64)
    BM, nw = _blk(C, options)
    BI = 64
    _ovq_chunk_stats[(triton.cdiv(C, BM), B * H, ns)](
        k, KS, CNT, nact, pmax, pbest, pidx, nact, CNT,
        k.stride(0), k.stride(1), k.stride(2), KS.stride(0), KS.stride(1), KS.stride(2),
        CNT.stride(0), CNT.stride(1), C, H, R, B, D=D, BM=BM, BN=options.block_n, IEEE=exact_assign, UP=INTERPRET,
        DEV_T=False, num_warps=nw)
    _ovq_rank[(B * H, triton.cdiv(C, BI))](xc, pmax, pbest, pidx, nnew, best, idx, rank, nact, xc.stride(0), C, H, ns,
                                           B, BI=BI, DEV_T=False)
    _ovq_absorb[(B * H, triton.cdiv(C, BI))](
        k, k, xc, best, idx, nnew, nact, rank, KS, KS, CNT, rows, nact,
        k.stride(0), k.stride(1), k.stride(2), k.stride(0), k.stride(1), k.stride(2), xc.stride(0),
        KS.stride(0), KS.stride(1), KS.stride(2), KS.stride(0), KS.stride(1), KS.stride(2),
        CNT.stride(0), CNT.stride(1), C, H, B, D=D, DV=D, BI=BI, IEEE=exact_assign, ASSIGN_ONLY=True,
        STORE_ROWS=False, DEV_T=False, num_warps=4)
    return rows
