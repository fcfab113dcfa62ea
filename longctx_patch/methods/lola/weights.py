"""Read and write LoLCATs checkpoints (`model.pt` state dicts) and our own safetensors.

LoLCATs layout (keys after an optional `base_model.model.` and/or `model.` prefix):
  layers.{i}.self_attn.feature_map_q.mlp.layer      [heads, head_dim, feature_dim]
  layers.{i}.self_attn.feature_map_k.mlp.layer      [heads, head_dim, feature_dim]
  layers.{i}.self_attn.window_factors               [1, heads, 1, 1]
  layers.{i}.self_attn.{q,k,v,o}_proj.lora_{A,B}[.default].weight   (PEFT LoRA, optional)
Ours (what save_patched writes to longctx_patch.safetensors): layers.{i}.feature_map_q.mlp.layer, ...
"""

from __future__ import annotations

import os
import re

import torch

from ...architectures import shared_weight
from ...checkpoint import ADAPTER_DIR, PATCH_WEIGHTS, read_adapter_weights, read_weights_file
from ...errors import CheckpointError, ConfigError
from ...tensor_parallel import full_shape, local_part
from ...patch_state import keep_original_weight, patched_modules, restore_original_weight
from .config import HybridConfig

METHOD_KEYS = ("feature_map_q.mlp.layer", "feature_map_k.mlp.layer", "window_factors")
PROJS = ("q_proj", "k_proj", "v_proj", "o_proj")
_LOLCATS = re.compile(r"^layers\.(\d+)\.self_attn\.(.+)$")
_OURS = re.compile(r"^layers\.(\d+)\.(.+)$")
_LORA = re.compile(r"^([qkvo]_proj)\.lora_([AB])(?:\.default)?\.weight$")


def _holds_method_keys(module) -> bool:
    """Whether a patched module has the parameters this format holds (a lolcats or lola layer)."""
    try:
        for name in METHOD_KEYS:
            module.get_parameter(name)
    except AttributeError:
        return False
    return True


def _modules(model, modules):
    """The lolcats/lola layers among `modules` (default: the patched layers of `model`), {layer: module}."""
    if modules is None:
        modules = patched_modules(model)
    return {i: m for i, m in modules.items() if _holds_method_keys(m)}


def _read_adapter(folder: str) -> tuple[dict[str, torch.Tensor], float] | None:
    """A PEFT LoRA adapter saved next to our weights (`adapter/` of a `longctx finetune` run): (state dict, alpha)."""
    cfg_path = os.path.join(folder, ADAPTER_DIR, "adapter_config.json")
    if not os.path.exists(cfg_path):
        return None
    import json

    with open(cfg_path) as f:
        cfg = json.load(f)
    if cfg.get("use_rslora") or cfg.get("use_dora"):
        raise CheckpointError(f"{cfg_path}: rsLoRA/DoRA adapters cannot be merged by the checkpoint loader; "
                              "load the adapter with peft instead")
    weights = os.path.join(folder, ADAPTER_DIR, "adapter_model.safetensors")
    if not os.path.exists(weights):
        raise CheckpointError(f"{cfg_path} has no adapter_model.safetensors beside it")
    return read_adapter_weights(folder), float(cfg.get("lora_alpha", cfg.get("r", 8)))


def _read(path: str) -> list[tuple[dict[str, torch.Tensor], bool, float | None]]:
    """[(state dict, is_ours, LoRA alpha or None = the caller's)]: one entry, two for a folder that holds our
    weights and a PEFT `adapter/` (the `trainable/` folder of a fine-tune run, or a packaged asset)."""
    if os.path.isdir(path):
        ours = os.path.join(path, PATCH_WEIGHTS)
        pt = os.path.join(path, "model.pt")
        if os.path.exists(ours):
            out = [(_read_file(ours)[0], True, None)]
            adapter = _read_adapter(path)
            if adapter is not None:
                out.append((adapter[0], False, adapter[1]))
            return out
        if os.path.exists(pt):
            path = pt
        else:
            raise CheckpointError(f"{path} is a directory without {PATCH_WEIGHTS} or model.pt; pass the file itself")
    sd, ours = _read_file(path)
    return [(sd, ours, None)]


def _read_file(path: str) -> tuple[dict[str, torch.Tensor], bool]:
    """(state dict, is_ours)."""
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint {path} not found; pass a LoLCATs model.pt or a {PATCH_WEIGHTS} file")
    if path.endswith(".safetensors"):
        return read_weights_file(path), True  # checked: a damaged file or NaN/inf values raise CheckpointError
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"cannot read {path} with torch.load(weights_only=True) ({type(e).__name__}: {e}); "
                              "pass a LoLCATs model.pt state dict") from None
    if isinstance(sd, dict) and "model_state_dict" in sd and isinstance(sd["model_state_dict"], dict):
        sd = sd["model_state_dict"]
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise CheckpointError(f"{path} does not hold a state dict of tensors")
    return sd, False


def _strip(key: str) -> str:
    for p in ("base_model.model.", "model."):
        if key.startswith(p):
            key = key[len(p):]
    return key


def _fmt(items: list[str], limit: int = 12) -> str:
    items = sorted(items)
    more = f" ... and {len(items) - limit} more" if len(items) > limit else ""
    return "[" + ", ".join(items[:limit]) + "]" + more


def load_lolcats_checkpoint(model, paths: str, modules=None, lora_alpha: float = 16.0,
                            skip_unpatched_layers: bool = False) -> dict[str, int]:
    """Load feature maps, window factors and LoRA adapters into the lolcats/lola layers of `model`.

    `paths`: one path or several separated by commas (e.g. a distill checkpoint and its LoRA fine-tune): a
    LoLCATs `model.pt`, our `longctx_patch.safetensors`, or a folder holding ours plus an optional PEFT
    `adapter/` (a `longctx finetune` run's `trainable/`; its alpha comes from its adapter_config.json).
    Missing, unexpected or mis-shaped keys raise CheckpointError listing them; with `skip_unpatched_layers`,
    keys of layers that are not patched are ignored instead. LoRA deltas are merged into the projection
    weights (W += alpha / r * B A; unpatch() restores the original weights) unless the projection is a PEFT
    LoRA layer, whose adapter weights are then set. Returns counts of what was loaded.
    """
    mods = _modules(model, modules)
    if not mods:
        raise CheckpointError("no lolcats/lola layer to load a checkpoint into; patch the model with lolcats first")
    method: dict[tuple[int, str], tuple[torch.Tensor, str]] = {}
    lora: dict[tuple[int, str, str], tuple[torch.Tensor, str, float]] = {}
    unexpected: list[str] = []
    for path in [p.strip() for p in str(paths).split(",") if p.strip()]:
        for sd, ours, alpha in _read(path):
            for key, t in sd.items():
                m = (_OURS if ours else _LOLCATS).match(key if ours else _strip(key))
                if m is None:
                    unexpected.append(key)
                    continue
                i, rest = int(m.group(1)), m.group(2)
                if i not in mods:
                    if not skip_unpatched_layers:
                        unexpected.append(f"{key} (layer {i} is not patched with lolcats/lola)")
                    continue
                if rest in METHOD_KEYS:
                    method[(i, rest)] = (t, key)
                    continue
                lm = _LORA.match(rest)
                if lm is not None and not ours:
                    lora[(i, lm.group(1), lm.group(2))] = (t, key, lora_alpha if alpha is None else alpha)
                    continue
                unexpected.append(key)
    missing = [f"layers.{i}.self_attn.{n}" for i in sorted(mods) for n in METHOD_KEYS if (i, n) not in method]
    for (i, proj, ab), (_, key, _) in lora.items():
        if (i, proj, "B" if ab == "A" else "A") not in lora:
            missing.append(key.replace(f"lora_{ab}", f"lora_{'B' if ab == 'A' else 'A'}"))
    shapes = []
    for (i, name), (t, key) in method.items():
        own = full_shape(mods[i], name, mods[i].get_parameter(name))
        if tuple(t.shape) != own:
            shapes.append(f"{key}: expected {own}, got {tuple(t.shape)}")
    for (i, proj, ab), (t, key, _) in lora.items():
        w = shared_weight(getattr(mods[i], proj))
        other = lora.get((i, proj, "B" if ab == "A" else "A"))
        if t.dim() != 2:
            shapes.append(f"{key}: expected a matrix, got {tuple(t.shape)}")
            continue
        if ab == "A" and t.shape[1] != w.shape[1]:
            shapes.append(f"{key}: expected (r, {w.shape[1]}), got {tuple(t.shape)}")
        if ab == "B" and t.shape[0] != w.shape[0]:
            shapes.append(f"{key}: expected ({w.shape[0]}, r), got {tuple(t.shape)}")
        if ab == "A" and other is not None and other[0].dim() == 2 and other[0].shape[1] != t.shape[0]:
            shapes.append(f"{key}: rank {t.shape[0]} does not match {other[1]} (rank {other[0].shape[1]})")
    if lora and any(m.head_shard is not None for m in mods.values()):
        raise ConfigError(
            f"checkpoint {paths} holds LoRA adapters, which are merged into the q/k/v/o projections: that is not done "
            "on a tensor-parallel model (split projections). Patch the model on one process with this checkpoint, "
            "save_patched() it, and load the saved directory with tp_plan='auto'")
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"missing keys {_fmt(missing)}")
        if unexpected:
            parts.append(f"unexpected keys {_fmt(unexpected)}")
        if shapes:
            parts.append(f"mis-shaped keys {_fmt(shapes)}")
        raise CheckpointError(
            f"checkpoint {paths} does not match the patched model ({'; '.join(parts)}). Check that the model, "
            "the patched layers and feature_dim are the ones the checkpoint was trained with.")
    with torch.no_grad():
        for (i, name), (t, _) in method.items():
            p = mods[i].get_parameter(name)
            p.copy_(local_part(mods[i], name, t).to(device=p.device, dtype=p.dtype))
        for (i, proj, ab), (t, _, alpha) in lora.items():
            if ab != "A":
                continue
            _apply_lora(model, i, proj, getattr(mods[i], proj), t, lora[(i, proj, "B")][0], alpha)
    return {"layers": len({i for i, _ in method}), "lora_pairs": sum(1 for k in lora if k[2] == "A")}


def checkpoint_adapter_folder(model, config: HybridConfig) -> str:
    """The folder whose PEFT `adapter/` the checkpoint `config.checkpoint` of `model`'s lolcats/lola layers holds: the
    packaged asset `auto` finds for `model`, or the one part of a checkpoint path that is such a folder (an asset, a
    fine-tune run's trainable/). CheckpointError when there is none (fresh feature maps, a file, a LoLCATs model.pt)
    or several."""
    ck = config.checkpoint
    what = "there is no LoRA adapter to continue"
    if ck is None or str(ck).strip().lower() in ("", "none"):
        raise CheckpointError(f"checkpoint=none (fresh feature maps): {what}; load the packaged asset (checkpoint=auto) "
                              "or a fine-tune run's trainable/ folder")
    if str(ck).strip().lower() == "auto":
        from ...assets import find_asset

        asset = find_asset(model, config)
        if asset is None:
            raise CheckpointError(f"checkpoint=auto found no packaged asset for this model: {what}; pass "
                                  "checkpoint=PATH (a packaged asset or a fine-tune run's trainable/ folder)")
        folders = [str(asset.path)] if os.path.exists(os.path.join(asset.path, ADAPTER_DIR, "adapter_config.json")) else []
    else:
        folders = [p.strip() for p in str(ck).split(",")
                   if os.path.exists(os.path.join(p.strip(), ADAPTER_DIR, "adapter_config.json"))]
    if not folders:
        raise CheckpointError(f"checkpoint {ck} holds no PEFT adapter ({ADAPTER_DIR}/adapter_config.json beside "
                              f"{PATCH_WEIGHTS}, as a packaged asset or a fine-tune run's trainable/ has): {what}")
    if len(folders) > 1:
        raise CheckpointError(f"checkpoint {ck} holds {len(folders)} PEFT adapters ({', '.join(folders)}), merged one "
                              "after the other; one adapter can continue only one of them: pass that folder alone")
    return folders[0]


def take_checkpoint_lora(model, modules=None) -> tuple[dict[str, torch.Tensor], dict, str]:
    """The LoRA adapter of the checkpoint `model`'s lolcats/lola layers were patched with, taken back out of their
    q/k/v/o projections so that it can train as a PEFT adapter from its values (the fine-tune's `lora.init:
    checkpoint`). Patching merged it (W += alpha / r * B A, `load_lolcats_checkpoint`) and kept each projection's
    weight as it was (`keep_original_weight`): those weights are put back. Returns (the adapter's tensors under the
    keys PEFT saved them with, its adapter_config.json, the folder it came from). CheckpointError when the checkpoint
    holds no PEFT adapter (`checkpoint_adapter_folder`), when the adapter covers layers that are not patched (their
    projections never had it), or when a projection it covers holds no weight from before the merge (a model loaded
    with its patches already applied, e.g. a save_patched folder)."""
    import json

    mods = _modules(model, modules)
    if not mods:
        raise CheckpointError("no lolcats/lola layer: patch the model with lolcats or lola and a checkpoint first")
    cks = {str(m.method_config.checkpoint) for m in mods.values()}
    if len(cks) > 1:
        raise CheckpointError(f"the lolcats/lola layers were patched from different checkpoints ({', '.join(sorted(cks))}); "
                              "one LoRA adapter continues one checkpoint")
    folder = checkpoint_adapter_folder(model, next(iter(mods.values())).method_config)
    read = _read_adapter(folder)
    if read is None:  # checked by checkpoint_adapter_folder; a folder changed meanwhile
        raise CheckpointError(f"{folder} has no {ADAPTER_DIR}/adapter_config.json")
    sd = read[0]
    with open(os.path.join(folder, ADAPTER_DIR, "adapter_config.json")) as f:
        cfg = json.load(f)
    pairs, unpatched = set(), set()
    for key in sd:
        m = _LOLCATS.match(_strip(key))
        lm = _LORA.match(m.group(2)) if m is not None else None
        if lm is None:
            raise CheckpointError(f"{folder}/{ADAPTER_DIR}: key {key} is not a q/k/v/o LoRA weight of a decoder layer")
        i = int(m.group(1))
        (pairs if i in mods else unpatched).add((i, lm.group(1)))
    if unpatched:
        raise CheckpointError(f"the LoRA adapter of {folder} covers layers {sorted({i for i, _ in unpatched})}, which are "
                              "not patched with lolcats/lola: their projections never had it, so training it as the "
                              "adapter would change them; patch every layer it covers")
    lacking = sorted((i, n) for i, n in pairs if (i, n) not in _kept_weights(model))
    if lacking:
        raise CheckpointError(f"the q/k/v/o projections of layers {sorted({i for i, _ in lacking})} hold the LoRA of "
                              f"{folder} with no weight kept from before it was merged (was the model loaded with its "
                              "patches already applied?): patch the base model with the checkpoint instead")
    for i, name in sorted(pairs):
        restore_original_weight(model, i, name)
    return sd, cfg, folder


def _kept_weights(model) -> set[tuple[int, str]]:
    from ...patch_state import state_of

    return set(state_of(model).saved_weights)


def _apply_lora(model, layer: int, name: str, proj, A: torch.Tensor, B: torch.Tensor, alpha: float) -> None:
    la = getattr(proj, "lora_A", None)
    if la is not None and hasattr(la, "keys") and "default" in la.keys():
        pa, pb = la["default"].weight, proj.lora_B["default"].weight
        if tuple(pa.shape) != tuple(A.shape) or tuple(pb.shape) != tuple(B.shape):
            raise CheckpointError(f"LoRA rank of the checkpoint ({A.shape[0]}) differs from the PEFT adapter's "
                                  f"({pa.shape[0]}); create the adapter with r={A.shape[0]}")
        pa.copy_(A.to(pa.device, pa.dtype))
        pb.copy_(B.to(pb.device, pb.dtype))
        return
    w = keep_original_weight(model, layer, name)
    r = A.shape[0]
    delta = (B.float() @ A.float()) * (alpha / r)
    w.copy_((w.float() + delta.to(w.device)).to(w.dtype))


def export_lolcats_checkpoint(model, path: str, modules=None) -> str:
    """Write the lolcats/lola layers of `model` as a LoLCATs `model.pt` state dict (torch.save).

    Keys `model.layers.{i}.self_attn.{feature_map_q.mlp.layer, feature_map_k.mlp.layer, window_factors}`;
    when the projections carry PEFT LoRA adapters (`default`), every key uses the PEFT prefix
    `base_model.model.model.layers.{i}.self_attn.` and the adapters are written as
    `{q,k,v,o}_proj.lora_{A,B}.default.weight`, as LoLCATs' fine-tune checkpoints are.
    """
    mods = _modules(model, modules)
    if not mods:
        raise CheckpointError("no lolcats/lola layer to export; patch the model with lolcats first")
    lora = {}
    for i, m in mods.items():
        for proj in PROJS:
            p = getattr(m, proj, None)
            la = getattr(p, "lora_A", None)
            if la is not None and hasattr(la, "keys") and "default" in la.keys():
                lora[(i, proj)] = (la["default"].weight, p.lora_B["default"].weight)
    prefix = "base_model.model.model.layers." if lora else "model.layers."
    sd = {}
    for i, m in sorted(mods.items()):
        for name in METHOD_KEYS:
            sd[f"{prefix}{i}.self_attn.{name}"] = m.get_parameter(name).detach().cpu().clone()
    for (i, proj), (A, B) in sorted(lora.items()):
        sd[f"{prefix}{i}.self_attn.{proj}.lora_A.default.weight"] = A.detach().cpu().clone()
        sd[f"{prefix}{i}.self_attn.{proj}.lora_B.default.weight"] = B.detach().cpu().clone()
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    torch.save(sd, path)
    return path


def _measured_defaults(asset, method: str) -> dict:
    """asset.json `method_defaults.<method>`: the options the asset's measurements chose for `method` ({} if none)."""
    chosen = (asset.info.get("method_defaults") or {}).get(method) or {}
    if not isinstance(chosen, dict):
        raise CheckpointError(f"{asset.path}/asset.json: method_defaults.{method} is not an object of options; copy "
                              "the asset folder again")
    return chosen


def asset_defaults(model, method: str, config: HybridConfig, given: dict) -> dict:
    """The options of `method` that the packaged asset `checkpoint=auto` finds for `model` names as its measured
    defaults (asset.json `method_defaults`, e.g. Qwen2.5-Coder's lola window and sparse cache: docs/lola.md), less
    those in `given` (what the caller passed); {} with another checkpoint or without such an asset."""
    ck = config.checkpoint
    if ck is None or str(ck).strip().lower() != "auto":
        return {}
    from ...assets import find_asset

    asset = find_asset(model, config)
    chosen = _measured_defaults(asset, method) if asset is not None else {}
    return {k: v for k, v in chosen.items() if k not in given}


def load_method_weights(model, modules, config: HybridConfig, method: str | None = None) -> str:
    """`after_patch` of lolcats/lola: loads `config.checkpoint` (resolving `auto`) into `modules` and records
    where the weights came from on each module (`weights_source`, shown by `longctx patch`), with the asset's
    measured defaults of `method` if it names any (`asset_defaults`). Returns it."""
    ck = config.checkpoint
    if ck is not None and str(ck).strip().lower() == "auto":
        from ...assets import find_asset

        asset = find_asset(model, config)
        if asset is None:
            source = "fresh feature maps (untrained: train them with recipes/linearize.yaml or pass checkpoint=PATH)"
        else:
            load_lolcats_checkpoint(model, str(asset.path), modules=modules, skip_unpatched_layers=True)
            source = f"packaged asset {asset.name} ({asset.path})"
            chosen = _measured_defaults(asset, method) if method else {}
            if chosen:
                opts = ", ".join(f"{k}={v}" for k, v in chosen.items())
                source += f"; its measured {method} defaults {opts} (options passed take precedence)"
    elif ck:
        from ...assets import check_asset_for

        for part in str(ck).split(","):  # an asset folder trained for another model is refused by name
            check_asset_for(part.strip(), model)
        load_lolcats_checkpoint(model, ck, modules=modules, lora_alpha=config.lora_alpha)
        source = f"checkpoint {ck}"
    else:
        source = "fresh feature maps (checkpoint=none)"
    for m in modules.values():
        m.weights_source = source
    return source
