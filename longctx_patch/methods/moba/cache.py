"""`moba`'s cache layer: the full K/V cache plus, for block gating, the sum of the current block's queries."""

from __future__ import annotations

import torch

from ..kv_layer import KVBufferLayer


class MobaLayer(KVBufferLayer):
    """The full KV cache plus, for block gating, `query_sum` `[B, Hq, D]` fp32: the sum of the queries of each
    row's current (incomplete) block, which `moba_attention` updates in place (a decode step too, so it replays
    from CUDA graphs). Not croppable: the queries of dropped tokens cannot be taken out of the sum."""

    state_names = KVBufferLayer.state_names + ("query_sum",)
    is_croppable = False

    def query_sum_like(self, q: torch.Tensor) -> torch.Tensor:
        if self.query_sum is None:
            B, Hq, _, D = q.shape
            self.query_sum = torch.zeros(B, Hq, D, dtype=torch.float32, device=q.device)
        return self.query_sum

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a moba cache with gating='block' cannot drop tokens (it holds the sum of the "
                                  "current block's queries); use gating='token' for assisted or speculative decoding")


__all__ = ["MobaLayer"]
