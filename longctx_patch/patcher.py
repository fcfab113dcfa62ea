"""patch / unpatch / save_patched / load_patched.

`patch(model, method, layers=None, **config)` swaps the attention module of each selected decoder layer
for the method's module (built from the original, sharing its projections) and installs the cache and
padding plumbing once per model. Several patch() calls on disjoint layers make a hybrid (e.g. `ovq` on
some layers, `sliding-window` on the others). `unpatch(model)` puts every original module back.
"""

from __future__ import annotations

import inspect
import json
import numbers
import os
import sys
import types
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from . import __version__
from .architectures import base_model, get_adapter, model_config
from .errors import AlreadyPatchedError, CheckpointError, ConfigError, DeviceError, LongctxWarning, NotPatchedError
from .methods import get_method
from .methods.base import MethodConfig, PatchContext, PatchedAttention

PATCH_JSON = "longctx_patch.json"
PATCH_WEIGHTS = "longctx_patch.safetensors"
ADAPTER_DIR = "adapter"  # a PEFT adapter saved beside our weights (a fine-tune run's trainable/, an asset)
FORMAT_VERSION = 1


@dataclass
class PatchGroup:
    method: str
    config: MethodConfig
    layers: list[int]


@dataclass
class PatchState:
    ctx: PatchContext = field(default_factory=PatchContext)
    groups: list[PatchGroup] = field(default_factory=list)
    modules: dict[int, PatchedAttention] = field(default_factory=dict)
    originals: dict[int, nn.Module] = field(default_factory=dict)
    hooks: list[Any] = field(default_factory=list)  # torch hook handles
    generate_owner: nn.Module | None = None  # the model whose _prepare_cache_for_generation we overrode
    cache_arg: str = "cache"
    # {(layer, submodule name): original weight on the CPU}, kept when a checkpoint merges a delta (e.g. LoRA)
    # into a projection shared with the original module, so that unpatch() puts the weight back
    saved_weights: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    context_warned: bool = False  # a sequence past max_position_embeddings was warned about (once per patch)


_ATTR = "_longctx_patch_state"


def _state(model: nn.Module) -> PatchState:
    st = getattr(base_model(model), _ATTR, None)
    if st is None:
        raise NotPatchedError("this model is not patched by longctx-patch; call longctx_patch.patch(model, method) first")
    return st


def is_patched(model: nn.Module) -> bool:
    return getattr(base_model(model), _ATTR, None) is not None


def patched_layers(model: nn.Module) -> dict[int, str]:
    """{layer index: method name} of the patched layers ({} when unpatched)."""
    if not is_patched(model):
        return {}
    return {i: m.method_name for i, m in sorted(_state(model).modules.items())}


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
def _cache_arg_name(base: nn.Module) -> str:
    params = inspect.signature(type(base).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


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


def _install(model: nn.Module, base: nn.Module) -> PatchState:
    st = PatchState(cache_arg=_cache_arg_name(base))
    cfg = model_config(model)

    def pre_hook(module, args, kwargs):
        from .cache import LongctxCache

        am = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
        if isinstance(am, torch.Tensor) and am.dim() == 2 and not bool(am.all()):
            st.ctx.key_mask = am.bool()
        else:
            st.ctx.key_mask = None
        cache = kwargs.get("cache", None)
        if cache is None:
            cache = kwargs.get("past_key_values", None)
        if not st.context_warned:
            _warn_past_trained_context(st, cfg, args, kwargs, cache if isinstance(cache, LongctxCache) else None)
        use_cache = kwargs.get("use_cache", None)
        if use_cache is None:
            use_cache = getattr(cfg, "use_cache", False)
        if isinstance(cache, LongctxCache):
            return None
        if cache is None and not use_cache:
            return None
        if cache is not None and cache.get_seq_length() > 0:
            raise ConfigError(
                f"a {type(cache).__name__} with {cache.get_seq_length()} cached tokens was passed to a patched model; "
                "pass no cache (one is created) or a longctx_patch.LongctxCache"
            )
        kwargs.pop("past_key_values", None)
        kwargs.pop("cache", None)
        kwargs[st.cache_arg] = LongctxCache(model)
        return args, kwargs

    st.hooks.append(base.register_forward_pre_hook(pre_hook, with_kwargs=True))

    # generate() builds its cache before the first forward: make it ours (the hook would replace an empty
    # DynamicCache anyway; doing it here keeps generate's own bookkeeping on the object it returns).
    top = model
    if hasattr(top, "_prepare_cache_for_generation"):
        orig = top._prepare_cache_for_generation

        def _prepare_cache_for_generation(self, generation_config, model_kwargs, *a, **kw):
            from .cache import LongctxCache
            from transformers.cache_utils import DynamicCache

            out = orig(generation_config, model_kwargs, *a, **kw)
            for key in ("cache", "past_key_values"):
                c = model_kwargs.get(key)
                if type(c) is DynamicCache and not getattr(c, "_is_user_defined", False):
                    model_kwargs[key] = LongctxCache(self)
            return out

        top._prepare_cache_for_generation = types.MethodType(_prepare_cache_for_generation, top)
        st.generate_owner = top
    setattr(base, _ATTR, st)
    return st


def _uninstall(model: nn.Module, base: nn.Module, st: PatchState) -> None:
    for h in st.hooks:
        h.remove()
    if st.generate_owner is not None:
        st.generate_owner.__dict__.pop("_prepare_cache_for_generation", None)
    delattr(base, _ATTR)


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


def _apply(model: nn.Module, method: str, layers, config: dict[str, Any]) -> tuple[PatchGroup, dict[int, PatchedAttention]]:
    if not isinstance(method, str):
        from .methods import list_methods

        raise ConfigError(f"method: got {method!r} ({type(method).__name__}); pass a method name, one of "
                          f"{', '.join(list_methods())}")
    adapter = get_adapter(model)
    m = get_method(method)
    cfg = m.parse_config(config)
    base = base_model(model)
    decoder = adapter.decoder_layers(model)
    idx = parse_layers(layers, len(decoder))
    mcfg = model_config(model)
    specs = {i: adapter.spec(mcfg, i) for i in idx}
    m.check_layers(list(specs.values()), cfg)  # before anything changes (e.g. a model window it would drop)
    if is_patched(model):
        st = _state(model)
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
        mod = m.build(orig, specs[i], cfg, adapter)
        p = next(orig.parameters(), None)
        if p is not None:
            mod.to(device=p.device)
        _check_materialised(mod, i)
        built[i] = (orig, mod)
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


def patch(model: nn.Module, method: str, layers=None, **config) -> nn.Module:
    """Patch `model` in place with `method` on `layers` (None = all; '0-7,12' or a list), return it.

    Config keys are the method's (see `longctx info`); an unknown key or a bad value raises ConfigError.
    """
    group, new = _apply(model, method, layers, config)
    try:
        get_method(method).after_patch(model, new, group.config)
    except Exception:
        _undo_group(model, group)
        raise
    return model


def _undo_group(model: nn.Module, group: PatchGroup) -> None:
    st = _state(model)
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


def shared_weight(proj: nn.Module) -> torch.Tensor:
    """The weight of a projection, or of the layer a PEFT wrapper holds (`base_layer`)."""
    return getattr(proj, "base_layer", proj).weight


def keep_original_weight(model: nn.Module, layer: int, name: str) -> torch.Tensor:
    """Call before changing the weight of the shared projection `name` (q_proj ...) of patched layer `layer`
    in place: keeps a CPU copy (once) that unpatch() restores. Returns the weight."""
    st = _state(model)
    w = shared_weight(getattr(st.modules[layer], name))
    if (layer, name) not in st.saved_weights:
        st.saved_weights[(layer, name)] = w.detach().to("cpu", copy=True)
    return w


def unpatch(model: nn.Module) -> nn.Module:
    """Restore every original attention module; logits are then bit-identical to before patch()."""
    st = _state(model)
    decoder = get_adapter(model).decoder_layers(model)
    for i in list(st.modules):
        _restore(decoder, st, i)
    _uninstall(model, base_model(model), st)
    return model


# --------------------------------------------------------------------------------------------- save/load
def _patch_record(model: nn.Module) -> dict[str, Any]:
    st = _state(model)
    groups = [{"method": g.method, "config": g.config.to_dict(), "layers": g.layers} for g in st.groups]
    rec: dict[str, Any] = {"format": FORMAT_VERSION, "version": __version__}
    if len(groups) == 1:
        rec.update(groups[0])
    else:
        rec["patches"] = groups
    return rec


def method_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The method-owned parameters/buffers of every patched layer, keyed `layers.{i}.{name}`."""
    st = _state(model)
    out = {}
    for i, mod in sorted(st.modules.items()):
        for k, v in mod.method_parameters().items():
            out[f"layers.{i}.{k}"] = v.detach().contiguous()
    return out


def load_method_state_dict(model: nn.Module, sd: dict[str, torch.Tensor], source: str = "checkpoint") -> None:
    """Load `method_state_dict` output strictly: missing/unexpected/mis-shaped keys raise CheckpointError."""
    own = method_state_dict(model)
    missing = sorted(set(own) - set(sd))
    unexpected = sorted(set(sd) - set(own))
    shapes = sorted(f"{k}: expected {tuple(own[k].shape)}, got {tuple(sd[k].shape)}" for k in set(own) & set(sd) if own[k].shape != sd[k].shape)
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"missing keys: {missing}")
        if unexpected:
            parts.append(f"unexpected keys: {unexpected}")
        if shapes:
            parts.append(f"mis-shaped keys: {shapes}")
        raise CheckpointError(f"{source} does not match the patched model; " + "; ".join(parts))
    st = _state(model)
    with torch.no_grad():
        for i, mod in st.modules.items():
            prefix = f"layers.{i}."
            local = {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}
            if local:
                mod.load_state_dict(local, strict=False)


def save_patched(model: nn.Module, directory: str | os.PathLike, tokenizer=None) -> str:
    """Write the HF checkpoint (original modules), `longctx_patch.json` and `longctx_patch.safetensors`."""
    from safetensors.torch import save_file

    if hasattr(model, "peft_config") and hasattr(model, "merge_and_unload"):
        # PeftModel.save_pretrained writes the adapter only: the directory would have no base model to load
        raise ConfigError("save_patched got a PEFT model, whose save_pretrained writes only the adapter; call "
                          "model = model.merge_and_unload() first (the patch stays on the merged model), or save the "
                          "adapter with model.save_pretrained(DIR) and keep the base checkpoint")
    st = _state(model)
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    rec = _patch_record(model)
    weights = method_state_dict(model)
    decoder = get_adapter(model).decoder_layers(model)
    # Save with the original modules in place so the checkpoint is a plain HF one.
    for i, orig in st.originals.items():
        decoder[i].self_attn = orig
    try:
        from .models import drop_gguf_quantization

        drop_gguf_quantization(model)
        model.save_pretrained(directory)
    finally:
        for i, mod in st.modules.items():
            decoder[i].self_attn = mod
    if weights:
        save_file(weights, os.path.join(directory, PATCH_WEIGHTS), metadata={"format": "pt"})
    with open(os.path.join(directory, PATCH_JSON), "w") as f:
        json.dump(rec, f, indent=2)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    return directory


def _version_key(v: str) -> tuple[int, ...] | None:
    parts = v.split(".")
    return tuple(int(x) for x in parts) if all(x.isdigit() for x in parts) else None


def _check_format(path: str, rec: dict[str, Any]) -> None:
    fmt = rec.get("format", FORMAT_VERSION)  # records written before the key existed are format 1
    if isinstance(fmt, bool) or not isinstance(fmt, int) or fmt < 1:
        raise CheckpointError(f"{path}: \"format\" is {fmt!r}, not a record format number; write the record again "
                              "with save_patched()")
    if fmt > FORMAT_VERSION:
        wrote = rec.get("version")
        key, mine = (_version_key(wrote) if isinstance(wrote, str) else None), _version_key(__version__)
        if key is not None and (mine is None or key > mine):
            upgrade = f"upgrade longctx-patch to {wrote} or later (pip install -U 'longctx-patch>={wrote}')"
        else:
            upgrade = "upgrade longctx-patch to the release that wrote it"
        by = f"longctx-patch {wrote}" if isinstance(wrote, str) else "a newer longctx-patch"
        raise CheckpointError(f"{path} was written by {by} in record format {fmt}; longctx-patch {__version__} reads "
                              f"formats up to {FORMAT_VERSION}: {upgrade}")


def _check_group(path: str, where: str, g) -> dict[str, Any]:
    if not isinstance(g, dict):
        raise CheckpointError(f"{path}: {where} is {type(g).__name__}, not an object with method/config/layers; write "
                              "it again with save_patched()")
    lacking = [k for k in ("method", "config", "layers") if k not in g]
    if lacking:
        raise CheckpointError(f"{path} lacks {'/'.join(lacking)}{'' if where == 'the record' else ' in ' + where}; "
                              "write it again with save_patched()")
    if not isinstance(g["method"], str):
        raise CheckpointError(f"{path}: \"method\" of {where} is {g['method']!r}, not a method name such as "
                              "'sliding-window'")
    if not isinstance(g["config"], dict):
        raise CheckpointError(f"{path}: \"config\" of {where} is {g['config']!r}, not an object of method "
                              "options such as {\"window\": 256}")
    layers = g["layers"]
    if not isinstance(layers, list) or not layers or any(_layer_index(i) is None for i in layers):
        raise CheckpointError(f"{path}: \"layers\" of {where} is {layers!r}, not a non-empty list of 0-based layer "
                              "indices such as [0, 1, 2]")
    return {"method": g["method"], "config": g["config"], "layers": layers}


def read_patch_record(directory: str | os.PathLike) -> list[dict[str, Any]]:
    """The patch groups ([{method, config, layers}], in patch order) of a directory save_patched() wrote.
    A missing, unreadable, malformed or too new record raises CheckpointError."""
    path = os.path.join(os.fspath(directory), PATCH_JSON)
    try:
        with open(path, encoding="utf-8") as f:
            rec = json.load(f)
    except FileNotFoundError:
        hint = ""
        if os.path.exists(os.path.join(os.fspath(directory), "config.json")):
            hint = ("; it is a plain HF checkpoint (Trainer.save_model and save_pretrained write those): save a "
                    "patched model with longctx_patch.save_patched(model, DIR), e.g. after trainer.train(), "
                    "save_patched(trainer.model, DIR)")
        raise CheckpointError(f"{path} not found: {directory} was not written by save_patched(){hint}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON ({e}); write it again with save_patched()") from None
    except OSError as e:
        raise CheckpointError(f"cannot read {path} ({e.strerror or e}); pass the directory save_patched() wrote") from None
    if not isinstance(rec, dict):
        raise CheckpointError(f"{path} holds {json.dumps(rec)[:40]}, not the object save_patched() writes; write it "
                              "again with save_patched()")
    _check_format(path, rec)
    if "patches" in rec:
        patches = rec["patches"]
        if not isinstance(patches, list) or not patches:
            raise CheckpointError(f"{path}: \"patches\" is {patches!r}, not a non-empty list of "
                                  "{method, config, layers} objects; write it again with save_patched()")
        return [_check_group(path, f"patches[{n}]", g) for n, g in enumerate(patches)]
    return [_check_group(path, "the record", rec)]


def _unreadable_weights(path: str, e: Exception) -> CheckpointError:
    return CheckpointError(f"{path} cannot be read as safetensors ({e}): the file is truncated or corrupt; copy it "
                           "again, or write it again with save_patched()")


def read_method_weights(directory: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The method weights (`longctx_patch.safetensors`) of a directory save_patched() wrote ({} without the file).
    An unreadable file or non-finite values raise CheckpointError."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = os.path.join(os.fspath(directory), PATCH_WEIGHTS)
    if not os.path.exists(path):
        return {}
    try:
        sd = load_file(path)
    except (SafetensorError, OSError) as e:
        raise _unreadable_weights(path, e) from None
    bad = sorted(k for k, v in sd.items() if v.is_floating_point() and not bool(torch.isfinite(v).all()))
    if bad:
        shown = str(bad) if len(bad) <= 8 else f"{bad[:8]} and {len(bad) - 8} more"
        raise CheckpointError(f"{path}: {shown} hold NaN or inf values (the run that wrote them diverged); use an "
                              "earlier checkpoint of the run, or train again with a lower learning rate")
    return sd


def _check_weights_header(directory: str | os.PathLike) -> None:
    """Opens the weights file's header only (cheap): a truncated or garbage file fails before a model is loaded."""
    from safetensors import SafetensorError, safe_open

    path = os.path.join(os.fspath(directory), PATCH_WEIGHTS)
    if not os.path.exists(path):
        return
    try:
        with safe_open(path, framework="pt"):
            pass
    except (SafetensorError, OSError) as e:
        raise _unreadable_weights(path, e) from None


def apply_patch_record(model: nn.Module, directory: str | os.PathLike) -> nn.Module:
    """Re-apply the patches recorded in `directory` and load their saved weights (no after_patch step).
    On any failure the patches applied here are undone and the model is left as it was."""
    groups = read_patch_record(directory)
    sd = read_method_weights(directory)
    applied: list[PatchGroup] = []
    try:
        for n, g in enumerate(groups):
            try:
                group, _ = _apply(model, g["method"], g["layers"], g["config"])
            except ConfigError as e:  # a record that does not fit the installed methods or this model
                where = f" (patch {n + 1} of {len(groups)})" if len(groups) > 1 else ""
                raise CheckpointError(f"{os.path.join(os.fspath(directory), PATCH_JSON)}{where}: {e}") from e
            applied.append(group)
        load_method_state_dict(model, sd, source=os.path.join(os.fspath(directory), PATCH_WEIGHTS))
    except BaseException:
        for group in reversed(applied):
            _undo_group(model, group)
        raise
    return model


def load_patched(directory: str | os.PathLike, dtype=None, device=None) -> nn.Module:
    """Rebuild a model saved with save_patched(): the base checkpoint, the patches and their weights."""
    from .models import load_model_only

    # fail early, with a clear message, on a directory save_patched() did not write or a damaged one
    read_patch_record(directory)
    _check_weights_header(directory)
    return load_model_only(directory, dtype=dtype, device=device)
