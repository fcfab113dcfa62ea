"""`LolaLayer`: the cache layer of `lolcats` and `lola` (window buffer, sparse cache with scores, linear state), a
transformers cache layer over the kernels' `LolaState` (kernels/lola/state.py)."""

from __future__ import annotations

import torch

from ...kernels.lola.state import LolaState, StateSizes
from ..cache_layer import LongctxLayer


def sparse_head_count(sparse_heads: str, Hq: int, Hkv: int) -> int:
    """Heads of the sparse cache: the kv heads (`sparse_heads=kv`) or the query heads (`query`)."""
    return Hq if sparse_heads == "query" else Hkv


class LolaLayer(LongctxLayer):
    """Cache layer of `lolcats` / `lola`: window buffer, sparse cache with scores, linear state.

    win_k / win_v [B, Hkv, window+chunk, D], win_mask [B, .] (left padding), sp_k / sp_v [B, Hs, lambda, D],
    sp_score [B, Hs, lambda] fp32 (-inf = empty) with Hs the kv heads (`sparse_heads=kv`) or the query heads,
    H [B, Hq, 2F, D] fp32, s [B, Hq, 2F] fp32, win_fk [B, Hq, chunk, 2F] (`feature_cache`, else None): phi(k) of
    the buffered keys older than the window (computed once per key; kernels/lola/state.py), nb_t [B] int64: the
    buffered count on the device (what a replayed decode step reads). Nothing grows with the context.
    """
    crop_refusal = "its linear state sums every token older than the window, and a sum cannot give one back"
    state_names = ("win_k", "win_v", "win_mask", "sp_k", "sp_v", "sp_score", "H", "s", "win_fk", "nb_t")
    host_fields = ("seen", "nb")

    def __init__(self, window: int, chunk: int, sparse_cache: int, sparse_heads: str = "kv",
                 feature_cache: bool = False):
        super().__init__()
        self.feature_cache = feature_cache
        self.window = window
        self.chunk = chunk
        self.sparse_cache = sparse_cache
        self.sparse_heads = sparse_heads
        self.nb = 0  # buffered tokens at the front of win_k / win_v / win_mask
        self.phases = None  # RowPhases of a left-padded batch whose rows evict on different grids (ops.lola_process)

    def reset(self) -> None:
        super().reset()
        self.nb = 0
        self.phases = None

    def graph_key(self):
        # a decode step (kernels/lola/sparse_cache.py `decode_step`) appends at the device row nb_t and attends the
        # whole buffer up to it: the same launches at every position. Only the step that ends a chunk evicts, sized
        # by the host's nb (nb + 1 - window pairs leave the window): its own key. Rows evicting on their own grids
        # (a left-padded batch: `phases`) decide on the host per row; the feature cache must be there, row for row
        # with the buffer (else the step would allocate it)
        if (self.H is None or self.phases is not None or self.win_k is None or self.nb_t is None
                or self.win_k.shape[2] != self.window + self.chunk):
            return None
        if self.feature_cache and (self.win_fk is None or self.win_fk.shape[2] != self.win_k.shape[2] - self.window):
            return None
        evicts = (self.seen + 1) % self.chunk == 0 and self.nb + 1 > self.window
        return ("lola", self.nb + 1 if evicts else 0, self.win_mask is None)

    def graph_variants(self) -> list[dict]:
        """The host state of this layer's next evicting step, when the next step does not evict: a step of the
        other key that a decode will need within `chunk` steps (decode_graphs.py captures it ahead)."""
        ahead = (self.chunk - 1 - self.seen % self.chunk) % self.chunk
        if ahead == 0 or self.nb + ahead + 1 <= self.window:
            return []
        return [{"seen": self.seen + ahead, "nb": self.nb + ahead}]

    # the rows' eviction grids follow the batch rows (host-side: one device-to-host copy, padded batches only)
    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        if self.phases is not None:
            self.phases = self.phases.select([r for r in range(len(self.phases.lead)) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        if self.phases is not None:
            self.phases = self.phases.select(torch.arange(len(self.phases.lead))[indices.cpu()].tolist())

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        if self.phases is not None:
            self.phases = self.phases.select(beam_idx.tolist())

    def get_state(self, B, Hq, Hkv, D, F2, like: torch.Tensor) -> LolaState:
        if self.H is None:
            if not self.is_initialized:
                self.lazy_initialization(like)
            sizes = StateSizes(B, Hq, Hkv, D, F2, self.sparse_cache,
                               sparse_heads=sparse_head_count(self.sparse_heads, Hq, Hkv))
            st = LolaState.empty(sizes, like.dtype, like.device, capacity=self.window + self.chunk,
                                 feature_cache=self.feature_cache)
            st.pos = self.seen
            return st
        return LolaState(**{n: getattr(self, n) for n in self.state_names}, pos=self.seen, nb=self.nb,
                         phases=self.phases, feature_cache=self.feature_cache)

    def set_state(self, st: LolaState) -> None:
        for n in self.state_names:
            t = getattr(st, n)
            setattr(self, n, t.detach() if isinstance(t, torch.Tensor) else t)
        self.seen = st.pos
        self.nb = st.nb
        self.phases = st.phases
