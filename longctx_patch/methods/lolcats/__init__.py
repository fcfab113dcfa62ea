"""`lolcats`: hedgehog linear attention + sliding-window softmax under one normaliser (LoLCATs).

Each patched layer keeps the original q/k/v/o projections and adds per-head feature maps
phi(x) = [softmax(x W), softmax(-x W)] for queries and keys (`feature_map_q.mlp.layer`,
`feature_map_k.mlp.layer`, `[heads, head_dim, feature_dim]`) and `window_factors` (`[1, heads, 1, 1]`,
g = sigmoid). Queries attend exactly (softmax, weight g) to the last `window` tokens and linearly to
everything older, with one shared normaliser. Released LoLCATs checkpoints load with `checkpoint=PATH`.
Decode state: window buffer + linear state (H, s) in fp32, bounded whatever the context length.
Maths, initialisation and cache layout: docs/lola.md.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from ..cache_layer import LongctxLayer
from ...errors import ConfigError
from ...kernels.lola.ops import LolaState, feature_map, hybrid_attention, lola_process, refuse_forced_triton_under_grad
from ...kernels.lola.training import lola_attention_sets, sparse_positions
from ..base import Method, MethodConfig, PatchedAttention, option, register_method
from ..padding import phase_groups
from .checkpoint import export_lolcats_checkpoint, load_lolcats_checkpoint

LOLCATS_INIT_WINDOW_FACTOR = -2.1972245773362196  # sigmoid = 0.1, the value of the released LoLCATs recipes
DEFAULT_INIT_WINDOW_FACTOR = 2.0  # sigmoid = 0.88: an untrained patch stays much closer to the original (docs/lola.md)
# lola under gradients: sparse sets first (no grad), then one differentiable pass; False: the chunk loop
TRAIN_WITH_SETS = True


@dataclass
class LolcatsConfig(MethodConfig):
    window: int = option(64, "tokens (the current one included) attended with exact softmax; older ones linearly",
                         min=1)
    feature_dim: int = option(64, "feature map width F per head (phi has 2F features)", min=1)
    checkpoint: Optional[str] = option("auto", "weights to load: auto (the packaged linearized weights when the model "
                                               "is one we ship them for, else fresh feature maps), none (fresh), a "
                                               "LoLCATs model.pt (comma-separate several, e.g. distill,ft-lora), our "
                                               "longctx_patch.safetensors, or a linearize run's trainable/ folder")
    lora_alpha: float = option(16.0, "LoRA alpha of a LoLCATs checkpoint's q/k/v/o adapters (merged as alpha/r * B A)",
                               min=0.0)
    feature_init: str = option("softmax-rf", "fresh feature maps: softmax-rf (random features of exp(q.k/sqrt(d))) "
                                             "or kaiming (the LoLCATs code's default)",
                               choices=("softmax-rf", "kaiming"))
    init_window_factor: float = option(DEFAULT_INIT_WINDOW_FACTOR, "initial window factor of fresh layers (g = sigmoid "
                                       "of it; LoLCATs' recipes start at -2.197, g = 0.1)")
    affine_factors: bool = option(False, "weight the linear term by 1 - g instead of 1 (LoLCATs affine_attention_factors)")
    linear_scale: float = option(1.0, "multiplies the linear term's weight (numerator and normaliser); below 1 the exact "
                                      "window and sparse pairs weigh more against the far past (docs/lola.md, "
                                      "'Weighing the linear term down'); 1 = as trained", min=0.0)
    chunk: int = option(64, "cache granularity: pairs leaving the window are folded every `chunk` tokens", min=1)
    feature_cache: bool = option(False, "keep phi(k) of the buffered keys older than the window in the cache (chunk "
                                        "rows of 2F per query head) instead of recomputing it every decode step; "
                                        "opt-in until its decode speed is measured on a GPU (docs/lola.md, "
                                        "'Feature cache')")
    seed: int = option(0, "seed of the fresh feature-map initialisation (layer i uses seed + i)", min=0)
    backend: str = option("auto", "kernels: auto (Triton on CUDA without grad), triton, or torch (reference)",
                          choices=("auto", "triton", "torch"))

    def check(self) -> None:
        if not math.isfinite(self.init_window_factor):
            raise ConfigError(f"{type(self).__name__}: init_window_factor must be finite, got {self.init_window_factor}")
        if not math.isfinite(self.linear_scale):
            raise ConfigError(f"{type(self).__name__}: linear_scale must be a finite number >= 0, got {self.linear_scale}")


class FeatureMapMLP(nn.Module):
    """Holds `layer` [heads, head_dim, feature_dim] (the LoLCATs `untied_head_einsum` parameter)."""

    def __init__(self, layer: torch.Tensor):
        super().__init__()
        self.layer = nn.Parameter(layer)


class HedgehogFeatureMap(nn.Module):
    """phi(x) = [softmax(x W), softmax(-x W)] per head; state-dict key `mlp.layer` as in LoLCATs."""

    def __init__(self, layer: torch.Tensor, eps: float = 1e-12):
        super().__init__()
        self.mlp = FeatureMapMLP(layer)
        self.eps = eps

    def forward(self, x: torch.Tensor, out_dtype=None, backend: str = "auto", out=None) -> torch.Tensor:
        return feature_map(x, self.mlp.layer, eps=self.eps, out_dtype=out_dtype, backend=backend, out=out)


def init_feature_weight(heads: int, head_dim: int, feature_dim: int, kind: str, generator: torch.Generator) -> torch.Tensor:
    """softmax-rf: columns are orthogonal Gaussian directions (norms of chi(head_dim) samples) times
    head_dim**-1/4, so that E[exp(q.w) exp(k.w)] = exp(q.k / sqrt(d)) (times per-token factors): phi(q).phi(k)
    starts as a positive random-feature estimate of the softmax kernel. kaiming: LoLCATs' init."""
    if kind == "kaiming":
        w = torch.empty(heads, head_dim, feature_dim)
        bound = math.sqrt(6.0 / (head_dim * feature_dim))  # kaiming_uniform_(a=0) on a 3-D tensor: fan_in = D * F
        return w.uniform_(-bound, bound, generator=generator)
    # the random draws in the order of a per-head loop (blocks of D directions, then the norms), and one batched
    # QR over all blocks: hundreds of tiny QR calls cost tens of seconds on a busy 2-core CPU
    blocks = -(-feature_dim // head_dim)
    gauss, norms = [], []
    for _ in range(heads):
        gauss += [torch.randn(head_dim, head_dim, generator=generator) for _ in range(blocks)]
        norms.append(torch.randn(head_dim, feature_dim, generator=generator).norm(dim=0))  # chi(D)
    qm, _ = torch.linalg.qr(torch.stack(gauss))  # [heads * blocks, D, D]
    dirs = qm.reshape(heads, blocks, head_dim, head_dim).transpose(1, 2).reshape(heads, head_dim, blocks * head_dim)
    # contiguous: the QR's column-major output would make every feature-map call copy the weight first
    return (dirs[:, :, :feature_dim] * torch.stack(norms)[:, None, :] * head_dim ** -0.25).contiguous()


def sparse_head_count(sparse_heads: str, Hq: int, Hkv: int) -> int:
    """Heads of the sparse cache: the kv heads (`sparse_heads=kv`) or the query heads (`query`)."""
    return Hq if sparse_heads == "query" else Hkv


class LolaLayer(LongctxLayer):
    """Cache layer of `lolcats` / `lola`: window buffer, sparse cache with scores, linear state.

    win_k / win_v [B, Hkv, window+chunk, D], win_mask [B, .] (left padding), sp_k / sp_v [B, Hs, lambda, D],
    sp_score [B, Hs, lambda] fp32 (-inf = empty) with Hs the kv heads (`sparse_heads=kv`) or the query heads,
    H [B, Hq, 2F, D] fp32, s [B, Hq, 2F] fp32, win_fk [B, Hq, chunk, 2F] (`feature_cache`, else None): phi(k) of
    the buffered keys older than the window (computed once per key; kernels/lola/ops.py). Nothing grows with the
    context.
    """

    state_names = ("win_k", "win_v", "win_mask", "sp_k", "sp_v", "sp_score", "H", "s", "win_fk")
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
        # a decode step appends at row nb of the window buffer, attends its first nb + 1 rows and, when the
        # position reaches a multiple of chunk, evicts (kernels/lola/ops.py `_process`); rows evicting on their own
        # grids (a left-padded batch: `phases`) decide on the host per row
        # the feature cache must be there, row for row with the buffer (else the step would allocate it)
        if self.H is None or self.phases is not None or self.win_k is None or self.win_k.shape[2] < self.window + self.chunk:
            return None
        if self.feature_cache and (self.win_fk is None or self.win_fk.shape[2] != self.win_k.shape[2] - self.window):
            return None
        return (self.nb, self.seen % self.chunk, self.win_mask is None)

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
            st = LolaState.empty(B, Hq, Hkv, D, F2, self.sparse_cache, like.dtype, like.device,
                                 capacity=self.window + self.chunk,
                                 sparse_heads=sparse_head_count(self.sparse_heads, Hq, Hkv),
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


class LolcatsAttention(PatchedAttention):
    method_name = "lolcats"

    def __init__(self, orig, spec, config: LolcatsConfig, adapter):
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

    # -- LoLA knobs (lolcats: no sparse cache) -------------------------------------------------------
    @property
    def sparse_cache(self) -> int:
        return 0

    @property
    def sparse_heads(self) -> str:
        return "kv"

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
        cfg: LolcatsConfig = self.method_config
        S = q.shape[2]
        fq = self.feature_map_q(q, out_dtype=q.dtype, backend=cfg.backend)
        g, lf = self.factors()
        new_mask = padding[:, padding.shape[1] - S:].bool() if padding is not None else None
        if cache_layer is None:
            return self._attend_fresh(q, k, v, fq, g, lf, new_mask)
        if not isinstance(cache_layer, LolaLayer):
            raise TypeError(f"layer {self.layer_idx} is patched with {self.method_name} but its cache layer is "
                            f"{type(cache_layer).__name__}; pass no cache (one is created) or a LongctxCache")
        kw = self._process_kw(q, new_mask)
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
                    lola_process(st, q.detach(), k.detach(), v.detach(), fq.detach(), g.detach(), lf.detach(), **kw)
            else:
                st = dataclasses.replace(st, inplace=False)
                out = lola_process(st, q, k, v, fq, g, lf, **kw)
            cache_layer.set_state(st)
            return out
        with torch.no_grad():  # decode and no-grad prefill: the cached state is updated in place
            st_out = lola_process(st, q, k, v, fq, g, lf, **kw)
        cache_layer.set_state(st)
        return st_out

    def _process_kw(self, q, new_mask) -> dict:
        """`lola_process`'s options; phi_k: the key feature map, called at append (the feature cache of an in-place
        state, written into it: `out`) or where the manager needs phi(k) of keys it does not cache."""
        cfg: LolcatsConfig = self.method_config

        def phi_k(x, out=None):
            return self.feature_map_k(x, out_dtype=q.dtype, backend=cfg.backend, out=out)

        phi_k.writes_out = True

        return dict(window=cfg.window, scale=self.scaling, backend=cfg.backend, phi_k=phi_k, chunk=cfg.chunk,
                    lam=self.sparse_cache, key_mask_new=new_mask)

    def _attend_fresh(self, q, k, v, fq, g, lf, new_mask):
        """A sequence from its start, no cache kept: lolcats' parallel hybrid; lola's training path under
        gradients, else its chunk loop from an empty state."""
        cfg: LolcatsConfig = self.method_config
        lam = self.sparse_cache
        if lam == 0:
            fk = self.feature_map_k(k, out_dtype=q.dtype, backend=cfg.backend)
            return hybrid_attention(q, k, v, fq, fk, g, lf, key_mask=new_mask, chunk=cfg.chunk, window=cfg.window,
                                    scale=self.scaling, backend=cfg.backend)
        kw = self._process_kw(q, new_mask)
        Hq, Hkv = q.shape[1], k.shape[1]
        hs = sparse_head_count(self.sparse_heads, Hq, Hkv)
        if TRAIN_WITH_SETS and self._needs_grad(q, k, v, fq, g, lf):
            # training: the sparse sets chosen without gradients, then one differentiable pass (the chunk
            # loop's value without its per-chunk autograd graph; kernels/lola/training.py)
            # a left-padded batch: one pass per phase group (rows whose padding has one remainder modulo the
            # chunk) on its rows with the common padding dropped, so each row has the sets of its prompt alone
            groups = phase_groups(new_mask, cfg.chunk)
            if len(groups) == 1 and groups[0].trim == 0:
                return self._train_sets(q, k, v, fq, g, lf, new_mask, kw["phi_k"], hs)
            B, S = q.shape[0], q.shape[2]
            o = q.new_zeros(B, S, q.shape[1], q.shape[3])
            for gp in groups:
                og = self._train_sets(gp.take(q, 2), gp.take(k, 2), gp.take(v, 2), gp.take(fq, 2), g, lf,
                                      gp.take(new_mask, 1), kw["phi_k"], hs)
                og = torch.nn.functional.pad(og, (0, 0, 0, 0, gp.trim, 0))
                if gp.rows is None:
                    return og
                o = o.index_copy(0, gp.rows.to(q.device), og)
            return o
        st = LolaState.empty(q.shape[0], Hq, Hkv, q.shape[3], fq.shape[-1], lam, q.dtype, q.device,
                             capacity=cfg.window + cfg.chunk, inplace=not torch.is_grad_enabled(), sparse_heads=hs,
                             feature_cache=cfg.feature_cache)
        return lola_process(st, q, k, v, fq, g, lf, **kw)

    def _train_sets(self, q, k, v, fq, g, lf, new_mask, phi_k, hs):
        """The training path on one phase group: sparse sets without gradients, then one differentiable pass
        (PyTorch: backend='triton' is refused here)."""
        cfg: LolcatsConfig = self.method_config
        refuse_forced_triton_under_grad(cfg.backend, q, k, v, fq, g, lf)
        fk = phi_k(k)
        sets = sparse_positions(fk.detach(), v.detach(), new_mask, window=cfg.window, chunk=cfg.chunk,
                                lam=self.sparse_cache, sparse_heads=hs)
        return lola_attention_sets(q, k, v, fq, fk, g, lf, sets, window=cfg.window, chunk=cfg.chunk,
                                   scale=self.scaling, key_mask=new_mask)

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
        and the linear state, whatever the length. The buffer's padding mask
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
        return window + features + sparse + state


_WARNED_CACHE_IN_TRAINING: set = set()


def _warn_cache_in_training(method: str) -> None:
    if method not in _WARNED_CACHE_IN_TRAINING:
        _WARNED_CACHE_IN_TRAINING.add(method)
        warnings.warn(f"{method}: a forward with gradients and use_cache=True computes the attention twice (once "
                      "to differentiate, once to fill the cache); pass use_cache=False when training, and run inference "
                      "under torch.no_grad()", stacklevel=3)


def load_method_weights(model, modules, config: LolcatsConfig) -> str:
    """`after_patch` of lolcats/lola: loads `config.checkpoint` (resolving `auto`) into `modules` and records
    where the weights came from on each module (`weights_source`, shown by `longctx patch`). Returns it."""
    ck = config.checkpoint
    if ck is not None and str(ck).strip().lower() == "auto":
        from ...assets import find_asset

        asset = find_asset(model, config)
        if asset is None:
            source = "fresh feature maps (untrained: train them with recipes/linearize.yaml or pass checkpoint=PATH)"
        else:
            load_lolcats_checkpoint(model, str(asset.path), modules=modules, skip_unpatched_layers=True)
            source = f"packaged asset {asset.name} ({asset.path})"
    elif ck:
        load_lolcats_checkpoint(model, ck, modules=modules, lora_alpha=config.lora_alpha)
        source = f"checkpoint {ck}"
    else:
        source = "fresh feature maps (checkpoint=none)"
    for m in modules.values():
        m.weights_source = source
    return source


@register_method
class Lolcats(Method):
    name = "lolcats"
    description = ("LoLCATs: hedgehog linear attention + sliding-window softmax, one normaliser; trainable feature "
                   "maps; loads released LoLCATs checkpoints (checkpoint=PATH)")
    config_cls = LolcatsConfig
    module_cls = LolcatsAttention
    window_conflict = "attends linearly to every token older than its own window"

    def after_patch(self, model, modules, config) -> None:
        load_method_weights(model, modules, config)


__all__ = [
    "HedgehogFeatureMap",
    "LolaLayer",
    "LolcatsAttention",
    "LolcatsConfig",
    "export_lolcats_checkpoint",
    "init_feature_weight",
    "load_lolcats_checkpoint",
    "load_method_weights",
]
