"""`muse`'s module: MuSe for a prefill without a past, exact softmax attention over a full KV cache otherwise:
`exact`'s module and its preallocated cache (`KVBufferLayer`), so decode steps take exact's path (its split-key
kernel, its CUDA graphs)."""

from __future__ import annotations

import torch

from ...kernels.muse import muse_attention
from ...kernels.softmax import key_mask_for, softmax_attention
from ..cache_layer import LongctxLayer
from ..exact.attention import ExactAttention
from ..kv_layer import KVBufferLayer
from ..padding import PhaseGroup, left_padding
from .guard import guard
from .heads import with_exact_heads


def _past_len(cache_layer) -> int:
    if cache_layer is None or not getattr(cache_layer, "is_initialized", False):
        return 0
    if isinstance(cache_layer, LongctxLayer):
        return cache_layer.seen
    keys = getattr(cache_layer, "keys", None)
    return 0 if keys is None else int(keys.shape[-2])


class MuseAttention(ExactAttention):
    """MuSe for a prefill without a past (longer than a block and `min_seq_len`); everything else, decode steps
    included, is `ExactAttention.attend` over the same cache. MuSe refuses windowed layers (`Muse.window_conflict`),
    so no window reaches it."""

    method_name = "muse"

    def uses_muse(self, q_len: int, past: int, device=None) -> bool:
        c = self.method_config
        return past == 0 and q_len > c.get("block_size") and q_len >= self.min_len(device)

    def min_len(self, device=None) -> int:
        """The shortest prefill that takes MuSe on `device` (default: this module's): `min_seq_len` when set, else
        its default for the device and this layer's head dim (MuseConfig.min_len: the crossover on CUDA)."""
        return self.method_config.min_len(_device_type(self) if device is None else torch.device(device).type,
                                          self.head_dim)

    @classmethod
    def op(cls, q, k, v, *, scale, config):
        """Op-level entry point (`longctx eval speed --op`): what a prefill of one full causal sequence runs, MuSe
        (clustering included) from the config's min_len for this device and head dim, exact attention below it;
        q `[B, Hq, S, D]`, k/v `[B, Hkv, S, D]` -> `[B, S, Hq, D]`."""
        S = q.shape[2]
        if S <= config.get("block_size") or S < config.min_len(q.device.type, q.shape[-1]):
            return softmax_attention(q, k, v, scale=scale)
        o = muse_attention(q, k, v, scale=scale, options=config.kernel_options(), backend=config.backend)
        o = with_exact_heads(o, q, k, v, config.exact_heads, scale=scale)
        return guard(o, q, k, v, None, config=config, scale=scale, skip=config.exact_heads)

    def approximate(self, q, k, v, key_mask=None):
        """This layer's MuSe output for one call whatever its length (`exact_heads` exact, then the guard): what a
        prefill long enough runs. q `[B, Hq, S, D]`, k/v `[B, Hkv, S, D]`."""
        return self._muse(q, k, v, key_mask)

    def attend_call(self, q, k, v, cache_layer, call):
        """`attend` with the call's memo, where the row groups of a padded prefill are kept once for every layer."""
        if call is None:
            return self.attend(q, k, v, cache_layer, None)
        return self.attend(q, k, v, cache_layer, call.key_mask, memo=call.memo)

    def attend(self, q, k, v, cache_layer, padding, memo: dict | None = None):
        past = _past_len(cache_layer)
        S = q.shape[2]
        if not self.uses_muse(S, past):  # decode, continued prefill, short calls: exact, as `exact` runs them
            return super().attend(q, k, v, cache_layer, padding)
        if isinstance(cache_layer, KVBufferLayer):
            cache_layer.extend(k, v, padding)  # the prompt's keys for the decode steps (a fresh buffer: these are k, v)
        elif cache_layer is not None:
            k, v = cache_layer.update(k, v)
        km = key_mask_for(padding, k.shape[2])
        if km is None:
            o = self._muse(q, k, v, None)
        else:
            o = self._muse_padded(q, k, v, km, padding, memo)
            if o is None:  # every row alone would be shorter than min_seq_len / block_size: exact
                return softmax_attention(q, k, v, scale=self.scaling, key_mask=km)
        t = min(self.method_config.exact_tail, S)
        if t and cache_layer is not None and not self.training:
            tail = softmax_attention(q[:, :, S - t:], k, v, scale=self.scaling, key_mask=km)
            if torch.is_grad_enabled():
                return torch.cat([o[:, :S - t], tail], 1)
            o[:, S - t:] = tail
        return o

    def _muse(self, q, k, v, km, rows=None):
        """MuSe over one call (`rows`: its rows in the forward's batch, None: all), the `exact_heads` exact, then
        the guard (guard.py): the heads it measures over `guard_error` exact for this call."""
        c = self.method_config
        o = muse_attention(q, k, v, scale=self.scaling, options=c.kernel_options(), key_mask=km, backend=c.backend)
        heads, first = c.exact_heads, 0
        if self.head_shard is not None:  # tensor parallelism: this rank's share of the global heads
            first = self.head_shard.rank * self.num_heads
            heads = [h - first for h in heads if first <= h < first + self.num_heads]
        o = with_exact_heads(o, q, k, v, heads, scale=self.scaling, key_mask=km)
        return guard(o, q, k, v, km, config=c, scale=self.scaling, skip=heads, layer=self.layer_idx, rows=rows,
                     head_offset=first)

    def _muse_padded(self, q, k, v, km, padding, memo: dict | None = None):
        """A prefill of a padded batch, each row as that prompt alone (docs/muse.md, "Padded batches"): rows whose
        real length takes MuSe, grouped by their left padding modulo block_size, run one MuSe call per group on the
        columns after the group's smallest padding (so every row of it is padded by whole blocks, which are neutral);
        the other rows take exact attention. None when no row takes MuSe."""
        c = self.method_config
        groups = _row_groups(memo, padding, km, c.get("block_size"), self.min_len())
        if groups is None:  # one group: the whole batch, no columns to drop, the key mask as it is
            return self._muse(q, k, v, km)
        if not groups[0]:
            return None
        B, Hq, S, D = q.shape
        parts = []
        for rows, trim, masked in groups[0]:
            g = PhaseGroup(rows, trim)
            parts.append((rows, trim, self._muse(g.take(q, 2), g.take(k, 2), g.take(v, 2),
                                                 g.take(km, 1) if masked else None, rows=rows)))
        if groups[1] is not None:
            g = PhaseGroup(groups[1], 0)
            parts.append((groups[1], 0, softmax_attention(g.take(q, 2), g.take(k, 2), g.take(v, 2),
                                                          scale=self.scaling, key_mask=g.take(km, 1))))
        o = parts[0][2].new_zeros(B, S, Hq, D)
        for rows, trim, part in parts:
            if rows is None:
                o[:, trim:] = part.to(o.dtype)
            else:
                o[rows, trim:] = part.to(o.dtype)
        return o


def _device_type(mod) -> str:
    p = next(mod.parameters(), None)
    return "cpu" if p is None else p.device.type


def _row_groups(memo: dict | None, padding, km, block: int, min_len: int):
    """The rows of a padded prefill as MuSe runs them (see MuseAttention._muse_padded), computed once per forward
    (one host read, kept in the call's memo, `CallState.memo`, for the next layers). None when the whole batch is
    one group with no column to drop; else ([(rows or None, trim, masked)] of the MuSe groups, the rows of exact
    attention or None). A row's real length (its True entries) decides between MuSe (longer than `block` and at
    least `min_len`) and exact attention, as it would alone; `masked`: some row of the group keeps padding after the
    trim (else its MuSe call takes no key mask, as the prompts alone do)."""
    key = (block, min_len, tuple(km.shape), padding._version)  # _version: a mask changed in place is read again
    cached = memo.get("muse_rows") if memo is not None else None
    if cached is not None and cached[0] is padding and cached[1] == key:
        return cached[2]
    B, S = km.shape
    pad, real = torch.stack([left_padding(km), km.sum(1)]).tolist()
    takes_muse = [real[r] > block and real[r] >= min_len for r in range(B)]
    by_phase: dict[int, list[int]] = {}
    for r in range(B):
        if takes_muse[r]:
            by_phase.setdefault(pad[r] % block, []).append(r)
    groups = []
    for rows in by_phase.values():
        trim = min(pad[r] for r in rows)  # every padding of the group is trim + a multiple of block
        masked = any(pad[r] != trim or real[r] != S - pad[r] for r in rows)
        groups.append((None if len(rows) == B else torch.tensor(rows, device=km.device), trim, masked))
    exact = [r for r in range(B) if not takes_muse[r]]
    res = None if len(groups) == 1 and groups[0][0] is None and groups[0][1] == 0 else \
        (groups, torch.tensor(exact, device=km.device) if exact else None)
    if memo is not None:
        memo["muse_rows"] = (padding, key, res)
    return res


__all__ = ["MuseAttention", "with_exact_heads"]
