"""Per-architecture adapters: where the decoder layers and their attention live, and how q/k/v are formed.

Adding a family means adding one `ArchAdapter` to `ADAPTERS`. An adapter only describes the model; the
method modules call `adapter.project(attn, hidden_states, position_embeddings)` to get post-rotary q/k/v.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from .errors import UnsupportedModelError
from .kernels.model_ops import rotary, rotary_missing


@dataclass(frozen=True)
class AttentionSpec:
    """Shapes of one attention layer, read off the model config."""

    layer_idx: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    scaling: float
    model_type: str
    # the layer's own sliding window in the original model: each query attends to its last `sliding_window` keys,
    # its own included (transformers' `kv_idx > q_idx - sliding_window`); None = full causal attention
    sliding_window: int | None = None

    @property
    def num_kv_groups(self) -> int:
        return self.num_heads // self.num_kv_heads


_ROTARY: dict[str, Callable] = {}  # modeling module -> its apply_rotary_pos_emb, filled when a layer is patched


_STANDARD_ROTARY: dict[str, bool] = {}  # modeling module -> its apply_rotary_pos_emb is the module's own


def _standard_rotary(modeling_module: str) -> bool:
    """Whether the module's `apply_rotary_pos_emb` is the one it defines (rotate-half, `(q, k, cos, sin, ...)`), not
    a replacement someone installed (e.g. another library's kernel): only then may a fused kernel stand in for it."""
    ok = _STANDARD_ROTARY.get(modeling_module)
    if ok is None:
        import inspect

        fn = _rotary_fn(modeling_module)
        try:
            params = list(inspect.signature(fn).parameters)[:4]
        except (TypeError, ValueError):
            params = []
        mod = importlib.import_module(modeling_module)
        ok = (getattr(fn, "__module__", None) == modeling_module
              and getattr(fn, "__qualname__", None) == "apply_rotary_pos_emb"
              and params == ["q", "k", "cos", "sin"] and callable(getattr(mod, "rotate_half", None)))
        _STANDARD_ROTARY[modeling_module] = ok
    return ok


def _rotary_fn(modeling_module: str) -> Callable:
    # a plain dict read once filled (at patch time): an import inside the attention call costs every call and
    # breaks torch.compile's graph there
    fn = _ROTARY.get(modeling_module)
    if fn is None:
        fn = _ROTARY[modeling_module] = _unwrap_hub_function(
            importlib.import_module(modeling_module).apply_rotary_pos_emb)
    return fn


def _unwrap_hub_function(fn: Callable) -> Callable:
    """The plain function inside a `kernels` hub wrapper, else `fn`.

    From transformers 5.2x (with the `kernels` package) a modeling module's `apply_rotary_pos_emb` is an
    `nn.Module` instance made by `@use_kernel_forward_from_hub("rotary_pos_emb")`, whose forward calls the wrapped
    function unless the model was `kernelize`d. The patched attention calls the plain function (no module call per
    layer and step); a wrapper that does not hold one named `func` stays as it is, and `_standard_rotary` then says
    no, so the fused rotary is not used in its place."""
    if not isinstance(fn, nn.Module):
        return fn
    forward = getattr(type(fn), "forward", None)
    code, cells = getattr(forward, "__code__", None), getattr(forward, "__closure__", None)
    if code is None or not cells:
        return fn
    for name, cell in zip(code.co_freevars, cells):
        if name == "func" and callable(cell.cell_contents) and not isinstance(cell.cell_contents, nn.Module):
            return cell.cell_contents
    return fn


@dataclass(frozen=True)
class ArchAdapter:
    model_type: str
    modeling_module: str  # e.g. "transformers.models.llama.modeling_llama"
    has_qk_norm: bool = False
    # where the family's modeling code reads a layer's sliding window (see layer_window): "none" (llama),
    # "all_layers" (mistral: `config.sliding_window` on every layer), "layer_types" (qwen2, qwen3)
    windows: str = "none"

    def rotary_fn(self) -> Callable:
        return _rotary_fn(self.modeling_module)

    def standard_rotary(self) -> bool:
        """Whether `rotary_fn()` is the modeling module's own (see `_standard_rotary`); read at patch time."""
        return _standard_rotary(self.modeling_module)

    def decoder_layers(self, model: nn.Module) -> nn.ModuleList:
        base = base_model(model)
        layers = getattr(base, "layers", None)
        if layers is None:
            raise UnsupportedModelError(f"could not find decoder layers on {type(model).__name__}")
        return layers

    def spec(self, config, layer_idx: int) -> AttentionSpec:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return AttentionSpec(
            layer_idx=layer_idx,
            num_heads=config.num_attention_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            head_dim=head_dim,
            hidden_size=config.hidden_size,
            scaling=head_dim**-0.5,
            model_type=config.model_type,
            sliding_window=self.layer_window(config, layer_idx),
        )

    def layer_window(self, config, layer_idx: int) -> int | None:
        """Layer `layer_idx`'s sliding window as the family's transformers modeling code applies it, or None.

        mistral: `config.sliding_window` on every layer (a `layer_types` in the config is not read by
        MistralModel). qwen2 / qwen3: `config.sliding_window` on the layers whose `config.layer_types[i]` is
        "sliding_attention"; the config sets `sliding_window = None` unless `use_sliding_window`, and derives
        `layer_types` from `max_window_layers` (layers >= it are windowed) when none is given. That rule is
        repeated here for a config object without `layer_types`.
        """
        if self.windows == "none":
            return None
        window = getattr(config, "sliding_window", None)
        if window is None:
            return None
        if self.windows == "layer_types":
            types_ = getattr(config, "layer_types", None)
            if types_ is not None:
                windowed = types_[layer_idx] == "sliding_attention"
            else:
                windowed = (getattr(config, "use_sliding_window", False)
                            and layer_idx >= getattr(config, "max_window_layers", 0))
            if not windowed:
                return None
        return int(window)

    def project(self, attn: nn.Module, hidden_states: torch.Tensor, position_embeddings, head_dim: int,
                fused: str | None = None):
        """q [B, Hq, S, D], k/v [B, Hkv, S, D] after the optional q/k norm and rotary, as the original does.

        fused: the patch's fused-ops mode (fused_ops.py; None = off): "auto" / "triton" apply the rotary embedding
        of q and k in one kernel (`kernels/model_ops/`, the same values) where `rotary_missing` allows it and the
        family's rotary function is the standard one."""
        shape = (*hidden_states.shape[:-1], -1, head_dim)
        q = attn.q_proj(hidden_states).view(shape)
        k = attn.k_proj(hidden_states).view(shape)
        v = attn.v_proj(hidden_states).view(shape)
        if self.has_qk_norm:
            q = attn.q_norm(q)
            k = attn.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if position_embeddings is not None:
            cos, sin = position_embeddings
            if (fused is not None and _STANDARD_ROTARY.get(self.modeling_module)
                    and rotary_missing(q, k, cos, sin, fused) is None):
                q, k = rotary(q, k, cos, sin)
            else:
                q, k = self.rotary_fn()(q, k, cos, sin)
        return q, k, v


ADAPTERS: dict[str, ArchAdapter] = {
    "llama": ArchAdapter("llama", "transformers.models.llama.modeling_llama"),
    "mistral": ArchAdapter("mistral", "transformers.models.mistral.modeling_mistral", windows="all_layers"),
    "qwen2": ArchAdapter("qwen2", "transformers.models.qwen2.modeling_qwen2", windows="layer_types"),
    "qwen3": ArchAdapter("qwen3", "transformers.models.qwen3.modeling_qwen3", has_qk_norm=True,
                         windows="layer_types"),
}

# Submodules of an attention layer that a patched module keeps (same objects, same state-dict keys).
SHARED_SUBMODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")


def shared_weight(proj: nn.Module) -> torch.Tensor:
    """The weight of a projection, or of the layer a PEFT wrapper holds (`base_layer`)."""
    return getattr(proj, "base_layer", proj).weight


def base_model(model: nn.Module) -> nn.Module:
    """The decoder stack (e.g. LlamaModel) inside a *ForCausalLM, a PEFT wrapper, or the stack itself."""
    m = model
    for _ in range(4):
        if hasattr(m, "layers") and hasattr(m, "embed_tokens"):
            return m
        if hasattr(m, "get_base_model") and callable(m.get_base_model) and m.get_base_model() is not m:
            m = m.get_base_model()
            continue
        if hasattr(m, "model"):
            m = m.model
            continue
        break
    if hasattr(m, "layers"):
        return m
    raise UnsupportedModelError(f"could not find the decoder stack of {type(model).__name__}")


def model_config(model: nn.Module):
    cfg = getattr(model, "config", None)
    if cfg is None:
        cfg = base_model(model).config
    return cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg


def get_adapter(model: nn.Module) -> ArchAdapter:
    cfg = model_config(model)
    mt = getattr(cfg, "model_type", None)
    if mt not in ADAPTERS:
        raise UnsupportedModelError(
            f"model type {mt!r} is not supported; supported types: {', '.join(sorted(ADAPTERS))}. "
            "Add an ArchAdapter in longctx_patch/architectures.py for a new family."
        )
    return ADAPTERS[mt]


def supported_model_types() -> list[str]:
    return sorted(ADAPTERS)
