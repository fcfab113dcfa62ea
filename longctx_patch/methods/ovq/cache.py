"""`ovq`'s cache layer: the dictionaries, their counts and the open chunk of one layer."""

from __future__ import annotations

import torch

from ...kernels.ovq import OpenChunk, OVQState, ovq_open_attention, target_int
from ..cache_layer import LongctxLayer


class OVQLayer(LongctxLayer):
    """Decode state of one OVQ layer: dictionaries, counts and the open chunk.

    key_sums / value_sums ``[B, Hkv, N, D]`` float32 (row means = sums / counts), counts ``[B, Hkv, N]``,
    n_active / absorbed ``[B]``; the open chunk (tokens not yet absorbed) is the first ``open_len`` columns of
    open_keys / open_values ``[B, Hkv, chunk, D]`` and open_valid ``[B, chunk]``: a buffer allocated once, so
    that a decode step writes its key at the device position ``open_pos`` and attends to the whole buffer under
    its validity mask (`ovq_open_attention`). Such a step reads one host value, the dictionary size, and changes
    no tensor's address: it is replayed from a CUDA graph (decode_graphs.py; the step that completes a chunk
    absorbs it and runs eagerly). The dictionary tensors keep their addresses across absorbs too (copied into).

    ``phases``: None, or (a left-padded batch whose paddings are not all whole chunks) each row's left padding
    modulo the chunk, host ints fixed by the first forward: row r's chunks start at ``phases[r] + j * C``, so it
    computes what it computes alone (``kernels.ovq.ovq_attention_phased``). The open chunk then holds each row's
    own open tokens right-aligned, as wide as the longest (``open_len``; columns left of a row's part are masked).
    """
    crop_refusal = "its dictionaries absorb every chunk, and cannot give a token back"
    state_names = ("key_sums", "value_sums", "counts", "n_active", "absorbed", "open_keys", "open_values", "open_valid",
                   "open_pos")
    host_fields = ("seen", "open_len")

    def __init__(self, chunk_size: int, max_centroids: int, growth: float = 0.0):
        super().__init__()
        self.chunk_size = chunk_size
        self.max_centroids = max_centroids
        self.growth = growth
        self.phases: tuple[int, ...] | None = None
        self.open_len = 0  # columns of open_keys holding the open chunk
        self.open_pos: torch.Tensor | None = None  # int64 [B], every row open_len: where a decode step writes

    def reset(self) -> None:
        super().reset()
        self.phases = None
        self.open_len = 0

    def _rows(self, rows: list[int]) -> None:
        if self.phases is not None:
            self.phases = tuple(self.phases[r] for r in rows)

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        if self.phases is not None:
            self._rows([r for r in range(len(self.phases)) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        if self.phases is not None:
            self._rows(torch.arange(len(self.phases))[torch.as_tensor(indices).cpu()].reshape(-1).tolist())

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        if self.phases is not None:
            self._rows(beam_idx.tolist())

    # -- decode steps replayed from CUDA graphs ---------------------------------------------------------
    def n_dict(self) -> int:
        """Dictionary rows the next query can see (a host bound from the tokens absorbed so far)."""
        return target_int(self.seen - self.open_len, self.max_centroids, self.growth)

    def graph_key(self):
        # a decode step in the buffer (`buffered_step`) launches by the dictionary size only; the step that
        # completes a chunk absorbs it (host-sized work) and rows on their own chunk grids (`phases`) are eager
        if (self.phases is not None or self.key_sums is None or self.open_pos is None
                or self.open_len + 1 >= self.chunk_size):
            return None
        return ("ovq", self.n_dict())

    def buffered_step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor | None,
                      backend: str) -> torch.Tensor:
        """One new token (``q`` ``[B, Hq, 1, D]``) that does not complete its chunk: its key and value written at
        ``open_pos``, then attention over the dictionary and the buffer. Call only when `graph_key()` is not None."""
        pos = self.open_pos[:1]  # every row writes at the same column (no phases)
        self.open_keys.index_copy_(2, pos, k.to(self.open_keys.dtype))
        self.open_values.index_copy_(2, pos, v.to(self.open_values.dtype))
        if valid is None:
            self.open_valid.index_fill_(1, pos, True)
        else:
            self.open_valid.index_copy_(1, pos, valid)
        self.open_pos.add_(1)
        n_dict = self.n_dict()
        st = OVQState(self.key_sums, self.value_sums, self.counts, self.n_active, self.absorbed)
        o = ovq_open_attention(q, st, OpenChunk(self.open_keys, self.open_values, self.open_valid), n_dict,
                               backend=backend)
        self.open_len += 1
        self.seen += 1
        return o

    # -- the general path ---------------------------------------------------------------------------------
    def get_state(self) -> tuple[OVQState | None, OpenChunk | None, int]:
        if self.key_sums is None:
            return None, None, 0
        st = OVQState(self.key_sums, self.value_sums, self.counts, self.n_active, self.absorbed)
        n = self.open_len
        op = (OpenChunk(self.open_keys[:, :, :n], self.open_values[:, :, :n], self.open_valid[:, :n])
              if n > 0 else None)
        return st, op, self.seen - n

    def _keep(self, name: str, t: torch.Tensor) -> None:
        """Store `t` under `name`, into the tensor already there when it has the same layout (its address is
        what a captured decode step reads)."""
        cur = getattr(self, name)
        if cur is None or (cur.shape, cur.stride(), cur.dtype, cur.device) != (t.shape, t.stride(), t.dtype, t.device):
            setattr(self, name, t)
        elif cur.data_ptr() != t.data_ptr():  # (the fast path updated it in place: nothing to copy)
            cur.copy_(t)

    def set_state(self, state: OVQState, open_chunk: OpenChunk | None, new_tokens: int, like: torch.Tensor) -> None:
        if not self.is_initialized:
            self.lazy_initialization(like)
        st = state.detach()
        with torch.no_grad():
            for name, t in (("key_sums", st.key_sums), ("value_sums", st.value_sums), ("counts", st.counts),
                            ("n_active", st.n_active), ("absorbed", st.seen)):
                self._keep(name, t)
            self._set_open(open_chunk, like, st.value_sums.shape[-1])
        self.seen += new_tokens

    def _set_open(self, open_chunk: OpenChunk | None, like: torch.Tensor, dv: int) -> None:
        B, H, _, D = like.shape
        n = open_chunk.length if open_chunk is not None else 0
        if self.phases is not None:  # right-aligned per-row open chunks, as wide as the longest
            if open_chunk is None:
                open_chunk = OpenChunk(like.new_zeros(B, H, 0, D), like.new_zeros(B, H, 0, dv),
                                       torch.zeros(B, 0, dtype=torch.bool, device=like.device))
            self.open_keys, self.open_values, self.open_valid = open_chunk.keys, open_chunk.values, open_chunk.valid
            self.open_len, self.open_pos = n, None
            return
        C = self.chunk_size
        if self.open_keys is None or tuple(self.open_keys.shape) != (B, H, C, D) or self.open_keys.dtype != like.dtype \
                or self.open_keys.device != like.device or self.open_pos is None:
            self.open_keys = like.new_zeros(B, H, C, D)
            self.open_values = like.new_zeros(B, H, C, dv)
            self.open_valid = torch.zeros(B, C, dtype=torch.bool, device=like.device)
            self.open_pos = torch.zeros(B, dtype=torch.long, device=like.device)
        if n:
            self.open_keys[:, :, :n].copy_(open_chunk.keys)
            self.open_values[:, :, :n].copy_(open_chunk.values)
            self.open_valid[:, :n].copy_(open_chunk.valid)
        self.open_valid[:, n:] = False
        self.open_pos.fill_(n)
        self.open_len = n


__all__ = ["OVQLayer"]
