"""MoBA (Mixture of Block Attention, Lu et al. 2025, arXiv:2502.13189) in PyTorch: the gating and the block-sparse
exact attention. Differentiable (through the attention; the gate is a hard top-k and has no gradient, as in MoBA),
any float dtype (float64 for checks). docs/moba.md has the definition.

- the keys are cut into blocks of `block_size` consecutive *positions* of their row (position = index among the
  row's real keys, so a left-padded row has the blocks of its prompt alone);
- the query's own block (the block of its own position) is always attended, causally;
- every earlier block n (all complete) is scored by `g . mean_k(block n)` (in fp32 or wider); the `top_k - 1`
  best are attended too (MoBA's top-k counts the own block, which its gate sets to +inf);
- one exact softmax over the union of those keys.
The gate vector g: `gating="token"` (MoBA's reference): the query itself; a query whose position is below
`min_seq_len` attends to every earlier key. `gating="block"`: the mean of the real queries of the query's block
seen so far (this call's, plus `query_sum`, the sum carried from earlier calls: a decode step's gate is the mean of
its block's queries up to itself, what a prefill ending at that token gives it); every query of a block then
attends to the same blocks; a query block starting below `min_seq_len` attends to every earlier key.

Shapes as `kernels.softmax.softmax_attention`: q `[B, Hq, Sq, D]`, k/v `[B, Hkv, Sk, D]` (GQA: Hq a multiple of Hkv,
each query head gates with its kv head's block means), key_mask `[B, Sk]` (True = real key) or None; query i sits at
key index `q_offset + i` (default `Sk - Sq`); a `q_offset + i >= Sk` (a decode step over a preallocated buffer)
puts the query after every real key. Out `[B, Sq, Hq, D]` in q's dtype.
"""

from __future__ import annotations

import torch

GATINGS = ("block", "token")


def _work_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def key_positions(key_mask: torch.Tensor | None, B: int, Sk: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(kpos, valid) `[B, Sk]`: each key's position among its row's real keys (0-based; the position of the last
    real key before it for a padded key) and whether it is real."""
    if key_mask is None:
        kpos = torch.arange(Sk, device=device).expand(B, Sk)
        return kpos, torch.ones(B, Sk, dtype=torch.bool, device=device)
    valid = key_mask.bool().expand(B, Sk)
    return valid.long().cumsum(1) - 1, valid


def query_positions(kpos: torch.Tensor, valid: torch.Tensor, Sq: int, q_offset: int | None):
    """(qpos, qreal, qidx): each query's position `[B, Sq]`, whether it is a real token `[B, Sq]`, and its key index
    `[Sq]` (>= Sk for a query after every key)."""
    B, Sk = kpos.shape
    q_offset = Sk - Sq if q_offset is None else q_offset
    qidx = torch.arange(Sq, device=kpos.device) + q_offset
    inside = qidx < Sk
    at = qidx.clamp(max=Sk - 1)
    last = valid.long().sum(1, keepdim=True) - 1  # a query past every key is the last real one (its own key)
    qpos = torch.where(inside, kpos[:, at], last + (qidx - Sk))
    qreal = torch.where(inside, valid[:, at], torch.ones_like(valid[:, :1]))
    return qpos, qreal, qidx


def prefix_block_sums(x: torch.Tensor, valid: torch.Tensor | None, block_size: int):
    """Sums `[B, H, nb, D]` (work dtype) and counts `[B, nb]` of x `[B, H, S, D]` over blocks of consecutive indices,
    when each row's real entries are a prefix of it (positions are indices: no padding, or padding gathered to the
    end); valid `[B, S]` or None (all real). A view and one reduction: no copy of x without padding."""
    B, H, S, D = x.shape
    nb = -(-S // block_size)
    wd = _work_dtype(x)
    if valid is not None:
        x = x * valid[:, None, :, None].to(x.dtype)
    x = torch.nn.functional.pad(x, (0, 0, 0, nb * block_size - S))
    sums = x.reshape(B, H, nb, block_size, D).sum(3, dtype=wd)
    ones = torch.ones(B, S, dtype=wd, device=x.device) if valid is None else valid.to(wd)
    counts = torch.nn.functional.pad(ones, (0, nb * block_size - S)).view(B, nb, block_size).sum(2)
    return sums, counts


def block_means(k: torch.Tensor, kpos: torch.Tensor, valid: torch.Tensor, block_size: int) -> torch.Tensor:
    """Mean key of each block of positions, `[B, Hkv, nb, D]` in the work dtype (0 for a block with no key);
    nb = ceil(Sk / block_size)."""
    B, H, Sk, D = k.shape
    nb = -(-Sk // block_size)
    wd = _work_dtype(k)
    blk = kpos.clamp(min=0) // block_size
    dump = B * nb  # padded keys go to one extra row
    index = torch.where(valid, blk + nb * torch.arange(B, device=k.device)[:, None], dump).reshape(-1)
    rows = k.to(wd).permute(0, 2, 1, 3).reshape(B * Sk, H * D)
    sums = rows.new_zeros(B * nb + 1, H * D).index_add_(0, index, rows)
    counts = rows.new_zeros(B * nb + 1).index_add_(0, index, torch.ones_like(index, dtype=wd))
    means = sums[:dump] / counts[:dump].clamp(min=1)[:, None]
    return means.view(B, nb, H, D).permute(0, 2, 1, 3)


def gate(q: torch.Tensor, means: torch.Tensor, qpos: torch.Tensor, *, block_size: int, top_k: int,
         min_seq_len: int = 0) -> torch.Tensor:
    """Token gating: the earlier blocks each query attends, `[B, Hq, Sq, nb]` bool: the `top_k - 1` earlier blocks
    of highest `q . mean` (all of them when there are fewer, or below `min_seq_len`). The own block is not
    included."""
    return select(q, means, qpos.clamp(min=0) // block_size, qpos < min_seq_len, top_k=top_k)


def select(g: torch.Tensor, means: torch.Tensor, gblk: torch.Tensor, everything: torch.Tensor, *,
           top_k: int) -> torch.Tensor:
    """The earlier blocks of each gate row: g `[B, Hq, R, D]` (a query, or a query block's mean query), gblk `[B, R]`
    the row's own block, everything `[B, R]` rows that take every earlier block -> `[B, Hq, R, nb]` bool, the
    `top_k - 1` earlier blocks of highest `g . mean` (all when there are fewer)."""
    B, Hq, R, D = g.shape
    Hkv, nb = means.shape[1], means.shape[2]
    G = Hq // Hkv
    cand = torch.arange(nb, device=g.device) < gblk[:, None, :, None]  # [B, 1, R, nb]: earlier blocks
    k_sel = top_k - 1
    if k_sel >= nb:
        return cand.expand(B, Hq, R, nb)
    scores = torch.matmul(g.to(means.dtype).reshape(B, Hkv, G * R, D), means.transpose(2, 3)).view(B, Hq, R, nb)
    scores = scores.masked_fill(~cand, float("-inf"))
    sel = torch.zeros(B, Hq, R, nb, dtype=torch.bool, device=g.device)
    if k_sel > 0:
        sel.scatter_(3, scores.topk(k_sel, dim=3).indices, True)
    sel &= cand  # a row with fewer earlier blocks than k_sel: the -inf picks dropped
    return torch.where(everything[:, None, :, None], cand, sel)


def block_query_sums(q: torch.Tensor, qpos: torch.Tensor, qreal: torch.Tensor, *, block_size: int, nbq: int,
                     query_sum: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum `[B, Hq, nbq, D]` (work dtype) and count `[B, nbq]` of the real queries of each block of positions, this
    call's plus the earlier calls' of the block of the row's first query (`carry_query_sum`)."""
    B, Hq, Sq, D = q.shape
    wd = _work_dtype(q)
    qblk = qpos.clamp(min=0) // block_size
    dump = B * nbq
    index = torch.where(qreal, qblk + nbq * torch.arange(B, device=q.device)[:, None], dump).reshape(-1)
    rows = q.detach().to(wd).permute(0, 2, 1, 3).reshape(B * Sq, Hq * D)
    sums = rows.new_zeros(B * nbq + 1, Hq * D).index_add_(0, index, rows)[:dump].view(B, nbq, Hq, D)
    counts = rows.new_zeros(B * nbq + 1).index_add_(0, index, torch.ones_like(index, dtype=wd))[:dump].view(B, nbq)
    sums = sums.permute(0, 2, 1, 3)
    carry_query_sum(sums, counts, qpos, qreal, block_size=block_size, query_sum=query_sum)
    return sums, counts


def carry_query_sum(sums, counts, qpos, qreal, *, block_size: int, query_sum: torch.Tensor | None) -> None:
    """Block gating across calls, in place. Adds `query_sum` `[B, Hq, D]` (the sum of the queries of earlier calls
    in the block of the row's first query; their count is that query's position modulo block_size) to that block of
    this call's `sums` `[B, Hq, nbq, D]` and `counts` `[B, nbq]`; then sets `query_sum` to the sum of the block of the
    row's last query (0 when that block is complete). Nothing when query_sum is None."""
    if query_sum is None:
        return
    B, Hq, nbq, D = sums.shape
    big = torch.iinfo(qpos.dtype).max
    first = torch.where(qreal, qpos, big).amin(1)  # [B]: the row's first real query (big: none)
    last = torch.where(qreal, qpos, -1).amax(1)
    has = last >= 0
    fb = torch.where(has, first // block_size, 0).clamp(max=nbq - 1)
    at = fb[:, None, None, None].expand(B, Hq, 1, D)
    sums.scatter_add_(2, at, (query_sum.to(sums.dtype) * has[:, None, None])[:, :, None])
    counts.scatter_add_(1, fb[:, None], torch.where(has, first % block_size, 0)[:, None].to(counts.dtype))
    lb = torch.where(has, last // block_size, 0).clamp(max=nbq - 1)
    now = sums.gather(2, lb[:, None, None, None].expand(B, Hq, 1, D))[:, :, 0]
    complete = ((last + 1) % block_size == 0)[:, None, None]
    new = torch.where(complete, torch.zeros_like(now), now).to(query_sum.dtype)
    query_sum.copy_(torch.where(has[:, None, None], new, query_sum))


def block_gate(q, means, qpos, qreal, *, block_size: int, top_k: int, min_seq_len: int = 0,
               query_sum: torch.Tensor | None = None, sums=None) -> torch.Tensor:
    """Block gating: the earlier blocks each query block attends, `[B, Hq, nbq, nb]` bool (nbq = nb: the blocks of
    the keys), gated by the block's mean query (`block_query_sums`, or `sums` = (sums, counts) computed by the caller
    and carried already; `query_sum` is updated in place); a query block starting below `min_seq_len` takes every
    earlier block."""
    nb = means.shape[2]
    if sums is None:
        sums = block_query_sums(q, qpos, qreal, block_size=block_size, nbq=nb, query_sum=query_sum)
    qbar = sums[0] / sums[1].clamp(min=1)[:, None, :, None]
    blk = torch.arange(nb, device=q.device).expand(q.shape[0], nb)
    return select(qbar, means, blk, blk * block_size < min_seq_len, top_k=top_k)


def allowed_keys(sel: torch.Tensor, kpos, valid, qpos, qreal, qidx, block_size: int) -> torch.Tensor:
    """`[B, Hq, Sq, Sk]` bool: real keys of the own block up to the query, and of its selected earlier blocks. A
    padded query sees its own key only (its output is ignored; as `softmax.attention_mask`)."""
    Sk = kpos.shape[1]
    kblk = (kpos.clamp(min=0) // block_size)[:, None, None, :]  # [B, 1, 1, Sk]
    qblk = (qpos.clamp(min=0) // block_size)[:, None, :, None]  # [B, 1, Sq, 1]
    causal = valid[:, None, None, :] & (kpos[:, None, None, :] <= qpos[:, None, :, None])
    own = kblk == qblk
    picked = sel.gather(3, kblk.expand(*sel.shape[:3], Sk))
    ok = causal & (own | picked)
    self_key = (torch.arange(Sk, device=kpos.device)[None, :] == qidx[:, None])[None, None]
    return torch.where(qreal[:, None, :, None], ok, self_key)


def moba_reference(q, k, v, *, scale: float, block_size: int, top_k: int, key_mask: torch.Tensor | None = None,
                   q_offset: int | None = None, min_seq_len: int = 0, gating: str = "token",
                   query_sum: torch.Tensor | None = None, chunk_elems: int = 2**26) -> torch.Tensor:
    """MoBA attention (module docstring), dense per chunk of queries: at most `chunk_elems` logits at a time.
    query_sum (block gating): see `block_query_sums`, updated in place."""
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    G = Hq // Hkv
    wd = _work_dtype(q)
    kpos, valid = key_positions(key_mask, B, Sk, q.device)
    qpos, qreal, qidx = query_positions(kpos, valid, Sq, q_offset)
    with torch.no_grad():  # the gate is a hard choice: no gradient (as MoBA)
        means = block_means(k.detach(), kpos, valid, block_size)
        if gating == "block":
            blocks = block_gate(q, means, qpos, qreal, block_size=block_size, top_k=top_k, min_seq_len=min_seq_len,
                                query_sum=query_sum)
            qblk = (qpos.clamp(min=0) // block_size).clamp(max=means.shape[2] - 1)
    kw, vw = k.to(wd), v.to(wd)
    c = max(1, min(Sq, chunk_elems // max(1, B * Hq * Sk)))
    outs = []
    for s0 in range(0, Sq, c):
        s1 = min(Sq, s0 + c)
        qc = q[:, :, s0:s1]
        with torch.no_grad():
            if gating == "block":
                sel = blocks.gather(2, qblk[:, None, s0:s1, None].expand(B, Hq, s1 - s0, blocks.shape[3]))
            else:
                sel = gate(qc.detach(), means, qpos[:, s0:s1], block_size=block_size, top_k=top_k,
                           min_seq_len=min_seq_len)
            ok = allowed_keys(sel, kpos, valid, qpos[:, s0:s1], qreal[:, s0:s1], qidx[s0:s1], block_size)
        n = s1 - s0
        logits = torch.matmul(qc.to(wd).reshape(B, Hkv, G * n, D), kw.transpose(2, 3)).view(B, Hq, n, Sk) * scale
        p = torch.softmax(logits.masked_fill(~ok, float("-inf")), dim=-1)
        o = torch.matmul(p.view(B, Hkv, G * n, Sk), vw).view(B, Hq, n, D)
        outs.append(o)
    o = outs[0] if len(outs) == 1 else torch.cat(outs, 2)
    return o.transpose(1, 2).to(q.dtype)


def moba_attended_keys(seq_len: int, *, block_size: int, top_k: int, **_) -> float:
    """Exactly attended keys per query and head, averaged over the `seq_len` queries of one causal sequence without
    padding, under block gating: query block n attends to its own block causally and to `min(top_k - 1, n)` earlier
    blocks (all of them: exact attention, when n < top_k)."""
    L, S = block_size, seq_len
    total = 0.0
    for n in range(-(-S // L)):
        c = min(L, S - n * L)
        total += c * (c + 1) / 2 + c * min(top_k - 1, n) * L
    return total / S


__all__ = ["GATINGS", "allowed_keys", "block_gate", "block_means", "block_query_sums", "carry_query_sum", "gate",
           "key_positions", "moba_attended_keys", "moba_reference", "prefix_block_sums", "query_positions", "select"]
