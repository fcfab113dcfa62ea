"""The attention module of `lolcats` and `lola`: hedgehog linear attention + sliding-window softmax under one
normaliser (LoLCATs), plus, for `lola`, a sparse cache of exact key/value pairs chosen by self-recall error (LoLA).

Each patched layer keeps the original q/k/v/o projections and adds per-head feature maps (`feature_map_q.mlp.layer`,
`feature_map_k.mlp.layer`, `[heads, head_dim, feature_dim]`) and `window_factors` (`[1, heads, 1, 1]`, g = sigmoid).
Queries attend exactly (softmax, weight g) to the last `window` tokens, exactly to the sparse cache's pairs and
linearly to everything else, with one shared normaliser. Decode state: `LolaLayer` (cache.py), bounded whatever the
context length. Maths, initialisation and cache layout: docs/lola.md.
"""

from __future__ import annotations

import dataclasses
import warnings

import torch
from torch import nn

from ...kernels.lola.ops import hybrid_attention, refuse_forced_triton_under_grad
from ...kernels.lola.reference import HybridSpec
from ...kernels.lola.sparse_cache import lola_process
from ...kernels.lola.state import KeyFeatures, LolaRun, LolaState, StateSizes
from ...kernels.lola.training import PrefillSets, SetsSpec, lola_attention_sets, sparse_positions
from ...kernels.lola.tuning import DEFAULT_TUNING, LolaTuning
from ..base import PatchedAttention
from ..padding import phase_groups
from .cache import LolaLayer, sparse_head_count
from .config import HybridConfig
from .feature_map import HedgehogFeatureMap, init_feature_weight

class HybridAttention(PatchedAttention):
    """The LoLCATs hybrid with LoLA's sparse cache of `sparse_cache` exact pairs (none for `lolcats`).

    Two settings of how it runs, never of what it computes, set on a module (a benchmark's or a test's choice;
    `copy.deepcopy` and pickles carry them): `tuning`, the LoLA kernels' launch settings and prefill paths
    (kernels/lola/tuning.LolaTuning), and `train_with_sets`: lola under gradients chooses the sparse sets first (no
    gradient) and then runs one differentiable pass (True), or runs the chunk loop (False, the same values).
    """

    tuning: LolaTuning = DEFAULT_TUNING
    train_with_sets: bool = True

    def __init__(self, orig, spec, config: HybridConfig, adapter):
        super().__init__(orig, spec, config, adapter)
        p = next(orig.parameters(), None)
        dev = p.device if p is not None else None
        dt = torch.float32  # a method's parameters are float32 whatever the model's dtype (PatchedAttention._apply)
        gen = torch.Generator().manual_seed(config.seed + spec.layer_idx)
        H, D, F = spec.num_heads, spec.head_dim, config.feature_dim
        wq = init_feature_weight(H, D, F, config.feature_init, gen)
        wk = init_feature_weight(H, D, F, config.feature_init, gen)
        self.feature_map_q = HedgehogFeatureMap(wq.to(device=dev, dtype=dt))
        self.feature_map_k = HedgehogFeatureMap(wk.to(device=dev, dtype=dt))
        self.window_factors = nn.Parameter(
            torch.full((1, H, 1, 1), float(config.init_window_factor), device=dev, dtype=dt))

    # -- LoLA's knobs (lolcats has none: no sparse cache) ------------------------------------------------
    @property
    def sparse_cache(self) -> int:
        return getattr(self.method_config, "sparse_cache", 0)

    @property
    def sparse_heads(self) -> str:
        return getattr(self.method_config, "sparse_heads", "kv")

    def factors(self):
        """(g, lf) per query head: the window's and the linear part's weights. Without gradients they are kept
        until the parameter changes (its storage or version): a decode step launches nothing for them."""
        wf, cfg = self.window_factors, self.method_config
        grad = torch.is_grad_enabled() and wf.requires_grad
        key = (wf.data_ptr(), wf._version, wf.device, cfg.affine_factors, cfg.linear_scale)
        memo = self.__dict__.get("_factors_memo")
        if not grad and memo is not None and memo[0] == key:
            return memo[1]
        g = torch.sigmoid(wf.float()).view(-1)
        lf = 1 - g if cfg.affine_factors else torch.ones_like(g)
        if cfg.linear_scale != 1.0:
            lf = lf * cfg.linear_scale
        # not kept from inside a CUDA-graph capture: its memory belongs to the graph's pool
        if not grad and not (wf.is_cuda and torch.cuda.is_current_stream_capturing()):
            self.__dict__["_factors_memo"] = (key, (g, lf))
        return g, lf

    def attend(self, q, k, v, cache_layer, padding):
        cfg: HybridConfig = self.method_config
        S = q.shape[2]
        fq = self.feature_map_q(q, out_dtype=q.dtype, backend=cfg.backend, tuning=self.tuning)
        g, lf = self.factors()
        new_mask = padding[:, padding.shape[1] - S:].bool() if padding is not None else None
        if cache_layer is None:
            return self._attend_fresh(q, k, v, fq, g, lf, new_mask)
        if not isinstance(cache_layer, LolaLayer):
            raise TypeError(f"layer {self.layer_idx} is patched with {self.method_name} but its cache layer is "
                            f"{type(cache_layer).__name__}; pass no cache (one is created) or a LongctxCache")
        run = self._run(q)
        st = cache_layer.get_state(q.shape[0], q.shape[1], k.shape[1], q.shape[3], fq.shape[-1], q)
        if self._needs_grad(q, k, v, fq, g, lf):
            # gradients with a cache (a forward outside Trainer leaves `use_cache` on by default): the output must
            # stay in the graph. From an empty cache it comes from the training path, as without a cache, and
            # the cache is then filled without gradients; continuing a cached sequence, the chunk loop runs
            # out of place on the cached state (gradients reach the new tokens, the cached state is a constant)
            if st.pos == 0:
                _warn_cache_in_training(self.method_name)
                out = self._attend_fresh(q, k, v, fq, g, lf, new_mask)
                with torch.no_grad():
                    lola_process(st, q.detach(), k.detach(), v.detach(), fq.detach(), g.detach(), lf.detach(), run,
                                 key_mask_new=new_mask)
            else:
                st = dataclasses.replace(st, inplace=False)
                out = lola_process(st, q, k, v, fq, g, lf, run, key_mask_new=new_mask)
            cache_layer.set_state(st)
            return out
        with torch.no_grad():  # decode and no-grad prefill: the cached state is updated in place
            st_out = lola_process(st, q, k, v, fq, g, lf, run, key_mask_new=new_mask)
        cache_layer.set_state(st)
        return st_out

    def _run(self, q) -> LolaRun:
        """`lola_process`'s settings (`LolaRun`); phi_k: the key feature map, called at append (the feature cache of
        an in-place state, written into it: `KeyFeatures.write`) or where the manager needs phi(k) of keys it does not
        cache."""
        cfg: HybridConfig = self.method_config
        fmap, tuning = self.feature_map_k, self.tuning
        phi_k = KeyFeatures(
            compute=lambda x: fmap(x, out_dtype=q.dtype, backend=cfg.backend, tuning=tuning),
            write=lambda x, out: fmap(x, out_dtype=q.dtype, backend=cfg.backend, out=out, tuning=tuning))
        return LolaRun(phi_k=phi_k, window=cfg.window, chunk=cfg.chunk, lam=self.sparse_cache, scale=self.scaling,
                       backend=cfg.backend, combine=cfg.combine, tuning=tuning)

    def _attend_fresh(self, q, k, v, fq, g, lf, new_mask):
        """A sequence from its start, no cache kept: lolcats' parallel hybrid; lola's training path under
        gradients, else its chunk loop from an empty state."""
        cfg: HybridConfig = self.method_config
        lam = self.sparse_cache
        if lam == 0:
            fk = self.feature_map_k(k, out_dtype=q.dtype, backend=cfg.backend, tuning=self.tuning)
            spec = HybridSpec(window=cfg.window, scale=self.scaling, combine=cfg.combine, chunk=cfg.chunk,
                              backend=cfg.backend, tuning=self.tuning)
            return hybrid_attention(q, k, v, fq, fk, g, lf, spec, key_mask=new_mask)
        run = self._run(q)
        Hq, Hkv = q.shape[1], k.shape[1]
        hs = sparse_head_count(self.sparse_heads, Hq, Hkv)
        if self.train_with_sets and self._needs_grad(q, k, v, fq, g, lf):
            # training: the sparse sets chosen without gradients, then one differentiable pass (the chunk
            # loop's value without its per-chunk autograd graph; kernels/lola/training.py)
            # a left-padded batch: one pass per phase group (rows whose padding has one remainder modulo the
            # chunk) on its rows with the common padding dropped, so each row has the sets of its prompt alone
            groups = phase_groups(new_mask, cfg.chunk)
            if len(groups) == 1 and groups[0].trim == 0:
                return self._train_sets(q, k, v, fq, g, lf, new_mask, run.phi_k, hs)
            B, S = q.shape[0], q.shape[2]
            o = q.new_zeros(B, S, q.shape[1], q.shape[3])
            for gp in groups:
                og = self._train_sets(gp.take(q, 2), gp.take(k, 2), gp.take(v, 2), gp.take(fq, 2), g, lf,
                                      gp.take(new_mask, 1), run.phi_k, hs)
                og = torch.nn.functional.pad(og, (0, 0, 0, 0, gp.trim, 0))
                if gp.rows is None:
                    return og
                o = o.index_copy(0, gp.rows.to(q.device), og)
            return o
        sizes = StateSizes(q.shape[0], Hq, Hkv, q.shape[3], fq.shape[-1], lam, sparse_heads=hs)
        st = LolaState.empty(sizes, q.dtype, q.device, capacity=cfg.window + cfg.chunk,
                             inplace=not torch.is_grad_enabled(), feature_cache=cfg.feature_cache)
        return lola_process(st, q, k, v, fq, g, lf, run, key_mask_new=new_mask)

    def _train_sets(self, q, k, v, fq, g, lf, new_mask, phi_k, hs):
        """The training path on one phase group: sparse sets without gradients, then one differentiable pass
        (PyTorch: backend='triton' is refused here)."""
        cfg: HybridConfig = self.method_config
        refuse_forced_triton_under_grad(cfg.backend, q, k, v, fq, g, lf)
        fk = phi_k(k)
        sets = sparse_positions(fk.detach(), v.detach(), new_mask, window=cfg.window, chunk=cfg.chunk,
                                lam=self.sparse_cache, sparse_heads=hs,
                                kernels=False if cfg.backend == "torch" else None)  # the evictions' kernels
        spec = SetsSpec(window=cfg.window, chunk=cfg.chunk, scale=self.scaling, combine=cfg.combine)
        return lola_attention_sets(q, k, v, fq, fk, g, lf, PrefillSets(sets, new_mask), spec)

    def _needs_grad(self, *tensors) -> bool:
        if not torch.is_grad_enabled():
            return False
        return (any(t.requires_grad for t in tensors)
                or any(p.requires_grad for p in self.feature_map_k.parameters()))

    def make_cache_layer(self):
        cfg = self.method_config
        return LolaLayer(cfg.window, cfg.chunk, self.sparse_cache, self.sparse_heads, cfg.feature_cache)

    def state_bytes(self, context_len: int, batch: int = 1, dtype: torch.dtype = torch.bfloat16) -> int:
        """Bytes of `LolaLayer` after a prefill of `context_len` tokens (no padding): the window buffer's keys,
        values, the feature cache (`feature_cache`: phi(k) of `chunk` keys, 2F per query head), the sparse cache
        and the linear state, whatever the length, and the buffered count on the device (nb_t). The buffer's padding mask
        (`batch * (window + chunk)` bools) is created only once a batch has left padding and is not counted."""
        cfg = self.method_config
        elt = torch.tensor([], dtype=dtype).element_size()
        Hq, Hkv, D, F2 = self.num_heads, self.num_key_value_heads, self.head_dim, 2 * cfg.feature_dim
        buf = cfg.window + cfg.chunk  # fixed-size window buffer (keys, values)
        window = batch * buf * 2 * Hkv * D * elt
        features = batch * cfg.chunk * Hq * F2 * elt if cfg.feature_cache else 0  # win_fk
        lam = self.sparse_cache
        sparse = batch * sparse_head_count(self.sparse_heads, Hq, Hkv) * lam * (2 * D * elt + 4)
        state = batch * Hq * F2 * (D + 1) * 4
        count = batch * 8  # nb_t: the buffered count on the device (int64 per row)
        return window + features + sparse + state + count


class LolaAttention(HybridAttention):
    method_name = "lola"


_WARNED_CACHE_IN_TRAINING: set = set()


def _warn_cache_in_training(method: str) -> None:
    if method not in _WARNED_CACHE_IN_TRAINING:
        _WARNED_CACHE_IN_TRAINING.add(method)
        warnings.warn(f"{method}: a forward with gradients and use_cache=True computes the attention twice (once "
                      "to differentiate, once to fill the cache); pass use_cache=False when training, and run inference "
                      "under torch.no_grad()", stacklevel=3)
