"""`ovq`: online vector-quantised attention (dictionaries of keys and values learned in the forward pass).

Per chunk of `chunk_size` tokens, queries attend with one softmax over the dictionary keys D_k (bias
log count) and the chunk's own keys (exact, causal); values come from D_v and the chunk.  After each
chunk the dictionary absorbs it (growth toward `max_centroids`, spread-maximisation init of new rows,
count-weighted online k-means).  Decode state: D_k, D_v, counts and the open chunk, O(max_centroids +
chunk_size) whatever the context length.  Details and every design choice: docs/ovq.md.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..cache_layer import LongctxLayer
from ...errors import ConfigError
from ...kernels.ovq import OpenChunk, OVQState, ovq_attention, ovq_attention_phased, ovq_open_attention, target_int
from ..base import Method, MethodConfig, PatchedAttention, option, register_method
from ..padding import left_padding


@dataclass
class OVQConfig(MethodConfig):
    chunk_size: int = option(512, "tokens per chunk: exact causal attention inside a chunk, dictionary update after it", min=1)
    max_centroids: int = option(1024, "maximum dictionary rows per key/value head (N)", min=1)
    growth: float = option(
        256.0,
        "Dirichlet-process-like growth: after T tokens the dictionary has min(N, T, ceil(growth*ln(1+T/growth))) "
        "rows; 0 = every token its own row until N",
        min=0.0,
    )
    beta: float = option(12.0, "initial inverse temperature of the unit-normalised q.k logits (qk_norm=true; "
                         "with qk_norm=false the temperature starts at the model's own 1/sqrt(head_dim))", min=1e-3)
    learn_beta: bool = option(True, "learn the inverse temperature (one per query head) during fine-tuning")
    qk_norm: bool = option(False, "unit-normalise q and k as in the OVQ paper (needs a fine-tune); false keeps the "
                           "model's raw post-rotary q/k, so the patched model works before any training")
    backend: str = option("auto", "kernels: auto (Triton on CUDA), triton, or torch (reference)",
                          choices=("auto", "triton", "torch"))
    exact_assign: bool = option(False, "Triton dictionary assignment with exact float32 dot products "
                                "(false: bf16 tensor-core dots; near ties may resolve differently)")
    train_path: str = option("auto", "training forward: parallel (every chunk's dictionary at once, 8-12x faster on "
                             "an H200, ~3x the memory), loop (chunk by chunk), or auto (parallel on CUDA, loop on CPU); "
                             "both give the same result", choices=("auto", "parallel", "loop"))

    def check(self) -> None:
        if not math.isfinite(self.growth):
            raise ConfigError(f"OVQConfig: growth must be finite, got {self.growth}")


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


class OVQAttention(PatchedAttention):
    method_name = "ovq"

    def __init__(self, orig, spec, config: OVQConfig, adapter):
        super().__init__(orig, spec, config, adapter)
        p = next(orig.parameters(), None)
        dev = p.device if p is not None else None
        init = config.beta if config.qk_norm else self.scaling
        # float32 whatever the model's dtype, as every method parameter (PatchedAttention._apply)
        log_beta = torch.full((spec.num_heads,), math.log(init), dtype=torch.float32, device=dev)
        self.ovq_log_beta = nn.Parameter(log_beta, requires_grad=config.learn_beta)

    def _scaled(self, q, k):
        if self.method_config.qk_norm:
            beta = self.ovq_log_beta.exp()
            qn = F.normalize(q.float(), dim=-1) * beta[None, :, None, None]
            kn = F.normalize(k.float(), dim=-1)
            return qn.to(q.dtype), kn.to(k.dtype)
        beta = self.ovq_log_beta.exp()
        return (q.float() * beta[None, :, None, None]).to(q.dtype), k

    def attend(self, q, k, v, cache_layer, padding):
        cfg: OVQConfig = self.method_config
        S = q.shape[2]
        qs, ks = self._scaled(q, k)
        valid = padding[:, padding.shape[1] - S:].bool() if padding is not None else None
        kw = dict(chunk_size=cfg.chunk_size, max_centroids=cfg.max_centroids, growth=cfg.growth,
                  backend=cfg.backend, exact_assign=cfg.exact_assign,
                  parallel={"auto": None, "parallel": True, "loop": False}[cfg.train_path])
        if cache_layer is None:
            phases = row_phases(padding, cfg.chunk_size)
            if phases is not None:
                o, _, _ = ovq_attention_phased(qs, ks, v, None, None, valid, phases, padding.shape[1] - S,
                                               keep_state=False, **kw)
                return o.transpose(1, 2)
            o, _, _, _ = ovq_attention(qs, ks, v, None, None, valid, **kw)
            return o.transpose(1, 2)
        if not isinstance(cache_layer, OVQLayer):
            raise TypeError(f"layer {self.layer_idx} is patched with ovq but its cache layer is "
                            f"{type(cache_layer).__name__}; pass no cache (one is created) or a LongctxCache")
        if cache_layer.seen == 0:  # the first forward fixes each row's chunk grid
            cache_layer.phases = row_phases(padding, cfg.chunk_size)
        if cache_layer.phases is not None:
            state, op, _ = cache_layer.get_state()
            o, state, op = ovq_attention_phased(qs, ks, v, state, op, valid, cache_layer.phases, cache_layer.seen,
                                                **kw)
            cache_layer.set_state(state, op, S, ks)
            return o.transpose(1, 2)
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (qs, ks, v))
        if S == 1 and not needs_grad and cache_layer.graph_key() is not None:
            return cache_layer.buffered_step(qs, ks, v, valid, cfg.backend).transpose(1, 2)
        state, op, absorbed = cache_layer.get_state()
        o, state, op, _ = ovq_attention(qs, ks, v, state, op, valid, seen_bound=absorbed if state is not None else None, **kw)
        cache_layer.set_state(state, op, S, ks)
        return o.transpose(1, 2)

    def make_cache_layer(self):
        cfg: OVQConfig = self.method_config
        return OVQLayer(cfg.chunk_size, cfg.max_centroids, cfg.growth)

    def state_bytes(self, context_len: int, batch: int = 1, dtype: torch.dtype = torch.bfloat16) -> int:
        """Bytes of `OVQLayer` after `context_len` (>= 1) tokens: the dictionary, allocated at `max_centroids`
        rows from the first token (float32 key/value sums and counts, int64 `n_active`/`absorbed`), plus the
        open-chunk buffer of `chunk_size` tokens (keys and values in `dtype`, a bool each) and its int64 write
        position per row, allocated once so that decode steps write into it in place. In a left-padded batch
        whose paddings are not all whole chunks (`OVQLayer.phases`) the open chunk is exactly
        `max_r (context_len - phase_r) % chunk_size` wide instead."""
        cfg: OVQConfig = self.method_config
        H, D = self.num_key_value_heads, self.head_dim
        elt = torch.tensor([], dtype=dtype).element_size()
        dictionary = batch * H * cfg.max_centroids * (2 * D + 1) * 4 + 2 * batch * 8
        open_chunk = batch * cfg.chunk_size * (H * 2 * D * elt + 1) + batch * 8
        return dictionary + open_chunk


_PHASES: list = [None]  # (weakref to the last key mask, its version, chunk, phases): one forward's layers share it


def row_phases(padding: torch.Tensor | None, chunk: int) -> tuple[int, ...] | None:
    """Each row's left padding modulo `chunk` (host ints: one host sync per forward with padding), or None when
    there is no padding or every row's padding is whole chunks (those rows are in phase: the plain path).

    Memoised on the mask object and its version counter, which the layers of one forward share. An inference
    tensor (torch.inference_mode) has no version counter: it is not memoised (one sync per layer, and only in
    the first forward of a cache, or in every forward without one)."""
    if padding is None:
        return None
    version = None if padding.is_inference() else padding._version
    memo = _PHASES[0]
    if version is not None and memo is not None and memo[0]() is padding and memo[1:3] == (version, chunk):
        return memo[3]
    ph = (left_padding(padding) % chunk).tolist()
    out = tuple(int(p) for p in ph) if any(ph) else None
    _PHASES[0] = (weakref.ref(padding), version, chunk, out) if version is not None else None
    return out


@register_method
class OVQ(Method):
    name = "ovq"
    description = ("online vector-quantised attention: chunked exact attention + key/value dictionaries "
                   "learned online; state O(max_centroids + chunk_size)")
    config_cls = OVQConfig
    module_cls = OVQAttention
    window_conflict = "attends to a dictionary of every earlier chunk"
