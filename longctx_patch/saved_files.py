"""The checks of a folder save_patched() wrote against its record, before and while it loads: every file the record
lists is there and the base model's weights have their recorded size (`check_saved_files`), every safetensors file is
whole by its own header (`safetensors_problem`), the method weights were written for the record's methods and layers
(`check_weights_record`), the base weights hold no NaN or inf (`check_base_weights`). Each failure is a
CheckpointError naming the file. The format itself (the record, the weights' keys, the atomic writes) is
checkpoint.py's.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from torch import nn

from .checkpoint import (ADAPTER_DIR, PATCH_JSON, PATCH_WEIGHTS, REWRITE, WEIGHTS_LAYERS, finite, layer_methods,
                         shown_keys, unreadable_weights)
from .errors import CheckpointError

OWN_WEIGHTS = (PATCH_WEIGHTS, f"{ADAPTER_DIR}/adapter_model.safetensors")  # read by checked readers, not by size


def safetensors_problem(path: str | os.PathLike) -> str | None:
    """What is wrong with the structure of a safetensors file, read from its header alone (no tensor is read): no
    header, a header that is not JSON, or a size other than the header's tensors end at (a file cut short, or with
    bytes added); None when it is whole."""
    try:
        size = os.stat(path).st_size
        with open(path, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if n < 2 or 8 + n > size:
                return f"{size} bytes, without a whole safetensors header"
            header = json.loads(f.read(n))
    except OSError as e:
        return f"unreadable: {e.strerror or e}"
    except ValueError:
        return "its header is not a safetensors header (not JSON)"
    try:
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    except (TypeError, KeyError, IndexError, AttributeError):
        return "its header is not a safetensors header (no tensor offsets)"
    if not isinstance(end, int) or 8 + n + end != size:
        return f"{size} bytes where its header says {8 + n + end if isinstance(end, int) else '?'}"
    return None


def check_saved_files(directory: str | os.PathLike) -> None:
    """A CheckpointError naming the file when the folder lacks a file its record lists ("files", written by
    save_patched() since the key exists), a listed .safetensors file of the base model has another size than the
    record says, or any .safetensors file of the folder, listed or not, is cut short or corrupt by its own header
    (safetensors_problem): the folder is half-written, by an interrupted copy or a save from before writes were atomic.
    Other listed files only need to be there (a config or tokenizer file edited by hand is fine); what the method and
    adapter weights hold is left to their checked readers (OWN_WEIGHTS), which say what is wrong inside."""
    directory = os.fspath(directory)
    try:
        with open(os.path.join(directory, PATCH_JSON), encoding="utf-8") as f:
            rec = json.load(f)
    except (OSError, ValueError):
        return  # read_patch_record says what is wrong with the record itself
    files = rec.get("files") if isinstance(rec, dict) else None
    wrong = []
    for name, size in (files.items() if isinstance(files, dict) else ()):
        path = os.path.join(directory, *str(name).split("/"))
        try:
            have = os.stat(path).st_size
        except OSError:
            wrong.append(f"{name} is missing")
            continue
        if str(name).endswith(".safetensors") and name not in OWN_WEIGHTS and isinstance(size, int) and have != size:
            wrong.append(f"{name} is cut short or changed ({have} bytes, {size} written)")
    for path in sorted(Path(directory).rglob("*.safetensors")):
        name = path.relative_to(directory).as_posix()
        problem = None if any(w.startswith(f"{name} ") for w in wrong) else safetensors_problem(path)
        if problem is not None:
            wrong.append(f"{name} is cut short or corrupt ({problem})")
    if wrong:
        shown = "; ".join(wrong[:4]) + (f"; and {len(wrong) - 4} more" if len(wrong) > 4 else "")
        raise CheckpointError(f"{directory} is incomplete ({shown}): a copy or a save of it was interrupted; copy it "
                              "again from where it was saved, or save the model again with save_patched()")


def _runs(layers: Mapping[int, str]) -> str:
    """{0: 'lola', 1: 'lola', 3: 'ovq'} -> "lola on layers 0-1; ovq on layer 3"."""
    out = []
    for method in sorted(set(layers.values())):
        idx = sorted(i for i, m in layers.items() if m == method)
        runs: list[list[int]] = []
        for i in idx:
            if runs and i == runs[-1][1] + 1:
                runs[-1][1] = i
            else:
                runs.append([i, i])
        text = ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
        out.append(f"{method} on layer{'s' if len(idx) > 1 else ''} {text}")
    return "; ".join(out)


def check_weights_record(directory: str | os.PathLike, groups: Sequence[Mapping[str, Any]]) -> None:
    """A CheckpointError naming both files when PATCH_WEIGHTS was written for other methods or layers than the
    record's `groups` say (its metadata, WEIGHTS_LAYERS): e.g. a record whose method was renamed from lola to
    lolcats, whose weights have the same keys and shapes but mean something else. Weights written without the
    metadata (before it existed, or packaged by hand) are not compared."""
    from safetensors import SafetensorError, safe_open

    path = os.path.join(os.fspath(directory), PATCH_WEIGHTS)
    if not os.path.exists(path):
        return
    try:
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
    except (SafetensorError, OSError) as e:
        raise unreadable_weights(path, e, REWRITE) from None
    if WEIGHTS_LAYERS not in meta:
        return
    try:
        written = {int(k): str(v) for k, v in json.loads(meta[WEIGHTS_LAYERS]).items()}
    except (ValueError, TypeError, AttributeError):
        raise CheckpointError(f"{path}: its metadata {WEIGHTS_LAYERS!r} is not the {{layer: method}} object "
                              f"save_patched() writes; {REWRITE}") from None
    record = layer_methods(groups)
    if written != record:
        raise CheckpointError(
            f"{os.path.join(os.fspath(directory), PATCH_JSON)} says {_runs(record)}, but {path} holds the weights of "
            f"{_runs(written)}: the record was edited, or belongs to other weights; put it back as save_patched() "
            "wrote it (patch another method with longctx_patch.patch after loading), or save the model again")


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
        raise unreadable_weights(path, e, REWRITE) from None


def check_base_weights(model: nn.Module, directory: str | os.PathLike) -> None:
    """A CheckpointError naming the weights file(s) of `directory` (a folder save_patched() wrote) when parameters of
    the loaded `model` hold NaN or inf. One pass over every parameter (`finite`: ~0.1 s for SmolLM2-135M's 135M fp32
    parameters on one busy CPU core, 4% of its load; a GPU's bandwidth makes it milliseconds for billions), so the
    whole model is checked, not a sample. Buffers are not checked (they are computed, e.g. rotary frequencies)."""
    bad = [n for n, p in model.named_parameters() if p.is_floating_point() and not p.is_meta and not finite(p)]
    if not bad:
        return
    directory = os.fspath(directory)
    index = os.path.join(directory, "model.safetensors.index.json")
    files = ["model.safetensors"]
    if os.path.exists(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f).get("weight_map", {})
            files = sorted({weight_map[n] for n in bad if n in weight_map}) or files
        except (OSError, ValueError, AttributeError):
            pass
    where = ", ".join(os.path.join(directory, f) for f in files)
    raise CheckpointError(f"{where}: {shown_keys(bad)} hold NaN or inf values (the model was saved after a run diverged, "
                          "or the file was damaged); save it again from a model without them, e.g. an earlier "
                          "checkpoint of the run")


__all__ = ["OWN_WEIGHTS", "check_base_weights", "check_saved_files", "check_weights_header", "check_weights_record",
           "safetensors_problem"]
