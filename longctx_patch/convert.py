"""`convert_to_lola`: a model patched with `lolcats` becomes a `lola` model in place (docs/lola.md). An API-level
helper: it unpatches and patches again, which only the API may do (a method never calls the patcher)."""

from __future__ import annotations

from .errors import ConfigError, NotPatchedError
from .methods import get_method
from .patcher import (keep_original_weights, load_method_state_dict, method_state_dict, patch, patch_groups,
                      take_original_weights, unpatch)


def convert_to_lola(model, sparse_cache: int = 256, **overrides):
    """Turn a model patched with `lolcats` into a `lola` model in place, keeping its feature maps and
    window factors (and any merged LoRA weights). `overrides`: other lola keys (window, chunk, backend ...).

    Equivalent to saving the lolcats parameters, `unpatch()`, `patch(model, "lola", ...)` on the same layers
    with the same config, and loading the parameters back. Returns the model.
    """
    try:
        patches = patch_groups(model)
    except NotPatchedError:
        raise NotPatchedError("convert_to_lola needs a model patched with lolcats; call "
                              "longctx_patch.patch(model, 'lolcats', ...) first") from None
    methods = sorted({g.method for g in patches})
    able = get_method("lola").converts_from  # the methods whose parameters lola takes as they are
    if set(methods) - set(able):
        raise ConfigError(f"convert_to_lola converts models patched only with {' or '.join(able)}; this one has "
                          f"{methods}. Unpatch and patch the layers with lola directly instead")
    groups = [(g.layers, g.config.to_dict()) for g in patches]
    sd = {k: v.clone() for k, v in method_state_dict(model).items()}
    # weights a checkpoint merged LoRA deltas into stay merged; unpatch() of the lola model restores them
    saved = take_original_weights(model)
    unpatch(model)
    for layers, cfg in groups:
        cfg = {**cfg, "checkpoint": None, "sparse_cache": sparse_cache, **overrides}
        patch(model, "lola", layers=layers, **cfg)
    keep_original_weights(model, saved)
    load_method_state_dict(model, sd, source="the lolcats parameters")
    return model


__all__ = ["convert_to_lola"]
