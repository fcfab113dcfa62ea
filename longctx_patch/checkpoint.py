"""The format of the folders longctx-patch writes: a `save_patched()` checkpoint, a fine-tune run's `trainable/`
folder, a packaged asset.

  PATCH_JSON     longctx_patch.json: the patch record (format FORMAT_VERSION, the version that wrote it, and the
                 patch groups: one group's method/config/layers, or several under "patches")
  PATCH_WEIGHTS  longctx_patch.safetensors: the method-owned parameters of the patched layers, `layers.{i}.{name}`
  ADAPTER_DIR    adapter/: a PEFT adapter saved beside them (a run's trainable/, an asset)
  TRAINABLE_DIR  trainable/: the folder of a fine-tune run's output that holds the three above

Plain data in and out (group records, state dicts, modules by layer index): no patcher or method import, so the
patcher, the model loader, the lolcats checkpoint reader, the assets and train/ share one writer and one checked
reader.
"""

from __future__ import annotations

import json
import numbers
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from . import __version__
from .errors import CheckpointError
from .tensor_parallel import full_shape, full_tensor, local_part

PATCH_JSON = "longctx_patch.json"
PATCH_WEIGHTS = "longctx_patch.safetensors"
ADAPTER_DIR = "adapter"  # a PEFT adapter saved beside our weights (a fine-tune run's trainable/, an asset)
TRAINABLE_DIR = "trainable"
FORMAT_VERSION = 1
_REWRITE = "write it again with save_patched()"


# --------------------------------------------------------------------------------------------- the record
def patch_record(groups: Sequence[Mapping[str, Any]], calibration: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The object PATCH_JSON holds for `groups` ([{method, config, layers}], in patch order) and, when the groups
    come from a calibration (longctx_patch/calibration.py), its record under "calibration" (readers that do not know
    the key ignore it: the groups alone are the patch)."""
    groups = [{"method": g["method"], "config": dict(g["config"]), "layers": list(g["layers"])} for g in groups]
    rec: dict[str, Any] = {"format": FORMAT_VERSION, "version": __version__}
    if len(groups) == 1:
        rec.update(groups[0])
    else:
        rec["patches"] = groups
    if calibration is not None:
        rec["calibration"] = dict(calibration)
    return rec


def write_patch(directory: str | os.PathLike, groups: Sequence[Mapping[str, Any]],
                weights: Mapping[str, torch.Tensor], calibration: Mapping[str, Any] | None = None) -> None:
    """Writes PATCH_WEIGHTS (when there are weights) and PATCH_JSON into `directory`, which exists."""
    directory = os.fspath(directory)
    if weights:
        from safetensors.torch import save_file

        save_file({k: v.to("cpu") for k, v in weights.items()}, os.path.join(directory, PATCH_WEIGHTS),
                  metadata={"format": "pt"})
    with open(os.path.join(directory, PATCH_JSON), "w") as f:
        json.dump(patch_record(groups, calibration), f, indent=2)


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


def _is_layer_index(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


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
    if not isinstance(layers, list) or not layers or not all(_is_layer_index(i) for i in layers):
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


def read_calibration(directory: str | os.PathLike) -> dict[str, Any] | None:
    """The "calibration" of the record in `directory` (read_patch_record's checks first), or None when it has none."""
    read_patch_record(directory)
    path = os.path.join(os.fspath(directory), PATCH_JSON)
    with open(path, encoding="utf-8") as f:
        cal = json.load(f).get("calibration")
    if cal is not None and not (isinstance(cal, dict) and isinstance(cal.get("layers"), list)):
        raise CheckpointError(f"{path}: \"calibration\" is {json.dumps(cal)[:40]}, not the object calibrate() keeps "
                              "(with its \"layers\"); write it again with save_patched()")
    return cal


# --------------------------------------------------------------------------------------------- the weights
def _unreadable_weights(path: str, e: Exception, rewrite: str) -> CheckpointError:
    return CheckpointError(f"{path} cannot be read as safetensors ({e}): the file is truncated or corrupt; copy it "
                           f"again, or {rewrite}")


def read_weights_file(path: str | os.PathLike, rewrite: str = _REWRITE) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file. An unreadable file or non-finite values raise CheckpointError (`rewrite`:
    how to write the file again, for the message)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = os.fspath(path)
    try:
        sd = load_file(path)
    except FileNotFoundError:
        raise CheckpointError(f"{path} not found") from None
    except (SafetensorError, OSError) as e:
        raise _unreadable_weights(path, e, rewrite) from None
    bad = sorted(k for k, v in sd.items() if v.is_floating_point() and not bool(torch.isfinite(v).all()))
    if bad:
        shown = str(bad) if len(bad) <= 8 else f"{bad[:8]} and {len(bad) - 8} more"
        raise CheckpointError(f"{path}: {shown} hold NaN or inf values (the run that wrote them diverged); use an "
                              "earlier checkpoint of the run, or train again with a lower learning rate")
    return sd


def read_method_weights(directory: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The method weights (PATCH_WEIGHTS) of a directory save_patched() wrote ({} without the file), read with
    read_weights_file."""
    path = os.path.join(os.fspath(directory), PATCH_WEIGHTS)
    if not os.path.exists(path):
        return {}
    return read_weights_file(path)


def read_adapter_weights(directory: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The weights of the PEFT adapter saved in `directory`/ADAPTER_DIR (`adapter_model.safetensors`), read with
    read_weights_file."""
    return read_weights_file(os.path.join(os.fspath(directory), ADAPTER_DIR, "adapter_model.safetensors"),
                             rewrite="save the adapter again (PeftModel.save_pretrained)")


def check_weights_header(directory: str | os.PathLike) -> None:
    """Opens the weights file's header only (cheap): a truncated or garbage file fails before a model is loaded."""
    from safetensors import SafetensorError, safe_open

    path = os.path.join(os.fspath(directory), PATCH_WEIGHTS)
    if not os.path.exists(path):
        return
    try:
        with safe_open(path, framework="pt"):
            pass
    except (SafetensorError, OSError) as e:
        raise _unreadable_weights(path, e, _REWRITE) from None


def modules_state_dict(modules: Mapping[int, nn.Module]) -> dict[str, torch.Tensor]:
    """The method-owned parameters/buffers (`method_parameters()`) of patched modules {layer: module}, keyed
    `layers.{i}.{name}`: what PATCH_WEIGHTS holds."""
    out = {}
    for i, mod in sorted(modules.items()):
        for k, v in mod.method_parameters().items():
            out[f"layers.{i}.{k}"] = full_tensor(mod, k, v).detach().contiguous()
    return out


def load_modules_state_dict(modules: Mapping[int, nn.Module], sd: Mapping[str, torch.Tensor],
                            source: str = "checkpoint") -> None:
    """Loads `modules_state_dict` output into `modules` strictly: missing/unexpected/mis-shaped keys raise
    CheckpointError naming `source`. Under tensor parallelism `sd` is the unsharded record: each rank loads its part."""
    own = {f"layers.{i}.{k}": torch.Size(full_shape(mod, k, v))
           for i, mod in sorted(modules.items()) for k, v in mod.method_parameters().items()}
    missing = sorted(set(own) - set(sd))
    unexpected = sorted(set(sd) - set(own))
    shapes = sorted(f"{k}: expected {tuple(own[k])}, got {tuple(sd[k].shape)}" for k in set(own) & set(sd) if own[k] != sd[k].shape)
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"missing keys: {missing}")
        if unexpected:
            parts.append(f"unexpected keys: {unexpected}")
        if shapes:
            parts.append(f"mis-shaped keys: {shapes}")
        raise CheckpointError(f"{source} does not match the patched model; " + "; ".join(parts))
    with torch.no_grad():
        for i, mod in modules.items():
            prefix = f"layers.{i}."
            local = {k[len(prefix):]: local_part(mod, k[len(prefix):], v) for k, v in sd.items() if k.startswith(prefix)}
            if local:
                mod.load_state_dict(local, strict=False)


# --------------------------------------------------------------------------------------------- the base model
def drop_gguf_quantization(model) -> None:
    """A GGUF checkpoint is dequantised on load; forget its quantization record so it saves as plain weights."""
    qc = getattr(model.config, "quantization_config", None)
    if qc is not None and "gguf" in str(getattr(qc, "quant_method", qc)).lower():
        del model.config.quantization_config
    hq = getattr(model, "hf_quantizer", None)
    if hq is not None and "gguf" in str(getattr(hq.quantization_config, "quant_method", "")).lower():
        model.hf_quantizer = None
        if hasattr(model, "is_quantized"):
            model.is_quantized = False


__all__ = [
    "ADAPTER_DIR",
    "FORMAT_VERSION",
    "PATCH_JSON",
    "PATCH_WEIGHTS",
    "TRAINABLE_DIR",
    "check_weights_header",
    "drop_gguf_quantization",
    "load_modules_state_dict",
    "modules_state_dict",
    "patch_record",
    "read_adapter_weights",
    "read_calibration",
    "read_method_weights",
    "read_patch_record",
    "read_weights_file",
    "write_patch",
]
