"""The PyTorch path of exact sliding-window causal attention in O(S * W) time and memory: banded blocks through SDPA
(differentiable; the Triton forward of `triton_window.py` must equal it).

Queries are cut into blocks of `block` tokens; the queries of a block see at most the `block + W - 1` keys
ending at the block's last query (its band). Every band is gathered at once (`unfold` of the keys, padded by `W`
on the left; one extra key per band, always masked, keeps the mask 8-aligned), the G query heads of a kv head
are stacked along the query axis (each band read once per kv head), and one SDPA call with a band mask attends
all blocks: `S / block` attention problems of `G * block x (block + W)`, instead of one `S x S` problem under a
dense mask. Differentiable (SDPA and `unfold` have backward passes). The band mask is the same for every block;
key validity (the left edge, the padded tail, left padding) is the only per-block part.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def band_block(window: int) -> int:
    """Queries per block: the window rounded up to a multiple of 64, within 64..256 (bands of W + block - 1 keys:
    at most 2x the keys for W >= 256, and never tiny problems for small windows)."""
    return max(64, min(256, -(-window // 64) * 64))


def banded_window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    window: int,
    key_mask: torch.Tensor | None = None,
    q_offset: int | None = None,
    block: int | None = None,
) -> torch.Tensor:
    """Causal attention of each query to its last `window` keys (its own included).

    q `[B, Hq, Sq, D]` at key positions `q_offset + i` (default `Sk - Sq`: the queries are the last keys), k/v
    `[B, Hkv, Sk, D]`, key_mask `[B, Sk]` bool (True = real) or None. A query always sees its own key (a padded
    query row is never empty), as `kernels.softmax.attention_mask`. Returns `[B, Sq, Hq, D]` in q's dtype.
    """
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    G = Hq // Hkv
    W = int(window)
    o0 = Sk - Sq if q_offset is None else int(q_offset)
    if not (0 <= o0 and o0 + Sq <= Sk):
        raise ValueError(f"queries at key positions {o0}..{o0 + Sq - 1} do not lie within the {Sk} keys")
    bq = int(block or band_block(W))
    nb = -(-Sq // bq)
    # a band: the bq + W keys ending at the block's last query (one more than needed, always masked, so that the
    # mask's rows are 8-aligned for SDPA's memory-efficient kernel when W is a multiple of 8)
    lb = bq + W
    right = nb * bq - Sq  # query padding of the last block (its outputs are dropped)
    # keys padded: W on the left (positions before 0), so that block j's band starts at o0 + j * bq
    extra = o0 + nb * bq - Sk  # keys missing after the last real one for the last band
    kp = F.pad(k, (0, 0, W, max(extra, 0)))
    vp = F.pad(v, (0, 0, W, max(extra, 0)))
    valid = torch.ones(B, Sk, dtype=torch.bool, device=q.device) if key_mask is None else key_mask.bool()
    valid = F.pad(valid, (W, max(extra, 0)), value=False)
    span = slice(o0, o0 + (nb - 1) * bq + lb)
    kb = kp[:, :, span].unfold(2, lb, bq)  # [B, Hkv, nb, D, lb]
    vb = vp[:, :, span].unfold(2, lb, bq)
    vmask = valid[:, span].unfold(1, lb, bq)  # [B, nb, lb]
    kb = kb.permute(0, 2, 1, 4, 3).reshape(B * nb, Hkv, lb, D)
    vb = vb.permute(0, 2, 1, 4, 3).reshape(B * nb, Hkv, lb, D)
    # queries: [B, Hq, nb*bq, D] -> [B*nb, Hkv, G*bq, D] (the G heads of a kv head stacked along the query axis)
    qp = F.pad(q, (0, 0, 0, right))
    qb = qp.reshape(B, Hkv, G, nb, bq, D).permute(0, 3, 1, 2, 4, 5).reshape(B * nb, Hkv, G * bq, D)
    # band mask: query i of a block sees band keys t with i < t <= i + W (causal and window), t = i + W being its
    # own key
    i = torch.arange(bq, device=q.device)[:, None]
    t = torch.arange(lb, device=q.device)[None, :]
    band = (t > i) & (t <= i + W)
    own = t == i + W
    mask = (band[None] & vmask.reshape(B * nb, 1, lb)) | own[None]  # [B*nb, bq, lb]
    mask = mask[:, None, None].expand(B * nb, 1, G, bq, lb).reshape(B * nb, 1, G * bq, lb)
    o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale)  # [B*nb, Hkv, G*bq, D]
    o = o.reshape(B, nb, Hkv, G, bq, D).permute(0, 1, 4, 2, 3, 5).reshape(B, nb * bq, Hq, D)
    return o[:, :Sq]


def banded_bytes(B: int, Hq: int, Hkv: int, S: int, D: int, window: int, itemsize: int) -> int:
    """Transient bytes of `banded_window_attention` over S queries and keys: the key/value bands, the stacked
    queries and output, and the mask (what the docs' O(S * W) memory means in bytes)."""
    bq = band_block(window)
    nb = -(-S // bq)
    lb = bq + window
    bands = 2 * B * nb * Hkv * lb * D * itemsize
    qo = 2 * B * nb * bq * Hq * D * itemsize
    mask = B * nb * (Hq // Hkv) * bq * lb
    return bands + qo + mask


__all__ = ["band_block", "banded_bytes", "banded_window_attention"]
