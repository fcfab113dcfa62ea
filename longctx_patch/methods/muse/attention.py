"""`muse`: multipole semantic attention (MuSe) for the prefill of Llama-family models.

The softmax kernel of each patched layer is replaced by MuSe (longctx_patch.kernels.muse) for prefill
without a past (q_len == k_len > block_size and >= min_seq_len); decode steps, continued prefill and
short sequences take exact softmax attention over a full KV cache, so `generate()` is exact after the
prompt; a prefill that fills a cache in eval mode recomputes its last `exact_tail` queries exactly. The
projections are the original ones: no new parameters. docs/muse.md explains every option.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from ...errors import ConfigError
from ...kernels.muse import BACKENDS, FAR_FIELDS, muse_attention
from ..base import Method, MethodConfig, PatchedAttention, option, register_method
from ..padding import PhaseGroup, left_padding
from ...kernels.softmax import key_mask_for, softmax_attention


# defaults of the options whose best value depends on the far field (measured: docs/PERFORMANCE.md, "The cells far
# field", the speed / error trade-off at 64k)
FAR_FIELD_DEFAULTS = {
    "cells": dict(block_size=256, k_clusters=8, topk_blocks=10, peak_blocks=10),
    "tilted": dict(block_size=128, k_clusters=4, topk_blocks=4, peak_blocks=0),
}
FAR_FIELD_DEFAULTS["tilted-cells"] = FAR_FIELD_DEFAULTS["cells"]  # its exact part and cells are the cells plan's
Q_CLUSTERS = {"cells": 1, "tilted": 16, "tilted-cells": 256}  # q_clusters' default (the cells have no query clusters)


@dataclass
class MuseConfig(MethodConfig):
    far_field: str = option("cells", "cells: each key cluster of an earlier block is one super-key shared by all "
                            "queries, linear in blocks (the fast path; q_clusters and topk_clusters unused); tilted: "
                            "one summary per (query cluster, cell) pair, quadratic in blocks (more accurate at 64k, "
                            "slower than exact attention); tilted-cells: the cells plan with each far cell summarised "
                            "per global query cluster, tilted at its centroid (more accurate than cells, slower)",
                            choices=list(FAR_FIELDS))
    block_size: int | None = option(None, "tokens per spatial block (exact causal attention inside a block); default "
                                    "256 (cells, tilted-cells) / 128 (tilted); Triton: a multiple of 128 (cells, "
                                    "tilted-cells), a power of two in 16..128 (tilted)", min=2)
    q_clusters: int | None = option(None, "query clusters per query head, the tilt centres of the summaries: per "
                                    "block (tilted, default 16) or over the whole sequence (tilted-cells, default "
                                    "256)", min=1)
    k_clusters: int | None = option(None, "key clusters (cells) per block and kv head, each one super-key; default "
                                    "8 (cells, tilted-cells) / 4 (tilted)", min=1)
    kmeans_iters: int = option(2, "Lloyd iterations of the clusterings (per block: farthest-point init; tilted-cells' "
                               "global query clusters: evenly spaced init)", min=0, max=50)
    topk_clusters: int = option(8, "tilted: earlier cells attended exactly per query cluster", min=0)
    topk_blocks: int | None = option(None, "earlier blocks attended exactly per query block (cells: those of most "
                                     "estimated attention mass) or per query cluster (tilted); default 10 (cells, "
                                     "tilted-cells) / 4 (tilted)", min=0)
    peak_blocks: int | None = option(None, "cells, tilted-cells: more earlier blocks attended exactly per query block, beyond "
                                     "topk_blocks: those whose best key scores highest at the block's mean query "
                                     "(max_j q.k_j), which finds a block whose one matching key a cell mean hides; "
                                     "default 10 (cells) / 0 (tilted has none)", min=0)
    local_blocks: int = option(1, "blocks just before a query's block that are always attended exactly", min=0)
    sink_blocks: int = option(1, "cells, tilted-cells: the first blocks with real tokens, attended exactly by every query block "
                              "(attention sinks: many heads put much of their weight on the first tokens)", min=0)
    dipole: bool = option(False, "tilted: first-order (dipole) correction of the super-keys' values; reference path "
                          "only")
    min_seq_len: int = option(1024, "prefills shorter than this use exact attention (a row of a padded batch: "
                              "its real tokens, as that prompt alone)", min=0)
    exact_tail: int = option(128, "prefills that fill a KV cache in eval mode (generate): the last this-many "
                             "queries attend exactly to every key, recomputed after MuSe (the question at the end of "
                             "a prompt, and the positions the first generated token reads); 0: off. Training, "
                             "perplexity without a cache and the op-level kernel are unaffected", min=0)
    backend: str = option("auto", "kernels: auto (Triton on CUDA when supported), triton, or torch (reference)",
                          choices=list(BACKENDS))

    def get(self, name: str) -> int:
        """The value of a far-field-dependent option: the one set, else FAR_FIELD_DEFAULTS[far_field]."""
        v = getattr(self, name)
        if v is None:
            return Q_CLUSTERS[self.far_field] if name == "q_clusters" else FAR_FIELD_DEFAULTS[self.far_field][name]
        return v

    def check(self) -> None:
        L = self.get("block_size")
        if self.get("k_clusters") > L or (self.far_field == "tilted" and self.get("q_clusters") > L):
            raise ConfigError(
                f"MuseConfig: q_clusters ({self.get('q_clusters')}, tilted) and k_clusters ({self.get('k_clusters')}) must "
                f"be <= block_size ({L})"
            )
        if self.far_field == "tilted" and self.get("peak_blocks"):
            raise ConfigError("MuseConfig: peak_blocks needs far_field='cells' (tilted retrieves per query cluster)")
        if self.far_field != "tilted" and self.dipole:
            raise ConfigError("MuseConfig: dipole=True needs far_field='tilted' (the cells have no dipole term)")

    def kernel_kwargs(self) -> dict:
        return dict(block_size=self.get("block_size"), q_clusters=self.get("q_clusters"),
                    k_clusters=self.get("k_clusters"),
                    kmeans_iters=self.kmeans_iters, topk_clusters=self.topk_clusters,
                    topk_blocks=self.get("topk_blocks"), peak_blocks=self.get("peak_blocks"),
                    local_blocks=self.local_blocks, sink_blocks=self.sink_blocks, dipole=self.dipole,
                    backend=self.backend, far_field=self.far_field)


def _past_len(cache_layer) -> int:
    if cache_layer is None or not getattr(cache_layer, "is_initialized", False):
        return 0
    keys = getattr(cache_layer, "keys", None)
    return 0 if keys is None else int(keys.shape[-2])


class MuseAttention(PatchedAttention):
    method_name = "muse"

    def uses_muse(self, q_len: int, past: int) -> bool:
        c = self.method_config
        return past == 0 and q_len > c.get("block_size") and q_len >= c.min_seq_len

    @classmethod
    def op(cls, q, k, v, *, scale, config):
        """Op-level entry point (`longctx eval speed --op`): MuSe over one full causal sequence, clustering
        included; q `[B, Hq, S, D]`, k/v `[B, Hkv, S, D]` -> `[B, S, Hq, D]`."""
        return muse_attention(q, k, v, scale=scale, **config.kernel_kwargs())

    def attend(self, q, k, v, cache_layer, padding):
        past = _past_len(cache_layer)
        S = q.shape[2]
        if cache_layer is not None:
            k, v = cache_layer.update(k, v)
        km = key_mask_for(padding, k.shape[2])
        if not self.uses_muse(S, past):  # no row of the batch is longer than the call: every row exact
            return softmax_attention(q, k, v, scale=self.scaling, key_mask=km)
        if km is None:
            o = self._muse(q, k, v, None)
        else:
            o = self._muse_padded(q, k, v, km, padding)
            if o is None:  # every row alone would be shorter than min_seq_len / block_size: exact
                return softmax_attention(q, k, v, scale=self.scaling, key_mask=km)
        t = min(self.method_config.exact_tail, S)
        if t and cache_layer is not None and not self.training:
            tail = softmax_attention(q[:, :, S - t:], k, v, scale=self.scaling, key_mask=km)
            if torch.is_grad_enabled():
                return torch.cat([o[:, :S - t], tail], 1)
            o[:, S - t:] = tail
        return o

    def _muse(self, q, k, v, km):
        return muse_attention(q, k, v, scale=self.scaling, key_mask=km, **self.method_config.kernel_kwargs())

    def _muse_padded(self, q, k, v, km, padding):
        """A prefill of a padded batch, each row as that prompt alone (docs/muse.md, "Padded batches"): rows whose
        real length takes MuSe, grouped by their left padding modulo block_size, run one MuSe call per group on the
        columns after the group's smallest padding (so every row of it is padded by whole blocks, which are neutral);
        the other rows take exact attention. None when no row takes MuSe."""
        c = self.method_config
        groups = _row_groups(self._ctx, padding, km, c.get("block_size"), c.min_seq_len)
        if groups is None:  # one group: the whole batch, no columns to drop, the key mask as it is
            return self._muse(q, k, v, km)
        if not groups[0]:
            return None
        B, Hq, S, D = q.shape
        parts = []
        for rows, trim, masked in groups[0]:
            g = PhaseGroup(rows, trim)
            parts.append((rows, trim, self._muse(g.take(q, 2), g.take(k, 2), g.take(v, 2),
                                                 g.take(km, 1) if masked else None)))
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


def _row_groups(ctx, padding, km, block: int, min_len: int):
    """The rows of a padded prefill as MuSe runs them (see MuseAttention._muse_padded), computed once per forward
    (every layer sees the same mask object: one host read, cached on the PatchContext). None when the whole batch is
    one group with no column to drop; else ([(rows or None, trim, masked)] of the MuSe groups, the rows of exact
    attention or None). A row's real length (its True entries) decides between MuSe (longer than `block` and at
    least `min_len`) and exact attention, as it would alone; `masked`: some row of the group keeps padding after the
    trim (else its MuSe call takes no key mask, as the prompts alone do)."""
    key = (block, min_len, tuple(km.shape), padding._version)  # _version: a mask changed in place is read again
    cached = getattr(ctx, "_muse_rows", None)
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
    if ctx is not None:
        ctx._muse_rows = (padding, key, res)
    return res


@register_method
class Muse(Method):
    name = "muse"
    description = ("multipole semantic attention for long prefills (clustered key summaries + exact retrieval of "
                   "blocks); exact decode")
    config_cls = MuseConfig
    module_cls = MuseAttention
    window_conflict = "approximates full causal attention (cluster summaries of every earlier block)"

    def after_patch(self, model, modules, config) -> None:
        dev = next((p.device for p in model.parameters()), None)
        if dev is not None and dev.type != "cuda" and config.backend != "torch":
            warnings.warn(
                "muse: the model is on the CPU, where MuSe runs its dense PyTorch reference, which is slower than "
                "exact attention (one SmolLM2 layer at 8k tokens: 6.4 s against 0.47 s on 2 cores). MuSe's speed "
                "comes from its Triton kernels on CUDA: move the model there (model.cuda(); CLI: --device cuda) for long "
                "prefills, or use the CPU for checks only. backend='torch' (CLI: --set backend=torch) silences this.", stacklevel=3)


__all__ = ["MuseConfig", "MuseAttention", "Muse"]
