"""`ovq`'s module: chunked exact attention plus key/value dictionaries learned in the forward pass."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ...kernels.ovq import ovq_attention, ovq_attention_phased
from ..base import PatchedAttention
from ..padding import left_padding
from .cache import OVQLayer
from .config import OVQConfig


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

    def attend_call(self, q, k, v, cache_layer, call):
        """`attend` with the call's memo, where each row's chunk phase is kept once for every layer."""
        if call is None:
            return self.attend(q, k, v, cache_layer, None)
        return self.attend(q, k, v, cache_layer, call.key_mask, memo=call.memo)

    def attend(self, q, k, v, cache_layer, padding, memo: dict | None = None):
        cfg: OVQConfig = self.method_config
        S = q.shape[2]
        qs, ks = self._scaled(q, k)
        valid = padding[:, padding.shape[1] - S:].bool() if padding is not None else None
        kw = dict(chunk_size=cfg.chunk_size, max_centroids=cfg.max_centroids, growth=cfg.growth,
                  backend=cfg.backend, exact_assign=cfg.exact_assign,
                  parallel={"auto": None, "parallel": True, "loop": False}[cfg.train_path])
        if cache_layer is None:
            phases = row_phases(padding, cfg.chunk_size, memo)
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
            cache_layer.phases = row_phases(padding, cfg.chunk_size, memo)
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


def row_phases(padding: torch.Tensor | None, chunk: int, memo: dict | None = None) -> tuple[int, ...] | None:
    """Each row's left padding modulo `chunk` (host ints: one host sync per forward with padding), or None when
    there is no padding or every row's padding is whole chunks (those rows are in phase: the plain path).

    Kept in `memo` (the forward call's `CallState.memo`, which the layers of one call share, each reading the same
    mask object): one host read per call, however many layers."""
    if padding is None:
        return None
    key = ("ovq_phases", chunk)
    cached = memo.get(key) if memo is not None else None
    if cached is not None and cached[0] is padding:
        return cached[1]
    ph = (left_padding(padding) % chunk).tolist()
    out = tuple(int(p) for p in ph) if any(ph) else None
    if memo is not None:
        memo[key] = (padding, out)
    return out


__all__ = ["OVQAttention", "row_phases"]
