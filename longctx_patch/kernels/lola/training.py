"""LoLA's training path: the sparse sets chosen once without gradients, then one differentiable pass.

The chunk loop (`ops.lola_process` on the PyTorch backend) is differentiable but slow to train through: a
step of 2 x 4096 tokens on a SmolLM2-shaped model took 15.5 s on the H200 against 1.15 s for `lolcats`
(64-token chunks; benchmarks/results/lola/train-step-h200.json). Its selection is discrete, so no gradient flows
through it anyway. Here the selection runs first, without gradients, as the chunk loop makes it
(`sparse_positions`: which token positions each chunk's queries see in the sparse cache); then the output is one
masked hybrid attention per block of queries (`lola_attention_sets`): for query i of chunk c, the keys of its
window and of chunk c's sparse set are attended by softmax, every other earlier key linearly (folded into the
state, or still buffered), as in `reference.lola_attention`. Same value as the chunk loop, gradients through
q, k, v, the feature maps and the window factors. Each block of queries attends its band of keys (windows and
the linear keys the band holds), the state of every key before the band, and its chunks' sparse sets: time and
memory linear in the length (O(block x (block + window + lam)) a block, recomputed in the backward); the masked
pass over every earlier key it replaced (`_block_dense`, quadratic) stays as its reference.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch.utils.checkpoint import checkpoint

from . import reference as ref


def evictions_kernels_run(fk, v, *, window: int, chunk: int, lam: int) -> bool:
    """Whether `sparse_positions` takes the prefill's eviction kernels (`triton_evict.PrefillEvictions`) for these
    tensors: Triton runs on them (CUDA, or the CPU under TRITON_INTERPRET=1), a sparse cache, and window and chunk
    multiples of 16 (the grid the two-pass prefill runs them on)."""
    from ..backend import triton_missing

    return lam > 0 and window > 0 and window % 16 == 0 and chunk % 16 == 0 and triton_missing(fk, v) is None


@torch.no_grad()
def sparse_positions(fk, v, key_mask, *, window: int, chunk: int, lam: int, sparse_heads: int,
                     kernels: bool | None = None) -> torch.Tensor:
    """The sparse set each chunk attends, as the chunk loop builds it from an empty state.

    fk [B, Hq, S, F2] (phi(k) of every key under each query head's map), v [B, Hkv, S, D], key_mask [B, S] bool
    or None. Eviction c (at the end of chunk c) scores the lam slots followed by the pairs leaving the window
    (positions c*chunk - window .. (c+1)*chunk - window - 1) by self-recall error against the state of every
    query head, summed per sparse head; keeps the lam best (ties: lowest candidate index) and folds the other
    valid ones. Returns positions [n_chunks, B, sparse_heads, lam] int64 (-1: empty slot); row c is what
    chunk c attends (row 0 is empty); a row's order is not part of the answer (a set).

    kernels: the evictions of the two-pass prefill (`PrefillEvictions`: three launches an eviction, the same sets
    as this loop, which issues some 15 PyTorch ops an eviction: 175 ms a layer at 16k on an H100, most of a
    training step; benchmarks/results/lola/train-sets-linear-h100.json), or (False) this loop, or (None) the
    kernels wherever they run (`evictions_kernels_run`)."""
    if kernels is None:
        kernels = evictions_kernels_run(fk, v, window=window, chunk=chunk, lam=lam)
    if kernels:
        return _sparse_positions_kernels(fk, v, key_mask, window=window, chunk=chunk, lam=lam,
                                         sparse_heads=sparse_heads)
    B, Hq, S, F2 = fk.shape
    D = v.shape[-1]
    Hs, C, W = sparse_heads, chunk, window
    nch = math.ceil(S / C)
    dev = fk.device
    H = torch.zeros(B, Hq, F2, D, device=dev, dtype=torch.float32)
    s = torch.zeros(B, Hq, F2, device=dev, dtype=torch.float32)
    sp = torch.full((B, Hs, lam), -1, device=dev, dtype=torch.long)
    vs = ref.expand_kv(v, Hs)
    valid_key = key_mask.bool() if key_mask is not None else torch.ones(B, S, dtype=torch.bool, device=dev)
    out = [sp]
    for c in range(nch - 1):
        pos = torch.arange(c * C - W, (c + 1) * C - W, device=dev)
        ok = (pos >= 0)[None, :] & valid_key[:, pos.clamp_min(0)]  # [B, C]
        cand = torch.cat([sp, pos.expand(B, Hs, C)], -1)  # [B, Hs, lam + C]
        cand_valid = torch.cat([sp >= 0, ok[:, None, :].expand(B, Hs, C)], -1)
        ci = cand.clamp_min(0)
        cfk = torch.gather(fk, 2, ref.expand_kv(ci, Hq)[..., None].expand(-1, -1, -1, F2))
        cv = torch.gather(vs, 2, ci[..., None].expand(-1, -1, -1, D))
        scores = ref.group_sum(ref.sre_scores(cfk, cv, H, s), Hs).masked_fill(~cand_valid, float("-inf"))
        top = ref.top_lam(scores, lam)
        w = cand_valid.float()
        w.scatter_(-1, top.indices, 0.0)
        H, s = ref.fold(cfk, cv, w, H, s)
        sp = torch.where(torch.isfinite(top.values), torch.gather(cand, -1, top.indices), -1)
        out.append(sp)
    return torch.stack(out)


def _sparse_positions_kernels(fk, v, key_mask, *, window: int, chunk: int, lam: int, sparse_heads: int):
    """`sparse_positions` through the prefill's eviction kernels, launched eagerly (no CUDA graph: this runs inside
    a training step, its recomputation in the backward too): slot c of `PrefillEvictions.SPIDX` is what chunk c
    attends."""
    from .triton_evict import EvictionPlan, PrefillEvictions

    S = fk.shape[2]
    nch = math.ceil(S / chunk)
    km = key_mask.bool() if key_mask is not None else None
    plan = EvictionPlan(window=window, chunk=chunk, lam=lam, sparse_heads=sparse_heads, n_ev=S // chunk,
                        eps=ref.EPS_SRE)
    ev = PrefillEvictions(fk, v, km, plan)
    ev.run(graph=False)
    return ev.SPIDX[:nch].long()


def _block_dense(q, k, v, fq, fk, g, lf, sets, key_mask, q0: int, *, window: int, chunk: int, scale: float,
                 combine: str = "shifted"):
    """Output rows q0 .. q0 + q.shape[2] - 1 (whole chunks) against keys 0 .. N - 1 (N = q0 + rows), one masked
    pass over every earlier key: O(rows x N). The reference `_block` is checked against."""
    B, Hq, M, D = q.shape
    N = k.shape[2]
    Hs = sets.shape[2]
    qpos = torch.arange(M, device=q.device) + q0
    kpos = torch.arange(N, device=q.device)
    diff = qpos[:, None] - kpos[None, :]
    causal = diff >= 0
    win = (causal & (diff < window))[None, None]  # [1, 1, M, N]
    # sparse[b, hs, i, j]: key j is in the sparse set of query i's chunk
    rows = sets[qpos // chunk]  # [M, B, Hs, lam]
    sparse = torch.zeros(M, B, Hs, N + 1, dtype=torch.bool, device=q.device)
    sparse.scatter_(-1, torch.where(rows >= 0, rows, N), True)
    sparse = ref.expand_kv(sparse[..., :N].permute(1, 2, 0, 3), Hq)  # [B, Hq, M, N]
    soft = win | sparse
    lin = causal[None, None] & ~soft
    if key_mask is not None:
        km = key_mask.bool()[:, None, None, :N]
        soft, lin = soft & km, lin & km
    kx, vx = ref.expand_kv(k, Hq).float(), ref.expand_kv(v, Hq).float()
    sc = torch.einsum("bhsd,bhnd->bhsn", q.float(), kx) * scale
    sc = sc.masked_fill(~soft, float("-inf"))
    m = ref.row_max(sc, combine)
    p = torch.exp(sc - m)
    a = torch.einsum("bhsf,bhnf->bhsn", fq.float(), fk.float()) * lin
    return ref._finish(p @ vx, p.sum(-1, keepdim=True), a @ vx, a.sum(-1, keepdim=True), g, lf,
                       m if ref.check_combine(combine) else None)


def linear_from(sets, S: int, *, window: int, chunk: int) -> torch.Tensor:
    """The chunk from which each key is in the linear state, per sparse head: [B, Hs, S] int64.

    Key j leaves the window at eviction e_j = (j + window) // chunk (the end of chunk e_j); kept, it is in the sparse
    sets of chunks e_j + 1 .. L_j - 1 (a contiguous run: once folded, a pair stays folded), and from chunk L_j on its
    chunk queries see it in the state: L_j = e_j + 1 + (the number of sets that hold it). A key no eviction reaches
    gets e_j + 1 (past every chunk there is). Padding is not masked here."""
    nch, B, Hs, lam = sets.shape
    held = torch.zeros(B, Hs, S + 1, dtype=torch.long, device=sets.device)
    flat = sets.permute(1, 2, 0, 3).reshape(B, Hs, nch * lam)
    held.scatter_add_(-1, torch.where(flat >= 0, flat, S), torch.ones_like(flat))
    e = (torch.arange(S, device=sets.device) + window) // chunk
    return e + 1 + held[..., :S]


def _masks(qpos, kpos, L, valid, *, window: int, chunk: int):
    """Which of the keys at kpos each query at qpos attends exactly and which linearly, [B, Hs, M, n] each, given
    the keys' L (`linear_from`, [B, Hs, n]) and validity [B, n]: exactly, its window and its chunk's sparse set
    (left the window, c < L); linearly, every other key at least `window` back (folded, L <= c, or still buffered)."""
    c = (qpos // chunk)[:, None]  # [M, 1]
    diff = qpos[:, None] - kpos[None, :]
    e = (kpos + window) // chunk
    sparse = (e[None, :] < c)[None, None] & (c[None, None] < L[:, :, None, :])
    ok = valid[:, None, None, :]
    soft = (((diff >= 0) & (diff < window))[None, None] | sparse) & ok
    lin = (diff >= window)[None, None] & ~sparse & ok
    return soft, lin


def _block(q, k, v, fq, fk, g, lf, sets, L, valid, q0: int, folded, *, window: int, chunk: int, scale: float,
           combine: str = "shifted"):
    """`_block_dense`'s value in time and memory linear in N: rows q0 .. q0 + M - 1 (whole chunks) against

    - the band of keys kb .. N - 1 (kb = max(0, q0 - window): the keys that leave the window at the block's
      evictions or later): each row's window, the keys of its chunk's sparse set among them, and the rest of them
      at least `window` back, linearly (masked; O(M x (M + window)));
    - the sparse set of the block's first chunk, gathered (the keys before kb that are not folded yet): exact for a
      row whose chunk still holds a key, linear from the chunk that folds it (O(M x lam));
    - every key folded before the block's first chunk through their state: folded = (P [B, Hq, F2, D],
      z [B, Hq, F2]) (`_folded_states`).
    Every term is a sum of its own keys: nothing is subtracted, so no rounding is left where a row has no linear
    key (`_finish` decides by den_l > 0)."""
    B, Hq, M, D = q.shape
    N = k.shape[2]
    P, z = folded
    dev = q.device
    kb = max(0, q0 - window)
    qf, fqf = q.float(), fq.float()
    qpos = torch.arange(M, device=dev) + q0
    # the band
    kpos = torch.arange(kb, N, device=dev)
    soft, lin = (ref.expand_kv(m, Hq) for m in _masks(qpos, kpos, L[..., kb:N], valid[:, kb:N], window=window,
                                                          chunk=chunk))
    kb_, vb = ref.expand_kv(k[:, :, kb:], Hq).float(), ref.expand_kv(v[:, :, kb:], Hq).float()
    sc_b = (torch.einsum("bhsd,bhnd->bhsn", qf, kb_) * scale).masked_fill(~soft, float("-inf"))
    a_b = torch.einsum("bhsf,bhnf->bhsn", fqf, fk[:, :, kb:].float()) * lin
    # the first chunk's sparse set (positions before kb; -1: an empty slot)
    pos = sets[q0 // chunk]  # [B, Hs, lam]
    ok = pos >= 0
    pc = pos.clamp_min(0)
    Ls = torch.gather(L, 2, pc)
    c = (qpos // chunk)[None, None, :, None]
    soft_s = ref.expand_kv(ok[:, :, None, :] & (c < Ls[:, :, None, :]), Hq)  # [B, Hq, M, lam]
    lin_s = ref.expand_kv(ok[:, :, None, :] & (Ls[:, :, None, :] <= c), Hq)
    ks, vs, fks = _gather_keys(k, v, fk, ref.expand_kv(pc, Hq))
    sc_s = (torch.einsum("bhsd,bhld->bhsl", qf, ks) * scale).masked_fill(~soft_s, float("-inf"))
    a_s = torch.einsum("bhsf,bhlf->bhsl", fqf, fks) * lin_s
    m = ref.row_max(torch.maximum(sc_b.amax(-1, keepdim=True), sc_s.amax(-1, keepdim=True)), combine)  # of both
    p_b, p_s = torch.exp(sc_b - m), torch.exp(sc_s - m)
    num_e = p_b @ vb + p_s @ vs
    den_e = p_b.sum(-1, keepdim=True) + p_s.sum(-1, keepdim=True)
    num_l = fqf @ P + a_b @ vb + a_s @ vs
    den_l = fqf @ z[..., None] + a_b.sum(-1, keepdim=True) + a_s.sum(-1, keepdim=True)
    return ref._finish(num_e, den_e, num_l, den_l, g, lf, m if ref.check_combine(combine) else None)


def _gather_keys(k, v, fk, pos):
    """k, v [B, Hkv, N, D] and fk [B, Hq, N, F2] at positions pos [B, Hq, n] (query head h reads kv head
    h // (Hq // Hkv)), in fp32: [B, Hq, n, D], [B, Hq, n, D], [B, Hq, n, F2]."""
    B, Hq, n = pos.shape
    Hkv, D, F2 = k.shape[1], k.shape[-1], fk.shape[-1]
    ikv = pos.reshape(B, Hkv, -1, 1)  # a kv head's query heads are contiguous
    ks = torch.gather(k, 2, ikv.expand(-1, -1, -1, D)).float().view(B, Hq, n, D)
    vs = torch.gather(v, 2, ikv.expand(-1, -1, -1, D)).float().view(B, Hq, n, D)
    fks = torch.gather(fk, 2, pos[..., None].expand(-1, -1, -1, F2)).float()
    return ks, vs, fks


def _fold_segment(k, v, fk, sets, L, valid, q0: int, q1: int, *, window: int, chunk: int):
    """The state of the keys the evictions of the block q0 .. q1 - 1 fold (L_j in (c0, c1]: keys of the first
    chunk's sparse set and keys leaving the window during the block), [B, Hq, F2, D] and [B, Hq, F2]."""
    Hq = fk.shape[1]
    c0, c1 = q0 // chunk, -(-q1 // chunk)
    pos = sets[c0]
    ok = (pos >= 0) & (torch.gather(L, 2, pos.clamp_min(0)) <= c1)
    ks, vs, fks = _gather_keys(k, v, fk, ref.expand_kv(pos.clamp_min(0), Hq))
    w = ref.expand_kv(ok, Hq).float()
    P = torch.einsum("bhnf,bhnd->bhfd", fks * w[..., None], vs)
    z = (fks * w[..., None]).sum(2)
    lo, hi = max(0, q0 - window), max(0, min(k.shape[2], q1 - window))
    if hi > lo:
        wb = ref.expand_kv((L[..., lo:hi] <= c1) & valid[:, None, lo:hi], Hq).float()
        fb = fk[:, :, lo:hi].float() * wb[..., None]
        P = P + torch.einsum("bhnf,bhnd->bhfd", fb, ref.expand_kv(v[:, :, lo:hi], Hq).float())
        z = z + fb.sum(2)
    return P, z


def _folded_states(k, v, fk, sets, L, valid, starts, S: int, *, window: int, chunk: int):
    """For each block start q0 (ascending, whole chunks), the state of every key folded before chunk q0 // chunk:
    the running sum of the blocks' `_fold_segment`s (differentiable; each recomputed in the backward)."""
    Ps, zs = [], []
    P = fk.new_zeros(fk.shape[0], fk.shape[1], fk.shape[-1], v.shape[-1], dtype=torch.float32)
    z = fk.new_zeros(fk.shape[0], fk.shape[1], fk.shape[-1], dtype=torch.float32)
    for i, q0 in enumerate(starts):
        Ps.append(P)
        zs.append(z)
        if i + 1 < len(starts):
            args = (k, v, fk, sets, L, valid, q0, starts[i + 1])
            kw = dict(window=window, chunk=chunk)
            dP, dz = (checkpoint(_fold_segment, *args, use_reentrant=False, **kw) if torch.is_grad_enabled()
                      else _fold_segment(*args, **kw))
            P, z = P + dP, z + dz
    return Ps, zs


@dataclass(frozen=True)
class SetsSpec:
    """The settings of the training pass over sparse sets (`lola_attention_sets`): the LoLA grid (`window`, `chunk`),
    the scores' factor `scale` (None: D ** -0.5), `combine` (how the exact and linear terms meet: "shifted" or
    "unshifted", `reference._finish`), about `block` queries per recomputed block (whole chunks) and `dense`: every
    block against every earlier key (`_block_dense`, quadratic: the reference) instead of its band, state and sets.
    Refused when built (ValueError): a window, chunk or block that is no int in range, a scale that is no positive
    number, an unknown combine, a dense that is no bool."""

    window: int
    chunk: int
    scale: float | None = None
    combine: str = "shifted"
    block: int = 1024
    dense: bool = False

    def __post_init__(self):
        ref.check_ints(self, window=0, chunk=1, block=1)
        ref.check_scale(self)
        ref.check_combine(self.combine)
        if not isinstance(self.dense, bool):
            raise ValueError(f"SetsSpec.dense={self.dense!r}: allowed True or False")


class PrefillSets(NamedTuple):
    """The sparse sets of a fresh prefill and the padding they were chosen under: positions [n_chunks, B, Hs, lam]
    int64 (`sparse_positions`; -1: an empty slot; row c is what chunk c attends) and key_mask [B, S] bool (True = a
    real token) or None, which masks the keys of the pass."""

    positions: torch.Tensor
    key_mask: torch.Tensor | None = None


def lola_attention_sets(q, k, v, fq, fk, g, lf, sets: PrefillSets, spec: SetsSpec) -> torch.Tensor:
    """The hybrid output of a fresh LoLA prefill given its sparse sets and their padding (`PrefillSets`),
    differentiable.

    q/fq [B, Hq, S, D/F2], k/v [B, Hkv, S, D], fk [B, Hq, S, F2], g/lf [Hq]. Queries go in blocks of about
    `spec.block` tokens (whole chunks), each recomputed in the backward when gradients are needed: against their band
    of keys, the state of the keys before it and their chunks' sparse sets (`_block`, time and memory linear in S),
    or with spec.dense against every earlier key (`_block_dense`, quadratic: the reference). spec (`SetsSpec`):
    window, chunk, scale, combine (how the exact and linear terms meet: `reference._finish`), block, dense.
    Returns [B, S, Hq, D] in q.dtype."""
    window, chunk, dense = spec.window, spec.chunk, spec.dense
    key_mask, sets = sets.key_mask, sets.positions
    S = q.shape[2]
    rows = max(chunk, (spec.block // chunk) * chunk)
    starts = list(range(0, S, rows))
    if not dense:
        L = linear_from(sets, S, window=window, chunk=chunk)
        valid = (key_mask.bool() if key_mask is not None
                 else torch.ones(q.shape[0], S, dtype=torch.bool, device=q.device))
        Ps, zs = _folded_states(k, v, fk, sets, L, valid, starts, S, window=window, chunk=chunk)
    outs = []
    scale = q.shape[-1] ** -0.5 if spec.scale is None else spec.scale
    kw = dict(window=window, chunk=chunk, scale=scale, combine=spec.combine)
    for i, q0 in enumerate(starts):
        q1 = min(S, q0 + rows)
        qs = (q[:, :, q0:q1], k[:, :, :q1], v[:, :, :q1], fq[:, :, q0:q1], fk[:, :, :q1], g, lf, sets)
        fn = _block_dense if dense else _block
        args = qs + (key_mask, q0) if dense else qs + (L[..., :q1], valid[:, :q1], q0, (Ps[i], zs[i]))
        if torch.is_grad_enabled():
            outs.append(checkpoint(fn, *args, use_reentrant=False, **kw))
        else:
            outs.append(fn(*args, **kw))
    return torch.cat(outs, 2).transpose(1, 2).to(q.dtype)
