"""Triton statistics of a chunk against the active dictionary rows (discrete part of the OVQ update).

For every chunk token ``i`` and key head, over the active rows ``j < n_active[b]``:

* rows ``d_j = key_sums_j / counts_j``;
* ``maxdot[i] = max_j k_i . d_j`` (spread-maximisation score, -inf when the dictionary is empty);
* ``best[i] = max_j (k_i . d_j - |d_j|^2 / 2)`` and ``idx[i]`` its first argmax (nearest row by
  squared Euclidean distance).

One pass over the dictionary per block of tokens; the ``[C, N]`` score matrix is never stored.  The
rows can be split over a third grid axis (``ROWS`` rows per program); each split then writes its own
partial results at ``[split, B * H, C]`` (the fused path reduces them in ``_ovq_rank``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..backend import INTERPRET
from ..triton_lib import dot


@triton.jit
def _ovq_chunk_stats(K, DK, CNT, NACT, MAXDOT, BEST, IDX, TPTR, KH,
                     skb, skh, skc, sdb, sdh, sdn, scb, sch,
                     C, H, ROWS, NB,
                     D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, IEEE: tl.constexpr,
                     UP: tl.constexpr, DEV_T: tl.constexpr = False, MEAN: tl.constexpr = False):
    """DEV_T: the chunk is number ``t = *TPTR`` of a run of whole chunks (K at the run's first chunk, NACT a
    ``[T, NB]`` table). MEAN (bf16 dot products only): DK holds the row means (``triton_fast._ovq_means``) and
    KH their halved squared norms, laid out as CNT."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)  # 64-bit base offsets (docs/PERFORMANCE.md, "Large shapes")
    pid_p = tl.program_id(2)  # split of the dictionary rows: [pid_p * ROWS, (pid_p + 1) * ROWS)
    b = pid_bh // H
    h = pid_bh % H
    if DEV_T:
        t = tl.load(TPTR).to(tl.int64)
        K += t * C * skc
        NACT += t * NB
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, D)
    mask_m = offs_m < C
    k = tl.load(K + b * skb + h * skh + offs_m[:, None] * skc + offs_d[None, :], mask=mask_m[:, None], other=0.0)
    k = k.to(tl.float32)
    n_act = tl.minimum(tl.load(NACT + b), (pid_p + 1) * ROWS)
    maxdot = tl.full([BM], float("-inf"), tl.float32)
    best = tl.full([BM], float("-inf"), tl.float32)
    idx = tl.zeros([BM], tl.int64)
    dbase = DK + b * sdb + h * sdh
    for start in range(pid_p * ROWS, n_act, BN):
        offs_n = start + tl.arange(0, BN)
        act = offs_n < n_act
        if MEAN:  # the host sets MEAN only with bf16 dot products (IEEE false)
            d = tl.load(dbase + offs_n[:, None] * sdn + offs_d[None, :], mask=act[:, None], other=0.0)
            half_sq = tl.load(KH + b * scb + h * sch + offs_n, mask=act, other=0.0)
        else:
            d = tl.load(dbase + offs_n[:, None] * sdn + offs_d[None, :], mask=act[:, None], other=0.0).to(tl.float32)
            cnt = tl.load(CNT + b * scb + h * sch + offs_n, mask=act, other=1.0)
            if IEEE:
                d = d / tl.maximum(cnt, 1.0)[:, None]
            else:  # as the mean form's means (triton_fast._ovq_means): the same bf16 operands
                d = d * (1.0 / tl.maximum(cnt, 1.0))[:, None]
            half_sq = 0.5 * tl.sum(d * d, 1)
        if IEEE:
            dots = tl.dot(k, tl.trans(d), input_precision="ieee")
        else:  # bf16 operands (UP: the interpreter's workaround, the same bf16-rounded values in fp32)
            dots = dot(k.to(tl.bfloat16), tl.trans(d.to(tl.bfloat16)), "tf32", UP)
        dots = tl.where(act[None, :], dots, float("-inf"))
        maxdot = tl.maximum(maxdot, tl.max(dots, 1))
        score = dots - half_sq[None, :]
        blk_best = tl.max(score, 1)
        blk_idx = tl.argmax(score, 1, tie_break_left=True).to(tl.int64) + start
        upd = blk_best > best
        idx = tl.where(upd, blk_idx, idx)
        best = tl.where(upd, blk_best, best)
    out = (pid_p.to(tl.int64) * tl.num_programs(1) + pid_bh) * C + offs_m  # split-major partials: 64-bit
    tl.store(MAXDOT + out, maxdot, mask=mask_m)
    tl.store(BEST + out, best, mask=mask_m)
    tl.store(IDX + out, idx, mask=mask_m)


def chunk_stats_triton(k: torch.Tensor, key_sums: torch.Tensor, counts: torch.Tensor, n_active: torch.Tensor,
                       exact: bool = True):
    """``k``: ``[B, H, C, D]``; ``key_sums``: ``[B, H, N, D]`` and ``counts`` ``[B, H, N]`` (rows are
    ``key_sums / counts``); ``n_active``: ``[B]`` int.

    ``exact=False`` computes the dot products from bfloat16 operands (faster on tensor cores; near
    ties may then resolve differently from the float32 reference).
    Returns ``(maxdot, best, idx)``, each ``[B, H, C]`` (float32, float32, int64)."""
    B, H, C, D = k.shape
    k = k.contiguous()
    dict_keys = key_sums.contiguous()
    counts = counts.contiguous().float()
    nact = n_active.to(torch.int32).contiguous()
    maxdot = torch.empty(B, H, C, device=k.device, dtype=torch.float32)
    best = torch.empty_like(maxdot)
    idx = torch.empty(B, H, C, device=k.device, dtype=torch.int64)
    BM = 16 if C <= 16 else (32 if C <= 32 else 64)
    BN = 64
    _ovq_chunk_stats[(triton.cdiv(C, BM), B * H, 1)](
        k, dict_keys, counts, nact, maxdot, best, idx, nact, counts,
        k.stride(0), k.stride(1), k.stride(2), dict_keys.stride(0), dict_keys.stride(1), dict_keys.stride(2),
        counts.stride(0), counts.stride(1),
        C, H, 1 << 30, B, D=D, BM=BM, BN=BN, IEEE=exact, UP=INTERPRET)
    return maxdot, best, idx
