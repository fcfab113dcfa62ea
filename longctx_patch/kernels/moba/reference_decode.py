"""The PyTorch reference of MoBA's decode step over a preallocated K/V buffer whose block state is kept incrementally
(methods/moba/cache.py's `MobaLayer` holds it), and what `triton_decode.py` must equal:

- `add_block_keys`: new keys into the block state (the sum of each block's real keys, the slot of each block's first
  real key, the real count); a prefill and a step alike;
- `store_step_reference`: a step's key and value into the buffer at its write slot, and into the block state;
- `decode_gate`: the step's gate from that state alone (no pass over the keys): `moba_reference`'s block rule for one
  query after every stored key, as `[start, end)` ranges of slots (the selected earlier blocks, the own block);
- `ranges_attention_reference`: one query per head over its ranges;
- `MobaStep`: what a step attends with once its key is stored (the buffer and the block state, `ops.moba_decode`).

Blocks are counted in each row's real positions (a left-padded row has the blocks of its prompt alone, and a padded
token amid a row moves no boundary): block n of a row holds its real keys at positions n * block_size .. + block_size
- 1, found in the slots from its first key's slot up to the next block's (padding in between is masked). Every
operation keeps its shapes and reads no device value on the host, so a step replays from a CUDA graph.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class MobaStep(NamedTuple):
    """What a decode step attends with, after its key was stored (`store_step_reference` / `ops.moba_store_step`;
    methods/moba/cache.py's `MobaLayer.decode_step` returns it): the buffer, keys/values `[B, Hkv, cap, D]` and
    key_mask `[B, cap]` (True = real), the step's slot `[B]` and whether its token is real (`[B]` bool, None: all
    real), and the block state (`add_block_keys`): key_sums `[B, Hkv, nb, D]`, block_start `[B, nb]`, n_real `[B]`.
    """

    keys: torch.Tensor
    values: torch.Tensor
    key_mask: torch.Tensor
    slot: torch.Tensor
    real: torch.Tensor | None
    key_sums: torch.Tensor
    block_start: torch.Tensor
    n_real: torch.Tensor


def add_block_keys(key_sums: torch.Tensor, block_start: torch.Tensor, n_real: torch.Tensor, k: torch.Tensor,
                   valid: torch.Tensor | None, slots: torch.Tensor, *, block_size: int) -> None:
    """Adds keys k `[B, Hkv, n, D]` stored at `slots` `[B or 1, n]` (valid `[B, n]` real or not; None: all real) to
    the block state, in place: each real key to the sum of its block (key_sums `[B, Hkv, nb, D]`, the work dtype),
    a key at a block's first position marks that block's first slot (block_start `[B, nb]`), n_real `[B]` moves on."""
    B, H, n, D = k.shape
    if valid is None:
        pos = n_real[:, None] + torch.arange(n, device=k.device)[None]
    else:
        pos = n_real[:, None] + valid.long().cumsum(1) - 1
    blk = pos.clamp(min=0) // block_size
    src = k.detach().to(key_sums.dtype)
    if valid is not None:
        src = torch.where(valid[:, None, :, None], src, torch.zeros_like(src))
    key_sums.scatter_add_(2, blk[:, None, :, None].expand(B, H, n, D), src)
    first = pos % block_size == 0
    if valid is not None:
        first = first & valid
    block_start.scatter_reduce_(1, blk, torch.where(first, slots.expand(B, n), torch.zeros_like(blk)), "amax")
    n_real.add_(n if valid is None else valid.sum(1))


def store_step_reference(k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                         mask: torch.Tensor, pos: torch.Tensor, key_sums: torch.Tensor, block_start: torch.Tensor,
                         n_real: torch.Tensor, real: torch.Tensor | None, *, block_size: int) -> torch.Tensor:
    """One token k/v `[B, Hkv, 1, D]` into the buffer (keys/values `[B, Hkv, cap, D]`, mask `[B, cap]`) at the write
    slot `pos` `[B]` (then advanced) and into the block state (`add_block_keys`); real `[B]` bool, None: all real.
    In place; returns the token's slot `[B]`."""
    B, H, _, D = k.shape
    slot = pos.clone()
    at = slot.view(B, 1, 1, 1).expand(B, H, 1, D)
    keys.scatter_(2, at, k.to(keys.dtype))
    values.scatter_(2, at, v.to(values.dtype))
    mask.scatter_(1, slot[:, None], True if real is None else real[:, None])
    add_block_keys(key_sums, block_start, n_real, k, None if real is None else real[:, None], slot[:, None],
                   block_size=block_size)
    pos.add_(1)
    return slot


def decode_gate(q: torch.Tensor, key_sums: torch.Tensor, block_start: torch.Tensor, n_real: torch.Tensor,
                slot: torch.Tensor, real: torch.Tensor | None, *, block_size: int, top_k: int, min_seq_len: int = 0,
                gating: str = "block", query_sum: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys a decode step attends, as `[start, end)` ranges of buffer slots, from the block state (the step's key
    already stored and counted): the rule of `moba_reference` for one query after every stored key.

    q `[B, Hq, 1, D]`; key_sums `[B, Hkv, nb, D]` (work dtype; an earlier block is complete: its mean is
    key_sums / block_size); block_start `[B, nb]`; n_real `[B]`; slot `[B]` the step's own slot; real `[B]` bool
    (None: all real). Block gating: `query_sum` `[B, Hq, D]` (the current block's earlier queries) gives the gate,
    the mean of the block's queries up to this one, and is updated in place (zeroed when this query completes its
    block); token gating: the query itself.

    Returns (starts, ends) `[B, Hq, top_k]` int32: the `top_k - 1` earlier blocks of highest score, then the own
    block up to the step's slot (top_k ranges at every buffer size, so that the kernels' launches do not change with
    it: a buffer of at most top_k - 1 blocks has only empty earlier ranges). A row that
    takes every earlier key (at most top_k - 1 earlier blocks, or below min_seq_len) has one range from its first
    real key on; a padded query one range holding its own slot (it sees its own key only, as `allowed_keys`). Empty
    ranges have start = end = 0."""
    B, Hq, _, D = q.shape
    Hkv, nb = key_sums.shape[1], key_sums.shape[2]
    G = Hq // Hkv
    wd = key_sums.dtype
    q1 = q[:, :, 0].to(wd)
    qpos = (n_real - 1).clamp(min=0)  # the query's position (a real query's key is counted)
    own = qpos // block_size
    if gating == "block":
        g = q1 if query_sum is None else query_sum.to(wd) + q1
        if query_sum is not None:  # the block's queries so far: zeroed once this one completes it
            done = ((qpos + 1) % block_size == 0)[:, None, None]
            new = torch.where(done, torch.zeros_like(g), g).to(query_sum.dtype)
            query_sum.copy_(new if real is None else torch.where(real[:, None, None], new, query_sum))
        g = g / (qpos % block_size + 1).to(wd)[:, None, None]
        everything = own * block_size < min_seq_len
    else:
        g = q1
        everything = qpos < min_seq_len
    k_sel = top_k - 1
    everything = everything | (own <= k_sel)  # its own earlier blocks are at most top_k - 1: all of them
    slot = slot.long()
    own_start = torch.where(everything, block_start[:, 0], block_start.gather(1, own[:, None])[:, 0])
    if real is not None:
        own_start = torch.where(real, own_start, slot)
    starts = own_start[:, None, None].expand(B, Hq, 1)
    ends = (slot + 1)[:, None, None].expand(B, Hq, 1)
    if k_sel >= nb:  # no row has more than top_k - 1 earlier blocks: every row takes all of them
        empty = torch.zeros(B, Hq, k_sel, dtype=starts.dtype, device=q.device)
        starts, ends = torch.cat([empty, starts], 2), torch.cat([empty, ends], 2)
    elif k_sel > 0:
        means = key_sums / block_size
        scores = torch.matmul(g.reshape(B, Hkv, G, D), means.transpose(2, 3)).view(B, Hq, nb)
        cand = torch.arange(nb, device=q.device)[None, :] < own[:, None]
        scores = scores.masked_fill(~cand[:, None, :], float("-inf"))
        idx = scores.topk(k_sel, dim=2).indices  # [B, Hq, k_sel]
        at = block_start[:, None, :].expand(B, Hq, nb)
        bs0, bs1 = at.gather(2, idx), at.gather(2, (idx + 1).clamp(max=nb - 1))
        drop = everything if real is None else everything | ~real
        bs0 = bs0.masked_fill(drop[:, None, None], 0)
        bs1 = bs1.masked_fill(drop[:, None, None], 0)
        starts, ends = torch.cat([bs0, starts], 2), torch.cat([bs1, ends], 2)
    return starts.to(torch.int32).contiguous(), ends.to(torch.int32).contiguous()


def ranges_attention_reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, key_mask: torch.Tensor,
                               starts: torch.Tensor, ends: torch.Tensor, slot: torch.Tensor, *,
                               scale: float) -> torch.Tensor:
    """One query per head over ranges of buffer slots: q `[B, Hq, 1, D]`, keys/values `[B, Hkv, cap, D]`, key_mask
    `[B, cap]` (True = real), starts/ends `[B, Hq, NL]` (disjoint ranges, as `decode_gate` gives: distinct blocks); a
    query sees the real keys of its ranges and its own slot `slot` `[B]` (real or not). Dense over the buffer in the
    work dtype (fp32, float64 for float64); returns `[B, 1, Hq, D]` in q's dtype."""
    B, Hq, _, D = q.shape
    Hkv, cap = keys.shape[1], keys.shape[2]
    G = Hq // Hkv
    wd = torch.float64 if q.dtype == torch.float64 else torch.float32
    s = torch.arange(cap, device=q.device)
    inside = ((s >= starts[..., None]) & (s < ends[..., None])).any(2)  # [B, Hq, cap]
    visible = key_mask.bool() | (s[None, :] == slot.long()[:, None])
    ok = inside & visible[:, None, :]
    logits = torch.matmul(q.to(wd).reshape(B, Hkv, G, D), keys.to(wd).transpose(2, 3)).view(B, Hq, cap) * scale
    p = torch.softmax(logits.masked_fill(~ok, float("-inf")), dim=-1)
    o = torch.matmul(p.view(B, Hkv, G, cap), values.to(wd)).view(B, Hq, D)
    return o[:, None].to(q.dtype)


__all__ = ["MobaStep", "add_block_keys", "decode_gate", "ranges_attention_reference", "store_step_reference"]
