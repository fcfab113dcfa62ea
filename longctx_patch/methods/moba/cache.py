"""`moba`'s cache layer: the full K/V cache plus, for block gating, the block state a decode step gates with."""

from __future__ import annotations

import torch

from ...kernels.moba import MobaStep, add_block_keys, moba_store_step
from ..kv_layer import KVBufferLayer, KVView

CHUNK_ELEMS = 2**25  # a prefill adds its keys to the block sums this many elements (fp32) at a time


def blocks_for(capacity: int, block_size: int) -> int:
    """Blocks of the block state of a buffer of `capacity` slots (a position is at most its slot)."""
    return -(-capacity // block_size)


class MobaLayer(KVBufferLayer):
    """The full KV cache plus, for block gating, the state that gates a decode step without a pass over the keys
    (docs/moba.md, "Cache, decode, padding"), every tensor updated in place by each call (a decode step too, so it
    replays from CUDA graphs):

    - `query_sum` `[B, Hq, D]`: the sum of the queries of each row's current (incomplete) block;
    - `key_sums` `[B, Hkv, nb, D]`: the sum of each block's real keys, nb = ceil(capacity / block_size) (grown with
      the buffer);
    - `block_start` `[B, nb]`: the slot of each started block's first real key (blocks counted in each row's real
      positions: a left-padded row has the blocks of its prompt alone);
    - `n_real` `[B]`: the real keys stored (the next real token's position).

    fp32 (float64 for a float64 model), as `moba_reference` computes the gate. Not croppable: the queries of dropped
    tokens cannot be taken out of the sum."""
    crop_refusal = ("with gating='block' it holds the sum of the current block's queries, which cannot give one back "
                    "(gating='token' can)")
    state_names = KVBufferLayer.state_names + ("query_sum", "key_sums", "block_start", "n_real")
    is_croppable = False

    def __init__(self, block_size: int = 512, backend: str = "auto"):
        super().__init__()
        self.block_size = block_size
        self.backend = backend  # of the step's store (kernels.moba.moba_store_step)

    def graph_key(self):
        # the step's launches are sized by the buffer's capacity (and the block state's, which follows it)
        key = super().graph_key()
        return None if key is None else ("moba",) + key[1:]

    def query_sum_like(self, q: torch.Tensor) -> torch.Tensor:
        if self.query_sum is None:
            B, Hq, _, D = q.shape
            self.query_sum = torch.zeros(B, Hq, D, dtype=_work_dtype(q), device=q.device)
        return self.query_sum

    # -- a decode step (one token, no gradient): device state only ---------------------------------------------
    def decode_step(self, k: torch.Tensor, v: torch.Tensor, padding: torch.Tensor | None) -> MobaStep:
        """Stores the token's key/value at the write slot and adds its key to its block (the last entry of `padding`
        `[B, seen + 1]` says whether it is real); returns what its query attends with."""
        self._reserve(self.seen + 1, k)
        return self._write_step(k, v, padding)

    def _step(self, k, v, padding) -> KVView:
        """`extend`'s one-token path (callers other than `MobaAttention`): the step, then the whole buffer."""
        st = self._write_step(k, v, padding)
        km = st.key_mask.clone().scatter_(1, st.slot[:, None], True)
        return KVView(self.keys, self.values, km, self.capacity, None)

    def _write_step(self, k, v, padding) -> MobaStep:
        real = None if padding is None else padding[:, -1].bool()
        slot = moba_store_step(k, v, self.keys, self.values, self.mask, self.pos, self.key_sums, self.block_start,
                               self.n_real, real, block_size=self.block_size, backend=self.backend)
        self.seen += 1
        return MobaStep(self.keys, self.values, self.mask, slot, real, self.key_sums, self.block_start, self.n_real)

    # -- storage -----------------------------------------------------------------------------------------------
    def _reserve(self, tokens: int, like: torch.Tensor) -> None:
        super()._reserve(tokens, like)
        nb = blocks_for(self.capacity, self.block_size)
        if self.key_sums is not None and self.key_sums.shape[2] == nb:
            return
        B, H, _, D = like.shape
        key_sums = torch.zeros(B, H, nb, D, dtype=_work_dtype(like), device=like.device)
        block_start = torch.zeros(B, nb, dtype=torch.long, device=like.device)
        if self.key_sums is None:
            self.n_real = torch.zeros(B, dtype=torch.long, device=like.device)
        else:  # the buffer grew: the blocks so far are the same
            old = self.key_sums.shape[2]
            key_sums[:, :, :old] = self.key_sums
            block_start[:, :old] = self.block_start
        self.key_sums, self.block_start = key_sums, block_start

    def _write(self, k, v, padding, first: int) -> None:
        """A multi-token call's keys (slots first .. first + n - 1): stored, then added to their blocks."""
        super()._write(k, v, padding, first)
        n = k.shape[2]
        valid = padding[:, padding.shape[1] - n:].bool() if padding is not None else None
        slots = torch.arange(first, first + n, device=k.device)[None]
        step = max(1, CHUNK_ELEMS // max(1, k.shape[0] * k.shape[1] * k.shape[3]))
        for s in range(0, n, step):  # bounded fp32 transients for a long prefill
            e = min(n, s + step)
            add_block_keys(self.key_sums, self.block_start, self.n_real, k[:, :, s:e],
                           None if valid is None else valid[:, s:e], slots[:, s:e], block_size=self.block_size)

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a moba cache with gating='block' cannot drop tokens (it holds the sum of the "
                                  "current block's queries); use gating='token' for assisted or speculative decoding")


def _work_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


__all__ = ["MobaLayer", "MobaStep", "blocks_for"]
