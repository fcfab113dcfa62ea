"""The dispatch of MoBA attention: exact attention where MoBA cannot differ from it; block gating over a whole
sequence through the block-list Triton kernels (MuSe's cells kernels without a far field,
`kernels.muse.listed_blocks_triton`, taken through the muse package's interface), forward and backward; else the
PyTorch reference (dense logits per chunk of queries under the MoBA mask: O(Sq * Sk) work, as exact attention).
A decode step over a cache that keeps the block state incrementally (`moba_decode`) is gated from that state and
attends to its `top_k` blocks only (`triton_decode.py` on CUDA). docs/moba.md.
"""

from __future__ import annotations

import torch

from ...errors import ConfigError
from ..backend import BACKENDS, attention_kernel_missing, resolve_backend
from ..muse import cells_supported, listed_blocks_triton
from ..softmax import softmax_attention
from .reference import GATINGS, block_gate, block_query_sums, carry_query_sum, key_positions, moba_reference, \
    prefix_block_sums, query_positions
from .reference_decode import MobaStep, decode_gate, ranges_attention_reference, store_step_reference


def moba_is_exact(Sk: int, *, block_size: int, top_k: int, min_seq_len: int) -> bool:
    """Whether every query of a call over `Sk` keys attends to all its earlier keys: a query at position p < Sk has
    p // block_size earlier blocks, all selected while that is < top_k, and p < min_seq_len is exact by rule."""
    return Sk <= max(top_k * block_size, min_seq_len)


def moba_triton_missing(q: torch.Tensor, *, block_size: int, gating: str, whole: bool) -> str | None:
    """None when the Triton path can run this call, else why not (what to change)."""
    if gating != "block":
        return "gating='token' has no Triton kernel (each query picks its own blocks); use gating='block'"
    if not whole:
        return ("the Triton path computes whole sequences (continued prefills take the reference; the decode steps of "
                "a block-gated cache run `moba_decode`)")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"dtype {q.dtype}: the kernels take fp16, bf16 or fp32"
    return cells_supported(q, block_size=block_size)


def moba_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, block_size: int = 512,
                   top_k: int = 3, key_mask: torch.Tensor | None = None, q_offset: int | None = None,
                   min_seq_len: int = 0, gating: str = "block", query_sum: torch.Tensor | None = None,
                   backend: str = "auto") -> torch.Tensor:
    """MoBA attention (kernels/moba/reference.py has the definition); q `[B, Hq, Sq, D]`, k/v `[B, Hkv, Sk, D]`,
    key_mask `[B, Sk]` or None, query i at key index `q_offset + i` (default `Sk - Sq`; >= Sk: after every key, a
    decode step over a preallocated buffer). gating "block" (per query block; the Triton path) or "token" (per
    query, MoBA's reference rule). query_sum `[B, Hq, D]` fp32 (block gating across calls: the sum of the queries
    of each row's current block before this call, updated in place; None: no earlier queries). backend: "auto"
    (Triton on CUDA where it runs, else the reference), "torch", or "triton" (a ConfigError where it cannot run).
    Returns `[B, Sq, Hq, D]`."""
    if backend not in BACKENDS:
        raise ConfigError(f"moba: backend must be one of {', '.join(BACKENDS)}, not {backend!r}")
    if gating not in GATINGS:
        raise ConfigError(f"moba: gating must be one of {', '.join(GATINGS)}, not {gating!r}")
    if block_size < 1 or top_k < 1:
        raise ConfigError(f"moba: block_size ({block_size}) and top_k ({top_k}) must be >= 1")
    B, Sq, Sk = q.shape[0], q.shape[2], k.shape[2]
    if moba_is_exact(Sk, block_size=block_size, top_k=top_k, min_seq_len=min_seq_len):
        if gating == "block" and query_sum is not None:  # the carried sum still follows the queries
            kpos, valid = key_positions(key_mask, B, Sk, q.device)
            qpos, qreal, _ = query_positions(kpos, valid, Sq, q_offset)
            block_query_sums(q, qpos, qreal, block_size=block_size, nbq=-(-Sk // block_size), query_sum=query_sum)
        return softmax_attention(q, k, v, scale=scale, key_mask=key_mask, q_offset=q_offset)
    be = resolve_backend(backend, q, k, v, what="moba")  # backend='triton' where Triton cannot run: a DeviceError
    if be == "triton":
        why = moba_triton_missing(q, block_size=block_size, gating=gating, whole=Sq == Sk and not q_offset)
        if why is None:
            return moba_block_triton(q, k, v, scale=scale, block_size=block_size, top_k=top_k, key_mask=key_mask,
                                     min_seq_len=min_seq_len, query_sum=query_sum)
        if backend == "triton":
            raise ConfigError(f"moba backend='triton' cannot run: {why}; use backend='auto' or 'torch'")
    return moba_reference(q, k, v, scale=scale, block_size=block_size, top_k=top_k, key_mask=key_mask,
                          q_offset=q_offset, min_seq_len=min_seq_len, gating=gating, query_sum=query_sum)


def moba_block_triton(q, k, v, *, scale: float, block_size: int, top_k: int, key_mask: torch.Tensor | None = None,
                      min_seq_len: int = 0, query_sum: torch.Tensor | None = None) -> torch.Tensor:
    """Block-gated MoBA over a whole sequence (Sq == Sk) on the block-list Triton kernels: the gate (PyTorch, no
    gradient) lists each query block's earlier blocks, the kernels attend exactly to them and to the own block.
    With a key mask, each row's real tokens are first gathered to its front (then positions are indices and the
    listed blocks hold real keys only) and the outputs scattered back; a padded query's output is its own value,
    as in the reference."""
    B, Hq, S, D = q.shape
    Hkv = k.shape[1]
    L = block_size
    nb = -(-S // L)
    dt = q.dtype
    k, v = k.to(dt), v.to(dt)
    v0 = v
    kpos, valid = key_positions(key_mask, B, S, q.device)
    if key_mask is not None:
        order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)  # real tokens first, in order
        take = lambda t: t.gather(2, order[:, None, :, None].expand(*t.shape[:2], S, D))  # noqa: E731
        q, k, v = take(q), take(k), take(v)
        n_real = valid.sum(1, keepdim=True)
        cvalid = torch.arange(S, device=q.device)[None] < n_real
        ckpos = torch.minimum(torch.arange(S, device=q.device)[None].expand(B, S), n_real - 1)
    else:
        cvalid, ckpos = valid, kpos
    with torch.no_grad():  # positions are indices here, the real tokens a prefix of each row: block sums of views
        mask = None if key_mask is None else cvalid
        ks, kc = prefix_block_sums(k.detach(), mask, L)
        means = ks / kc.clamp(min=1)[:, None, :, None]
        sums = prefix_block_sums(q.detach(), mask, L)
        carry_query_sum(*sums, ckpos, cvalid, block_size=L, query_sum=query_sum)
        sel = block_gate(q, means, ckpos, cvalid, block_size=L, top_k=top_k, min_seq_len=min_seq_len, sums=sums)
        key_valid = torch.nn.functional.pad(cvalid, (0, nb * L - S))
    most = max(top_k - 1, -(-min_seq_len // L))  # earlier blocks a query block lists at most
    o = listed_blocks_triton(q, k, v, sel.contiguous(), key_valid, block_size=L, max_listed=most, scale=scale)
    if key_mask is None:
        return o
    o = o.gather(1, kpos.clamp(min=0)[:, :, None, None].expand(B, S, Hq, D))  # [B, S, Hq, D] in original order
    own = v0.repeat_interleave(Hq // Hkv, 1).transpose(1, 2)
    return torch.where(valid[:, :, None, None], o, own.to(o.dtype))


def decode_kernels_missing(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, key_sums: torch.Tensor,
                           backend: str) -> str | None:
    """None when the decode step's Triton kernels run (`triton_decode.py`), else why not (the PyTorch reference of
    `reference_decode.py` runs it then, the same step)."""
    if resolve_backend(backend, q, keys, values, what="moba") != "triton":
        return "backend 'torch', or tensors that are not on CUDA"
    why = attention_kernel_missing(q, keys, values)
    if why is None and key_sums.dtype != torch.float32:
        why = f"block state in {key_sums.dtype}: the kernels keep it in fp32"
    if why is not None and backend == "triton":
        raise ConfigError(f"moba backend='triton' cannot run this decode step: {why}; use backend='auto' or 'torch'")
    return why


def moba_store_step(k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                    pos: torch.Tensor, key_sums: torch.Tensor, block_start: torch.Tensor, n_real: torch.Tensor,
                    real: torch.Tensor | None, *, block_size: int, backend: str = "auto") -> torch.Tensor:
    """A decode step's token into the buffer and the block state, in place (`reference_decode.store_step_reference`:
    its arguments; one launch on CUDA); returns the token's slot `[B]`."""
    if decode_kernels_missing(k, keys, values, key_sums, backend) is None:
        from .triton_decode import store_step

        return store_step(k, v, keys, values, mask, pos, key_sums, block_start, n_real, real, block_size=block_size)
    return store_step_reference(k, v, keys, values, mask, pos, key_sums, block_start, n_real, real,
                                block_size=block_size)


def moba_decode(q: torch.Tensor, step: MobaStep, *, scale: float, block_size: int = 512, top_k: int = 3,
                min_seq_len: int = 0, gating: str = "block", query_sum: torch.Tensor | None = None,
                backend: str = "auto", splits: int | None = None) -> torch.Tensor:
    """One decode step of MoBA over a preallocated buffer whose block state is kept incrementally (the step's token
    stored and counted by `moba_store_step`): the gate from that state (`reference_decode.decode_gate`: no pass over
    the keys), then the query attends to the selected ranges of slots only. On CUDA the kernels of
    `triton_decode.py` (three launches), elsewhere the PyTorch reference (dense under the ranges: the same result).
    q `[B, Hq, 1, D]`; `step` (`reference_decode.MobaStep`): the buffer, the step's slot and realness and the block
    state; the gate's options are `decode_gate`'s (query_sum updated in place). Device state only, launches sized by
    the buffer's shapes: a step replays from a CUDA graph. `splits`: pieces per range (tests). Returns
    `[B, 1, Hq, D]`: `moba_reference`'s output for the query after every stored key."""
    keys, values, key_mask, slot, real, key_sums, block_start, n_real = step
    gate_kw = dict(block_size=block_size, top_k=top_k, min_seq_len=min_seq_len, gating=gating, query_sum=query_sum)
    if decode_kernels_missing(q, keys, values, key_sums, backend) is None:
        from .triton_decode import gate_ranges, ranges_attention

        starts, ends = gate_ranges(q, key_sums, block_start, n_real, slot, real, **gate_kw)
        # the keys of a selected range: a block (top_k 1, one range: it may hold every earlier key, up to the buffer)
        longest = keys.shape[2] if starts.shape[2] == 1 else block_size
        return ranges_attention(q, keys, values, key_mask, starts, ends, slot, scale=scale, longest=longest,
                                splits=splits)
    starts, ends = decode_gate(q, key_sums, block_start, n_real, slot, real, **gate_kw)
    return ranges_attention_reference(q, keys, values, key_mask, starts, ends, slot, scale=scale)


__all__ = ["BACKENDS", "decode_kernels_missing", "moba_attention", "moba_block_triton", "moba_decode", "moba_is_exact",
           "moba_store_step", "moba_triton_missing"]
