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
from ...kernels.ovq import OpenChunk, OVQState, ovq_attention, ovq_attention_phased
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
    n_active / absorbed ``[B]``,
    open_keys / open_values ``[B, Hkv, <chunk, D]`` and open_valid ``[B, <chunk]``.

    ``phases``: None, or (a left-padded batch whose paddings are not all whole chunks) each row's left padding
    modulo the chunk, host ints fixed by the first forward: row r's chunks start at ``phases[r] + j * C``, so it
    computes what it computes alone (``kernels.ovq.ovq_attention_phased``). The open chunk then holds each row's
    own open tokens right-aligned, as wide as the longest (columns left of a row's part are masked).
    """

    state_names = ("key_sums", "value_sums", "counts", "n_active", "absorbed", "open_keys", "open_values", "open_valid")

    def __init__(self, chunk_size: int, max_centroids: int):
        super().__init__()
        self.chunk_size = chunk_size
        self.max_centroids = max_centroids
        self.phases: tuple[int, ...] | None = None

    def reset(self) -> None:
        super().reset()
        self.phases = None

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

    def get_state(self) -> tuple[OVQState | None, OpenChunk | None, int]:
        if self.key_sums is None:
            return None, None, 0
        st = OVQState(self.key_sums, self.value_sums, self.counts, self.n_active, self.absorbed)
        op = OpenChunk(self.open_keys, self.open_values, self.open_valid) if self.open_keys is not None else None
        open_len = 0 if op is None else op.length
        return st, op, self.seen - open_len

    def set_state(self, state: OVQState, open_chunk: OpenChunk | None, new_tokens: int, like: torch.Tensor) -> None:
        if not self.is_initialized:
            self.lazy_initialization(like)
        st = state.detach()
        self.key_sums, self.value_sums, self.counts = st.key_sums, st.value_sums, st.counts
        self.n_active, self.absorbed = st.n_active, st.seen
        if open_chunk is None:
            B, H, _, D = like.shape
            self.open_keys = like.new_zeros(B, H, 0, D)
            self.open_values = like.new_zeros(B, H, 0, st.value_sums.shape[-1])
            self.open_valid = torch.zeros(B, 0, dtype=torch.bool, device=like.device)
        else:
            self.open_keys, self.open_values, self.open_valid = open_chunk.keys, open_chunk.values, open_chunk.valid
        self.seen += new_tokens


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
        state, op, absorbed = cache_layer.get_state()
        o, state, op, _ = ovq_attention(qs, ks, v, state, op, valid, seen_bound=absorbed if state is not None else None, **kw)
        cache_layer.set_state(state, op, S, ks)
        return o.transpose(1, 2)

    def make_cache_layer(self):
        return OVQLayer(self.method_config.chunk_size, self.method_config.max_centroids)

    def state_bytes(self, context_len: int, batch: int = 1, dtype: torch.dtype = torch.bfloat16) -> int:
        """Bytes of `OVQLayer` after `context_len` tokens: the dictionary, allocated at `max_centroids` rows from
        the first token (float32 key/value sums and counts, int64 `n_active`/`absorbed`), plus the open chunk,
        the `context_len % chunk_size` tokens not yet absorbed (keys and values in `dtype`, a bool each). In a
        left-padded batch whose paddings are not all whole chunks (`OVQLayer.phases`) the open chunk is
        `max_r (context_len - phase_r) % chunk_size` wide instead (still below `chunk_size`)."""
        cfg: OVQConfig = self.method_config
        H, D = self.num_key_value_heads, self.head_dim
        elt = torch.tensor([], dtype=dtype).element_size()
        dictionary = batch * H * cfg.max_centroids * (2 * D + 1) * 4 + 2 * batch * 8
        open_chunk = batch * (context_len % cfg.chunk_size) * (H * 2 * D * elt + 1)
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
