"""patch / unpatch / save_patched / apply_patch_record.

`patch(model, method, layers=None, **config)` swaps the attention module of each selected decoder layer
for the method's module (built from the original, sharing its projections) and installs the cache and
padding plumbing once per model. Several patch() calls on disjoint layers make a hybrid (e.g. `ovq` on
some layers, `sliding-window` on the others). `unpatch(model)` puts every original module back.
The files save_patched() writes and apply_patch_record() reads are checkpoint.py's; `load_patched` (a saved
directory to a model) is the model loader's (models.py).
"""

from __future__ import annotations

import numbers
import os
import sys
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from .architectures import base_model, get_adapter, model_config, shared_weight
from .checkpoint import (PATCH_JSON, PATCH_WEIGHTS, check_replaceable, drop_gguf_quantization, load_modules_state_dict,
                         modules_state_dict, read_calibration, read_method_weights, read_patch_record, replacing_folder,
                         write_patch)
from .errors import AlreadyPatchedError, CheckpointError, ConfigError, DeviceError, LongctxWarning
from .memory import available_memory
from .methods import get_method
from .methods.base import PatchedAttention
from .patch_state import (CALL_ARG, STATE_ATTR, CallState, PatchGroup, PatchState, is_patched, keep_original_weight,
                          keep_original_weights, patch_context, patch_groups, patched_layers, patched_modules, state_of, take_original_weights)
from .saved_files import check_saved_files, check_weights_record
from .tensor_parallel import build_sharded, head_shard, writes_files


# --------------------------------------------------------------------------------------------- layers
LAYERS_FORMS = ("None (all layers), an int, a list of ints, or a string like '0-7,12' (0-based, inclusive ranges; "
                "negative ints count from the end)")


def _layer_index(x) -> int | None:
    """x as a layer index when it is an integer (numpy integers too), else None. Bools are not indices."""
    if isinstance(x, numbers.Integral) and not isinstance(x, bool):
        return int(x)
    return None


def parse_layers(layers, num_layers: int) -> list[int]:
    """None -> all; an int; an iterable of ints; or a string like '0-7,12'. Validated against num_layers."""
    if layers is None:
        return list(range(num_layers))
    out: list[int] = []
    if isinstance(layers, str):
        for part in layers.replace(" ", "").split(","):
            if not part:
                continue
            try:
                if "-" in part[1:]:
                    a, b = part.split("-", 1) if not part.startswith("-") else (part, "")
                    a, b = int(a), int(b)
                else:
                    a = b = int(part)
            except ValueError:
                raise ConfigError(f"layers: cannot read {part!r}; allowed: {LAYERS_FORMS}") from None
            if b < a:
                raise ConfigError(f"layers: {part!r} is a reversed range; write it as '{b}-{a}'")
            out.extend(range(a, b + 1))
    elif _layer_index(layers) is not None:
        out = [_layer_index(layers)]
    elif isinstance(layers, (bytes, Mapping)) or not isinstance(layers, Iterable):
        raise ConfigError(f"layers: got {layers!r} ({type(layers).__name__}); allowed: {LAYERS_FORMS}")
    else:
        for x in layers:
            i = _layer_index(x)
            if i is None:
                raise ConfigError(f"layers: got {x!r} ({type(x).__name__}) in {layers!r}; allowed: {LAYERS_FORMS}")
            out.append(i)
    out = [i + num_layers if i < 0 else i for i in out]
    bad = sorted({i for i in out if not 0 <= i < num_layers})
    if bad:
        shown = f"{bad[0]}..{bad[-1]} ({len(bad)} indices)" if len(bad) > 8 else str(bad)
        raise ConfigError(f"layers: {shown} out of range; this model has layers 0-{num_layers - 1}")
    if not out:
        raise ConfigError("layers: the selection is empty")
    return sorted(set(out))


# --------------------------------------------------------------------------------------------- hooks
def _stacklevel_outside_libraries() -> int:
    """The stacklevel of warnings.warn, called from the caller of this function, that points at the first frame
    outside torch, transformers, peft, accelerate and this package (the user's forward or generate call)."""
    prefixes = tuple(os.path.dirname(mod.__file__) + os.sep for name in ("torch", "transformers", "peft", "accelerate")
                     if (mod := sys.modules.get(name)) is not None and getattr(mod, "__file__", None))
    prefixes += (os.path.dirname(os.path.abspath(__file__)) + os.sep,)
    f, level = sys._getframe(1), 1
    while f is not None and f.f_code.co_filename.startswith(prefixes):
        f, level = f.f_back, level + 1
    return level


def _warn_past_trained_context(st: PatchState, cfg, args, kwargs, cache) -> None:
    """Warns (once per patch) when this forward reaches past the model's max_position_embeddings. Reads shapes
    and the cache's token count only (no device synchronisation)."""
    trained = getattr(cfg, "max_position_embeddings", None)
    x = kwargs.get("input_ids", args[0] if args else None)
    if x is None:
        x = kwargs.get("inputs_embeds", args[4] if len(args) > 4 else None)
        new = x.shape[1] if isinstance(x, torch.Tensor) and x.dim() == 3 else None
    else:
        new = x.shape[-1] if isinstance(x, torch.Tensor) and x.dim() >= 1 else None
    if not isinstance(trained, int) or new is None:
        return
    past = cache.get_seq_length() if cache is not None else 0
    total = past + new
    if total <= trained:
        return
    st.context_warned = True
    methods = sorted({g.method for g in st.groups})
    which = f"method{'s' if len(methods) > 1 else ''} {', '.join(methods)}"
    warnings.warn(
        f"this forward reaches {total} tokens ({new} new after {past} cached), past the model's trained context of "
        f"{trained} tokens (max_position_embeddings); the patched {which} run there, but quality past {trained} "
        "tokens rests on rotary extrapolation, which the model was not trained for: keep sequences within "
        f"{trained} tokens or use a model trained on longer contexts (warned once per patched model)",
        LongctxWarning,
        stacklevel=_stacklevel_outside_libraries(),
    )


def _left_padded_positions(am: torch.Tensor, args: tuple, kwargs: dict) -> tuple[tuple, dict, bool]:
    """A forward of a left-padded batch without position_ids: the position ids generate() passes (each row counted
    from its first real token, `mask.cumsum(-1) - 1` clamped at 0, the last S columns: the mask covers the cached
    tokens and the new ones). transformers' decoder models, given none, count every row from the padded start
    (5.24: `arange(S) + cache.get_seq_length()`; 5.17: `cache_position`), which softmax attention does not see but
    the feature maps of lolcats / lola / ovq, applied to rotated q and k, do. Returns (args, kwargs, changed);
    position_ids given (keyword, or the third positional argument of the decoder's forward) are kept."""
    if kwargs.get("position_ids") is not None or (len(args) > 2 and args[2] is not None):
        return args, kwargs, False
    x = kwargs.get("input_ids", args[0] if args else None)
    if not isinstance(x, torch.Tensor):
        x = kwargs.get("inputs_embeds")
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            return args, kwargs, False
    S = x.shape[1] if x.dim() >= 2 else x.shape[-1]
    if S > am.shape[1]:
        return args, kwargs, False  # a mask shorter than the input: not ours to interpret
    pos = (am.long().cumsum(-1) - 1).clamp_min(0)[:, am.shape[1] - S:]
    if len(args) > 2:
        args = (*args[:2], pos, *args[3:])
    else:
        kwargs = {**kwargs, "position_ids": pos}
    return args, kwargs, True


def _read_mask(am: torch.Tensor) -> tuple[bool, bool]:
    """(any padding, a row starting with padding): the host read of a forward's mask."""
    padded, left = torch.stack([~am.bool().all(), ~am[:, 0].bool().all()]).tolist()
    return padded, left


def _padding_facts(am: torch.Tensor, cache, args: tuple, kwargs: dict) -> tuple[bool, bool]:
    """(any padding, left padding) of a forward's 2-D attention mask: one host read, except for a decode step.

    A decode step (one new token per row) continuing a LongctxCache whose first forward's mask was read reuses that
    reading: generate() extends the mask by a column of ones per step, so the answer cannot change, and a host read
    per step would make the CPU wait for the GPU's previous step before it can queue the next one."""
    x = kwargs.get("input_ids", args[0] if args else None)
    if not isinstance(x, torch.Tensor):
        x = kwargs.get("inputs_embeds")
    S = x.shape[1] if isinstance(x, torch.Tensor) and x.dim() >= 2 else None
    known = getattr(cache, "padding_facts", None) if cache is not None else None
    if known is not None and S == 1 and am.shape[1] == cache.get_seq_length() + 1:
        return known
    padded, left = _read_mask(am)
    if cache is not None and cache.get_seq_length() == 0:
        cache.padding_facts = (padded, left)
    return padded, left


def _forward_pre_hook(module: nn.Module, args: tuple, kwargs: dict):
    """The forward pre-hook of a patched model's decoder stack (`module`): reads the batch's padding into the call's
    own CallState (patch_state.py), handed to the decoder layers as the keyword argument CALL_ARG (left padding:
    position ids from the mask), warns past the trained context, and hands the stack a LongctxCache where it would
    build another. Nothing of the call is written on the model: calls running at once in several threads each see
    their own padding. A module-level function that finds the patch on the module it runs on (patch_state.py), so
    that a deep copy or a pickle of the model runs its own state."""
    from .cache import LongctxCache

    st = state_of(module)
    cfg = model_config(module)
    am = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
    cache = kwargs.get("cache", None)
    if cache is None:
        cache = kwargs.get("past_key_values", None)
    facts = None
    key_mask = None
    if isinstance(am, torch.Tensor) and am.dim() == 2 and am.numel():
        facts = _padding_facts(am, cache if isinstance(cache, LongctxCache) else None, args, kwargs)
        padded, left = facts
        if padded:
            key_mask = am.bool()
            if left:
                args, kwargs, _ = _left_padded_positions(am, args, kwargs)
    kwargs = {**kwargs, CALL_ARG: CallState(key_mask)}
    if not st.context_warned:
        _warn_past_trained_context(st, cfg, args, kwargs, cache if isinstance(cache, LongctxCache) else None)
    use_cache = kwargs.get("use_cache", None)
    if use_cache is None:
        use_cache = getattr(cfg, "use_cache", False)
    if isinstance(cache, LongctxCache) or (cache is None and not use_cache):
        return args, kwargs
    if cache is not None and cache.get_seq_length() > 0:
        raise ConfigError(
            f"a {type(cache).__name__} with {cache.get_seq_length()} cached tokens was passed to a patched model; "
            "pass no cache (one is created) or a longctx_patch.LongctxCache"
        )
    kwargs.pop("past_key_values", None)
    kwargs.pop("cache", None)
    kwargs[st.cache_arg] = fresh = LongctxCache(module)
    fresh.padding_facts = facts
    return args, kwargs


class PrepareCache:
    """generate()'s `_prepare_cache_for_generation`, installed on a patched model: the model's own, then its default
    DynamicCache replaced by a LongctxCache (for assisted decoding, one whose layers can take tokens back:
    cache.check_croppable) (the pre-hook would replace an empty DynamicCache anyway; doing it here
    keeps generate's own bookkeeping on the object it returns). An object holding its model, not a closure, so that
    deep copies and pickles of the model carry it with their own model."""

    def __init__(self, model: nn.Module, previous=None):
        self.model = model
        self.previous = previous  # an override the instance had before the patch (None: the class's method)

    def __call__(self, generation_config, model_kwargs, *args, **kwargs):
        from transformers.cache_utils import DynamicCache

        from .cache import LongctxCache, check_croppable

        if self.previous is not None:
            out = self.previous(generation_config, model_kwargs, *args, **kwargs)
        else:
            out = type(self.model)._prepare_cache_for_generation(self.model, generation_config, model_kwargs, *args,
                                                                 **kwargs)
        mode = args[0] if args else kwargs.get("generation_mode")
        assisted = str(getattr(mode, "value", mode)) == "assisted_generation"
        for key in ("cache", "past_key_values"):
            c = model_kwargs.get(key)
            if type(c) is DynamicCache and not getattr(c, "_is_user_defined", False):
                model_kwargs[key] = LongctxCache(self.model)
            if assisted and isinstance(model_kwargs.get(key), LongctxCache):
                check_croppable(self.model, model_kwargs[key])  # a named refusal before the prefill
        if getattr(generation_config, "prefill_chunk_size", 0) is None and any(
                isinstance(model_kwargs.get(key), LongctxCache) for key in ("cache", "past_key_values")):
            generation_config.prefill_chunk_size = prefill_chunk_of(self.model)  # a call's own value wins
        return out


def _install(model: nn.Module, base: nn.Module) -> PatchState:
    from .cache import cache_argument

    st = PatchState(cache_arg=cache_argument(type(base).forward))
    st.hooks.append(base.register_forward_pre_hook(_forward_pre_hook, with_kwargs=True))
    top = model
    if hasattr(top, "_prepare_cache_for_generation"):
        top._prepare_cache_for_generation = PrepareCache(top, top.__dict__.get("_prepare_cache_for_generation"))
        st.generate_owner = top
        # decode steps from CUDA graphs (decode_graphs.py): the top model's forward, routed through DecodeGraphs
        from .decode_graphs import DecodeGraphs, PrefillThenCapture

        if not isinstance(top.__dict__.get("forward"), DecodeGraphs):
            top.forward = st.decode_graphs = DecodeGraphs(top, top.forward)
        if hasattr(type(top), "_prefill"):  # generate()'s prefill: the decode graphs are captured when it ends
            top._prefill = PrefillThenCapture(top, top.__dict__.get("_prefill"))
    from .fused_ops import FusedOps

    st.fused = FusedOps()
    setattr(base, STATE_ATTR, st)
    return st


def _uninstall(model: nn.Module, base: nn.Module, st: PatchState) -> None:
    for h in st.hooks:
        h.remove()
    if st.fused is not None:
        st.fused.remove()
    st.ctx.fused_ops = None
    if st.generate_owner is not None:
        prepare = st.generate_owner.__dict__.pop("_prepare_cache_for_generation", None)
        if isinstance(prepare, PrepareCache) and prepare.previous is not None:
            st.generate_owner._prepare_cache_for_generation = prepare.previous
        from .decode_graphs import PrefillThenCapture

        prefill = st.generate_owner.__dict__.pop("_prefill", None)
        if isinstance(prefill, PrefillThenCapture) and prefill.previous is not None:
            st.generate_owner._prefill = prefill.previous
        fwd = st.generate_owner.__dict__.get("forward")
        # ours, or ours re-bound as a method (accelerate's unwrap_model: MethodType(forward, model))
        if st.decode_graphs is not None and (fwd is st.decode_graphs or getattr(fwd, "__func__", None) is st.decode_graphs):
            del st.generate_owner.__dict__["forward"]
    delattr(base, STATE_ATTR)


# --------------------------------------------------------------------------------------------- patch
def _check_materialised(mod: PatchedAttention, layer: int) -> None:
    """A method's own parameters created on the meta device would get no values when the model is materialised
    (to_empty() leaves them uninitialised, and the base checkpoint does not hold them): refuse."""
    on_meta = sorted(k for k, v in mod.method_parameters().items() if v.is_meta)
    if on_meta:
        raise DeviceError(
            f"layer {layer}'s attention weights are on the meta device (the model was built without its weights, e.g. "
            f"under torch.device('meta')), where {mod.method_name}'s own parameters ({', '.join(on_meta)}) would "
            "never get their values; materialise the model first (from_pretrained, or to_empty() then "
            "load_state_dict()), then call patch()"
        )


def _check_state_memory(m, cfg, new: list[PatchedAttention], st: PatchState | None, base: nn.Module) -> None:
    """The decode state one sequence allocates from its first token (new layers and those patched before) must fit
    the memory left on the model's device (Method.check_state_memory): refused by name before anything changes."""
    p = next((q for q in base.parameters() if q.is_floating_point() and not q.is_meta), None)
    if p is None:
        return
    others = sum(mod.state_bytes(1, batch=1, dtype=p.dtype) for mod in st.modules.values()) if st is not None else 0
    m.check_state_memory(new, cfg, p.dtype, available_memory(p.device), str(p.device), others)


def _apply(model: nn.Module, method: str, layers, config: dict[str, Any]) -> tuple[PatchGroup, dict[int, PatchedAttention]]:
    if not isinstance(method, str):
        from .methods import list_methods

        raise ConfigError(f"method: got {method!r} ({type(method).__name__}); pass a method name, one of "
                          f"{', '.join(list_methods())}")
    adapter = get_adapter(model)
    m = get_method(method)
    cfg = m.parse_config(config)  # a bad option is refused before the model is read for defaults
    defaults = m.model_defaults(model, cfg, config)
    if defaults:
        cfg = m.parse_config({**defaults, **config})
    base = base_model(model)
    decoder = adapter.decoder_layers(model)
    idx = parse_layers(layers, len(decoder))
    mcfg = model_config(model)
    specs = {i: adapter.spec(mcfg, i) for i in idx}
    m.check_layers(list(specs.values()), cfg)  # before anything changes (e.g. a model window it would drop)
    if is_patched(model):
        st = state_of(model)
        clash = sorted(set(idx) & set(st.modules))
        if clash:
            raise AlreadyPatchedError(
                f"layers {clash} are already patched ({st.modules[clash[0]].method_name}); "
                "call longctx_patch.unpatch(model) first, or patch other layers"
            )
    else:
        st = None
    built: dict[int, tuple[nn.Module, PatchedAttention]] = {}
    for i in idx:  # build every module before changing the model, so that a failure leaves it as it was
        orig = decoder[i].self_attn
        if isinstance(orig, PatchedAttention):  # patched outside our bookkeeping (e.g. deep-copied model)
            raise AlreadyPatchedError(f"layer {i} already holds a patched module; unpatch first")
        shard = head_shard(orig)
        if shard is None:
            mod = m.build(orig, specs[i], cfg, adapter)
        else:  # tensor parallelism: this rank's heads (tensor_parallel.py)
            mod = build_sharded(lambda spec: m.build(orig, spec, cfg, adapter), orig, specs[i], shard)
        p = next(orig.parameters(), None)
        if p is not None:
            mod.to(device=p.device)
        _check_materialised(mod, i)
        built[i] = (orig, mod)
    _check_state_memory(m, cfg, [mod for _, mod in built.values()], st, base)
    if st is None:
        st = _install(model, base)
    new: dict[int, PatchedAttention] = {}
    for i, (orig, mod) in built.items():
        mod._ctx = st.ctx
        mod.train(orig.training)
        st.originals[i] = orig
        st.modules[i] = mod
        decoder[i].self_attn = mod
        new[i] = mod
    group = PatchGroup(m.name, cfg, idx)
    st.groups.append(group)
    st.context_warned = False  # the methods changed: the next sequence past the trained context warns again
    return group, new


def patch(model: nn.Module, method: str, layers=None, *, decode_graphs: bool | None = None,
          fused_ops: bool | str | None = None, prefill_chunk: int | str | None = "auto", **config) -> nn.Module:
    """Patch `model` in place with `method` on `layers` (None = all; '0-7,12' or a list), return it.

    Config keys are the method's (see `longctx info`); an unknown key or a bad value raises ConfigError.
    decode_graphs: replay `generate()`'s one-token steps from CUDA graphs where every layer allows it (default:
    on, off on a tensor-parallel model; False: every step eager; see `set_decode_graphs`).
    fused_ops: the model's RMSNorms, SiLU MLPs and the patched layers' rotary embedding as fused Triton kernels at
    inference (fused_ops.py; default: on for a model on CUDA with Triton, off elsewhere; `LONGCTX_FUSED_OPS=0`
    makes the default off; see `set_fused_ops`).
    prefill_chunk: generate()'s prefill in chunks of this many tokens when a call does not set `prefill_chunk_size`
    ("auto", the default: DEFAULT_PREFILL_CHUNK when every layer's method keeps a bounded state, so that a long
    prompt's activations stay bounded too; None or 0: one pass; see `set_prefill_chunk`).
    """
    _check_prefill_chunk(prefill_chunk)  # a bad value raises before anything changes
    if fused_ops is not None:
        from .fused_ops import parse_mode

        parse_mode(fused_ops)  # a bad value raises before anything changes
    group, new = _apply(model, method, layers, config)
    try:
        get_method(method).after_patch(model, new, group.config)
    except Exception:
        _undo_group(model, group)
        raise
    if decode_graphs is None and any(mod.head_shard is not None for mod in new.values()):
        decode_graphs = False  # tensor parallelism: collectives replayed from CUDA graphs are unverified
    if decode_graphs is not None:
        set_decode_graphs(model, decode_graphs)
    if prefill_chunk != "auto":
        set_prefill_chunk(model, prefill_chunk)
    try:
        if fused_ops is not None:
            set_fused_ops(model, fused_ops)
        else:
            _default_fused_ops(model, new)
    except Exception:  # e.g. fused_ops="triton" where Triton cannot run: the model as it was
        _undo_group(model, group)
        raise
    return model


def _default_fused_ops(model: nn.Module, new: Mapping[int, PatchedAttention]) -> None:
    """Fused ops by default (fused_ops.default_mode) once per patch: a later patch() of other layers keeps them."""
    from .fused_ops import default_mode

    st = state_of(model)
    if not st.fused_decided:
        # tensor parallelism: norms with sharded or distributed weights are unverified with the kernels
        tp = any(mod.head_shard is not None for mod in new.values())
        set_fused_ops(model, False if tp else (default_mode(model) or False))


def set_fused_ops(model: nn.Module, enabled: bool | str) -> nn.Module:
    """Turn the fused inference kernels (longctx_patch/fused_ops.py) on or off for a patched model: the decoder's
    RMSNorms and SiLU MLPs and the patched layers' rotary embedding. True (or "auto"): a kernel for each call on CUDA
    tensors without gradients, the original ops elsewhere; "triton": also on the CPU under TRITON_INTERPRET=1
    (tests); False: the original ops everywhere. Takes effect from the next forward (a generate() already running
    keeps the decode graphs it captured)."""
    from .fused_ops import parse_mode

    mode = parse_mode(enabled)
    st = state_of(model)
    st.fused.install(model, get_adapter(model), mode)
    st.ctx.fused_ops = mode
    st.fused_decided = True
    return model


def set_decode_graphs(model: nn.Module, enabled: bool) -> nn.Module:
    """Turn the CUDA-graph replay of decode steps (longctx_patch/decode_graphs.py) on or off for a patched
    model. On (the default), a one-token step without gradients or padding whose every layer can be replayed
    runs from a graph captured for its layers' keys; anything else runs eagerly. Off: every step eager."""
    if not isinstance(enabled, bool):
        raise ConfigError(f"decode_graphs must be True or False, not {enabled!r}")
    st = state_of(model)
    if st.decode_graphs is None:
        if enabled:
            raise ConfigError("this model has no generate() entry point to replay (patch the *ForCausalLM model)")
        return model
    st.decode_graphs.enabled = enabled
    return model


DEFAULT_PREFILL_CHUNK = 4096  # H200, batch 16 x 32k, 1B-shaped model: peak 7-8 GiB for lola/lolcats/ovq (42.5 /
# 36.8 / 37.8 in one pass; exact 52.6), lolcats' and ovq's prefill as fast as in one pass (docs/PERFORMANCE.md)


def _check_prefill_chunk(value) -> None:
    if value is None or value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        return
    raise ConfigError(f"prefill_chunk must be 'auto', None or a number of tokens >= 0, not {value!r}")


def set_prefill_chunk(model: nn.Module, tokens: int | str | None) -> nn.Module:
    """How a patched model's generate() prefills a prompt when the call does not pass `prefill_chunk_size`: in
    chunks of `tokens` (transformers' chunked prefill: the activations of one chunk at a time), in one pass (None
    or 0), or "auto" (the default): chunks of DEFAULT_PREFILL_CHUNK tokens when every decoder layer is patched with a
    method whose decode state is bounded (sliding-window, lolcats, lola, ovq), one pass otherwise (a full KV cache
    grows with the prompt anyway)."""
    _check_prefill_chunk(tokens)
    state_of(model).prefill_chunk = tokens
    return model


def prefill_chunk_of(model: nn.Module) -> int | None:
    """The prefill_chunk_size generate() takes for `model` when its call sets none (`set_prefill_chunk`)."""
    st = state_of(model)
    if st.prefill_chunk != "auto":
        return st.prefill_chunk or None
    n = len(get_adapter(model).decoder_layers(model))
    bounded = {g.method for g in st.groups if get_method(g.method).bounded_state}
    every = len(st.modules) == n and all(g.method in bounded for g in st.groups)
    return DEFAULT_PREFILL_CHUNK if every else None


def _undo_group(model: nn.Module, group: PatchGroup) -> None:
    st = state_of(model)
    decoder = get_adapter(model).decoder_layers(model)
    for i in group.layers:
        _restore(decoder, st, i)
    st.groups.remove(group)
    if not st.groups:
        _uninstall(model, base_model(model), st)


def _restore(decoder, st: PatchState, i: int) -> None:
    from .architectures import SHARED_SUBMODULES

    mod, orig = st.modules.pop(i), st.originals.pop(i)
    for name in SHARED_SUBMODULES:  # keep wrappers (e.g. LoRA) added to the shared projections meanwhile
        sub = getattr(mod, name, None)
        if isinstance(sub, nn.Module):
            setattr(orig, name, sub)
    for (layer, name) in [key for key in st.saved_weights if key[0] == i]:
        saved = st.saved_weights.pop((layer, name))
        w = shared_weight(getattr(orig, name))
        with torch.no_grad():
            w.copy_(saved.to(device=w.device, dtype=w.dtype))
    decoder[i].self_attn = orig


def unpatch(model: nn.Module) -> nn.Module:
    """Restore every original attention module; logits are then bit-identical to before patch()."""
    st = state_of(model)
    decoder = get_adapter(model).decoder_layers(model)
    for i in list(st.modules):
        _restore(decoder, st, i)
    _uninstall(model, base_model(model), st)
    return model


# --------------------------------------------------------------------------------------------- save/load
def method_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The method-owned parameters/buffers of every patched layer, keyed `layers.{i}.{name}`."""
    return modules_state_dict(state_of(model).modules)


def load_method_state_dict(model: nn.Module, sd: dict[str, torch.Tensor], source: str = "checkpoint") -> None:
    """Load `method_state_dict` output strictly: missing/unexpected/mis-shaped keys raise CheckpointError."""
    load_modules_state_dict(state_of(model).modules, sd, source=source)


def save_patched(model: nn.Module, directory: str | os.PathLike, tokenizer=None) -> str:
    """Write the HF checkpoint (original modules), `longctx_patch.json` and `longctx_patch.safetensors`.

    Atomic: the folder is written beside `directory` and takes its place once every file is on disk
    (checkpoint.replacing_folder), so an interrupted save leaves the previous one whole (or no folder). `directory`
    must be new, empty, or a folder save_patched() wrote, which is replaced as a whole (files added to it are not
    kept); a folder holding anything else is refused.

    A tensor-parallel model (tp_plan): call it on every rank (the weights are gathered across them); global rank 0
    writes the full, unsharded record."""
    if hasattr(model, "peft_config") and hasattr(model, "merge_and_unload"):
        # PeftModel.save_pretrained writes the adapter only: the directory would have no base model to load
        raise ConfigError("save_patched got a PEFT model, whose save_pretrained writes only the adapter; call "
                          "model = model.merge_and_unload() first (the patch stays on the merged model), or save the "
                          "adapter with model.save_pretrained(DIR) and keep the base checkpoint")
    if not isinstance(directory, (str, os.PathLike)):
        raise ConfigError(f"save_patched: pass the directory to write (a str or Path), got {directory!r} "
                          f"({type(directory).__name__})")
    st = state_of(model)
    directory = os.fspath(directory)
    check_replaceable(directory)
    existed = os.path.isdir(directory)
    try:
        _write_patched(model, st, directory, tokenizer)
    except OSError as e:  # a full disk, a folder made read-only meanwhile ...: the user's path, not the staging one's
        kept = f"the previous {directory} is kept as it was" if existed else f"no {directory} was made"
        raise CheckpointError(f"save_patched: could not write {directory} ({e.strerror or e}); {kept}") from e
    return directory


def _write_patched(model: nn.Module, st: PatchState, directory: str, tokenizer) -> None:
    groups = [g.to_record() for g in st.groups]
    weights = method_state_dict(model)
    decoder = get_adapter(model).decoder_layers(model)
    writes = writes_files(st.modules.values())
    with replacing_folder(directory, writes=writes) as work:
        # Save with the original modules in place so the checkpoint is a plain HF one.
        for i, orig in st.originals.items():
            decoder[i].self_attn = orig
        try:
            drop_gguf_quantization(model)
            model.save_pretrained(work)
        finally:
            for i, mod in st.modules.items():
                decoder[i].self_attn = mod
        if writes:
            if tokenizer is not None:
                tokenizer.save_pretrained(work)
            write_patch(work, groups, weights, st.calibration)  # last: the record lists every other file


def apply_patch_record(model: nn.Module, directory: str | os.PathLike) -> nn.Module:
    """Re-apply the patches recorded in `directory` and load their saved weights (no after_patch step).
    On any failure the patches applied here are undone and the model is left as it was."""
    groups = read_patch_record(directory)
    calibration = read_calibration(directory)
    sd = read_method_weights(directory)
    check_saved_files(directory)
    applied: list[PatchGroup] = []
    try:
        for n, g in enumerate(groups):
            try:
                group, _ = _apply(model, g["method"], g["layers"], g["config"])
            except ConfigError as e:  # a record that does not fit the installed methods or this model
                where = f" (patch {n + 1} of {len(groups)})" if len(groups) > 1 else ""
                raise CheckpointError(f"{os.path.join(os.fspath(directory), PATCH_JSON)}{where}: {e}") from e
            applied.append(group)
        check_weights_record(directory, groups)  # the groups fit the methods and the model: do they fit the weights?
        load_method_state_dict(model, sd, source=os.path.join(os.fspath(directory), PATCH_WEIGHTS))
        if calibration is not None:  # the calibration that chose these groups (longctx_patch/calibration.py)
            state_of(model).calibration = calibration
        if applied:  # a runtime option, not in the record: the default (fused_ops.py)
            _default_fused_ops(model, patched_modules(model))
    except BaseException:
        for group in reversed(applied):
            _undo_group(model, group)
        raise
    return model


__all__ = ["LAYERS_FORMS", "PatchGroup", "PatchState", "PrepareCache", "apply_patch_record", "is_patched",
           "keep_original_weight", "keep_original_weights", "load_method_state_dict", "method_state_dict", "parse_layers",
           "patch", "patch_context", "patch_groups", "patched_layers", "patched_modules", "save_patched",
           "set_decode_graphs", "set_fused_ops", "take_original_weights", "unpatch"]
