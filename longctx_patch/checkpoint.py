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

Writes are atomic (`replacing_folder`): a folder is written beside its place and renamed into it once its files are
on disk, so an interrupted save leaves the previous folder whole. The record, written last, lists every other file
of the folder with its size ("files"): a folder that lost a file or holds a cut weights file (an interrupted copy,
by the recorded size or, listed or not, by the file's own header) is refused by name (`check_saved_files`) before
anything reads it. The method weights say in their metadata which method each layer's weights belong to
(WEIGHTS_LAYERS): a record edited to another method of the same keys and shapes (lola -> lolcats) is refused by
name (`check_weights_record`). Those checks of a saved folder against its record are saved_files.py's.
"""

from __future__ import annotations

import contextlib
import glob
import json
import numbers
import os
import re
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ._version import __version__
from .errors import CheckpointError, ConfigError
from .tensor_parallel import full_shape, full_tensor, local_part

PATCH_JSON = "longctx_patch.json"
PATCH_WEIGHTS = "longctx_patch.safetensors"
ADAPTER_DIR = "adapter"  # a PEFT adapter saved beside our weights (a fine-tune run's trainable/, an asset)
TRAINABLE_DIR = "trainable"
FORMAT_VERSION = 1
REWRITE = "write it again with save_patched()"


# --------------------------------------------------------------------------------------------- the record
def patch_record(groups: Sequence[Mapping[str, Any]], files: Mapping[str, int] | None = None,
                 calibration: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The object PATCH_JSON holds for `groups` ([{method, config, layers}], in patch order); `files`: {path relative
    to the folder: size in bytes} of the folder's other files; `calibration`: when the groups come from a
    calibration (longctx_patch/calibration.py), its record (readers that do not know the key ignore it: the groups
    alone are the patch)."""
    groups = [{"method": g["method"], "config": dict(g["config"]), "layers": list(g["layers"])} for g in groups]
    rec: dict[str, Any] = {"format": FORMAT_VERSION, "version": __version__}
    if len(groups) == 1:
        rec.update(groups[0])
    else:
        rec["patches"] = groups
    if files is not None:
        rec["files"] = dict(sorted(files.items()))
    if calibration is not None:
        rec["calibration"] = dict(calibration)
    return rec


def folder_files(directory: str | os.PathLike) -> dict[str, int]:
    """{path relative to `directory` (with '/'): size} of every file under it but PATCH_JSON."""
    root = Path(directory)
    return {f.relative_to(root).as_posix(): f.stat().st_size for f in sorted(root.rglob("*"))
            if f.is_file() and f.relative_to(root).as_posix() != PATCH_JSON}


WEIGHTS_LAYERS = "longctx_patch.layers"  # PATCH_WEIGHTS' metadata: {layer: method} its weights were written for


def layer_methods(groups: Sequence[Mapping[str, Any]]) -> dict[int, str]:
    return {int(i): g["method"] for g in groups for i in g["layers"]}


def write_patch(directory: str | os.PathLike, groups: Sequence[Mapping[str, Any]],
                weights: Mapping[str, torch.Tensor], calibration: Mapping[str, Any] | None = None) -> None:
    """Writes PATCH_WEIGHTS (when there are weights; its metadata says which method each layer's weights belong to,
    WEIGHTS_LAYERS), then PATCH_JSON listing every file of `directory` (which exists) and the calibration record if
    any: call it once the folder's other files are written."""
    directory = os.fspath(directory)
    if weights:
        from safetensors.torch import save_file

        layers = json.dumps({str(i): m for i, m in sorted(layer_methods(groups).items())})
        save_file({k: v.to("cpu") for k, v in weights.items()}, os.path.join(directory, PATCH_WEIGHTS),
                  metadata={"format": "pt", WEIGHTS_LAYERS: layers})
    with open(os.path.join(directory, PATCH_JSON), "w") as f:
        json.dump(patch_record(groups, folder_files(directory), calibration), f, indent=2)


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


# --------------------------------------------------------------------------------------------- atomic folders
STAGING = ".partial-"  # `.NAME.partial-PID-XXXX`: the folder a save of NAME is writing


def fsync_path(path: str | os.PathLike) -> None:
    """Flushes a file or a folder (its entries) to disk. Folders cannot be opened where POSIX does not apply: skipped."""
    try:
        fd = os.open(os.fspath(path), os.O_RDONLY)
    except (IsADirectoryError, PermissionError):
        return
    try:
        os.fsync(fd)
    except OSError:  # a folder on a system that cannot sync one
        pass
    finally:
        os.close(fd)


def fsync_tree(root: str | os.PathLike) -> None:
    """Flushes every file under `root`, then every folder (deepest first) and `root` itself."""
    folders = []
    for d, _, names in os.walk(root):
        folders.append(d)
        for n in names:
            fsync_path(os.path.join(d, n))
    for d in reversed(folders):
        fsync_path(d)


def staging_of(path: str | os.PathLike) -> str | None:
    """The folder name a staging folder saves to (`.model.partial-12-ab` -> 'model'), or None for another name."""
    m = re.fullmatch(r"\.(.+)\.partial-\d+-[^.]+", os.path.basename(os.path.normpath(os.fspath(path))))
    return m.group(1) if m else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process, or no way to ask
        return True
    return True


def _remove_stale(parent: Path, name: str) -> None:
    """Removes what interrupted saves of `parent/name` left: staging folders of processes that no longer run."""
    for p in parent.glob(f".{glob.escape(name)}{STAGING}*"):
        m = re.fullmatch(rf"\.{re.escape(name)}{STAGING}(\d+)-[^.]+", p.name)
        if m and not _alive(int(m.group(1))):
            shutil.rmtree(p, ignore_errors=True)


def _exchange(a: str, b: str) -> bool:
    """Swaps two paths in one step (Linux renameat2 RENAME_EXCHANGE); False where that is not available."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), exchange) == 0:
        return True
    return False  # e.g. a file system without exchange (EINVAL): the two renames below


def write_text(path: str | os.PathLike, text: str) -> None:
    """`path` holds `text`, written whole or not at all (a temporary file beside it, flushed, renamed over it)."""
    path = os.fspath(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=os.path.dirname(path) or ".")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def check_replaceable(directory: str | os.PathLike) -> None:
    """save_patched() replaces its folder as a whole: a ConfigError for a file, a path under a file or under a folder
    this process cannot write, or a non-empty folder it did not write (whose files the replacement would remove)."""
    directory = os.fspath(directory)
    if os.path.isfile(directory):
        raise ConfigError(f"save_patched: {directory} is a file; pass a directory to write")
    target = Path(os.path.abspath(directory))
    above = next(p for p in target.parents if p.exists())  # the nearest existing folder the save is written under
    if not above.is_dir():
        raise ConfigError(f"save_patched: {directory} lies under {above}, which is a file, not a folder; pass a "
                          "directory whose parents are folders (or new)")
    if not os.access(above, os.W_OK | os.X_OK):
        raise ConfigError(f"save_patched: cannot write {directory}: {above} is not writable (permission denied); "
                          "pass a directory under a folder you can write to")
    if os.path.isdir(directory) and not os.path.exists(os.path.join(directory, PATCH_JSON)):
        entries = sorted(os.listdir(directory))
        if entries:
            shown = ", ".join(entries[:5]) + (f" and {len(entries) - 5} more" if len(entries) > 5 else "")
            raise ConfigError(f"save_patched: {directory} holds files save_patched() did not write ({shown}); the folder "
                              "is replaced as a whole, so pass a new or empty directory (or one save_patched() wrote)")


@contextlib.contextmanager
def replacing_folder(target: str | os.PathLike, writes: bool = True) -> Iterator[Path]:
    """Yields an empty staging folder beside `target` (`.NAME.partial-PID-XXXX`, same file system); when the block ends
    without an exception, its files are flushed to disk and it takes the place of `target` in one rename (an existing
    `target` is swapped out in the same step where Linux allows, else moved aside just before, and removed). An
    interruption at any point leaves `target` as it was, or absent if it was; the next save of `target` removes the
    staging folder left behind. `writes=False` (a process of a tensor-parallel save that writes nothing): a
    throw-away folder, removed afterwards."""
    if not writes:
        scratch = Path(tempfile.mkdtemp(prefix="longctx-save-"))
        try:
            yield scratch
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        return
    target = Path(os.path.realpath(os.fspath(target)))
    parent = target.parent
    parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(parent, target.name)
    stage = Path(tempfile.mkdtemp(prefix=f".{target.name}{STAGING}{os.getpid()}-", dir=parent))
    try:
        yield stage
        fsync_tree(stage)
        if not target.exists():
            os.rename(stage, target)
        elif _exchange(os.fspath(stage), os.fspath(target)):
            pass  # `stage` now holds the previous folder
        else:
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}{STAGING}{os.getpid()}-", dir=parent))
            os.rmdir(old)
            os.rename(target, old)
            os.rename(stage, target)
            stage = old
        fsync_path(parent)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


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
def unreadable_weights(path: str, e: Exception, rewrite: str, advice: str | None = None) -> CheckpointError:
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return CheckpointError(f"{path} cannot be read as safetensors ({first}): the file is truncated or corrupt; "
                           f"{advice or f'copy it again, or {rewrite}'}")


def shown_keys(names: list[str]) -> str:
    return str(names) if len(names) <= 8 else f"{names[:8]} and {len(names) - 8} more"


def finite(t: torch.Tensor) -> bool:
    """Whether a floating-point tensor holds no NaN or inf: one pass (aminmax propagates NaN), no copy."""
    if t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t.detach().reshape(-1))
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def read_weights_file(path: str | os.PathLike, rewrite: str = REWRITE, advice: str | None = None) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file. A missing or unreadable file or non-finite values raise CheckpointError
    naming the file (`rewrite`: how to write the file again, for the message; `advice`: what to do instead of copying
    or rewriting it, e.g. for a run's checkpoint)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = os.fspath(path)
    try:
        sd = load_file(path)
    except FileNotFoundError:
        raise CheckpointError(f"{path} not found{'; ' + advice if advice else ''}") from None
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise unreadable_weights(path, e, rewrite, advice) from None
    bad = sorted(k for k, v in sd.items() if v.is_floating_point() and not finite(v))
    if bad:
        raise CheckpointError(f"{path}: {shown_keys(bad)} hold NaN or inf values (the run that wrote them diverged); "
                              + (advice or "use an earlier checkpoint of the run, or train again with a lower "
                                           "learning rate"))
    return sd


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def same_kind(saved: torch.Tensor, own: torch.Tensor) -> bool:
    """Whether a saved tensor can be loaded into `own` by a cast that keeps its values' meaning: floating point into
    floating point (any precision), integers into integers, bools into bools."""
    def kind(t):
        return "float" if t.is_floating_point() else "complex" if t.is_complex() else "bool" if t.dtype == torch.bool else "int"

    return kind(saved) == kind(own)


def read_method_weights(directory: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The method weights (PATCH_WEIGHTS) of a directory save_patched() wrote ({} without the file), read with
    read_weights_file."""
    path = os.path.join(os.fspath(directory), PATCH_WEIGHTS)
    if not os.path.exists(path):
        return {}
    return read_weights_file(path)


def read_adapter_weights(directory: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The weights of the PEFT adapter saved in `directory`/ADAPTER_DIR (`adapter_model.safetensors`), read with
    read_weights_file. An adapter saved as a pickle (`adapter_model.bin`) is refused unread, saying how to convert it."""
    folder = os.path.join(os.fspath(directory), ADAPTER_DIR)
    path = os.path.join(folder, "adapter_model.safetensors")
    pickled = os.path.join(folder, "adapter_model.bin")
    if not os.path.exists(path) and os.path.exists(pickled):
        raise CheckpointError(
            f"{pickled} is a pickle (torch.save), which longctx-patch does not load: unpickling can run code; if you "
            "trust it, convert it to safetensors: python -c \"import torch; from safetensors.torch import save_file; "
            f"save_file(torch.load({pickled!r}, weights_only=True), {path!r})\" (weights_only refuses anything but "
            "tensors), or load the adapter with peft and save it again (PeftModel.save_pretrained writes "
            "adapter_model.safetensors)")
    return read_weights_file(path, rewrite="save the adapter again (PeftModel.save_pretrained)")


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
    tensors = {f"layers.{i}.{k}": v for i, mod in modules.items() for k, v in mod.method_parameters().items()}
    kinds = sorted(k for k in set(own) & set(sd) if not same_kind(sd[k], tensors[k]))
    if kinds:  # e.g. an int64 tensor where a float32 parameter is: a cast would load it silently
        k = kinds[0]
        more = f" (and {len(kinds) - 1} more: {shown_keys(kinds[1:])})" if len(kinds) > 1 else ""
        raise CheckpointError(f"{source}: holds {k} as {dtype_name(sd[k].dtype)} where the patched model has "
                              f"{dtype_name(tensors[k].dtype)}{more}; write it again with save_patched()")
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
    "REWRITE",
    "WEIGHTS_LAYERS",
    "check_replaceable",
    "dtype_name",
    "finite",
    "folder_files",
    "layer_methods",
    "fsync_path",
    "fsync_tree",
    "drop_gguf_quantization",
    "load_modules_state_dict",
    "modules_state_dict",
    "patch_record",
    "read_adapter_weights",
    "read_calibration",
    "read_method_weights",
    "read_patch_record",
    "read_weights_file",
    "replacing_folder",
    "same_kind",
    "shown_keys",
    "staging_of",
    "unreadable_weights",
    "write_patch",
    "write_text",
]
