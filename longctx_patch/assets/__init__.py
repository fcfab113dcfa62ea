"""Packaged trained weights of the `lolcats` / `lola` methods for models we ship them for.

An asset is a folder holding what a `longctx finetune recipes/linearize.yaml` run saved under `trainable/`
(`longctx_patch.safetensors`: feature maps + window factors; `adapter/`: the PEFT LoRA adapter) and an
`asset.json` describing the base model it was trained on: its shape and a fingerprint of its token
embeddings, so that `checkpoint=auto` (the default of `lolcats` and `lola`) picks the asset only for that
model. Folders are searched first in every folder of the environment variable LONGCTX_ASSET_PATH
(os.pathsep-separated), so that a newly trained asset takes precedence, then in the package's own `assets/`.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from ..checkpoint import (ADAPTER_DIR, PATCH_JSON, PATCH_WEIGHTS, TRAINABLE_DIR, read_adapter_weights,
                          read_method_weights, read_patch_record)
from ..errors import CheckpointError

ASSET_JSON = "asset.json"
ENV_PATH = "LONGCTX_ASSET_PATH"
PACKAGE_DIR = Path(__file__).resolve().parent
SHAPE_KEYS = ("model_type", "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
              "head_dim", "vocab_size")
FINGERPRINT_ROWS = (0, 1, 2, 13, 100, 1000, 4096, 10000, 30000)
FINGERPRINT_COLS = 32
MIN_COSINE = 0.98  # the fingerprint of a re-quantised or differently rounded copy of the same model still matches
# the methods whose weights an asset holds: those of `Method.lolcats_layout` (the assets lie below the methods, which
# import them, so the layout's methods are named here; tests/test_assets.py holds the two to one list)
LOLCATS_LAYOUT = ("lolcats", "lola")


@dataclass
class Asset:
    path: Path
    info: dict[str, Any]

    @property
    def name(self) -> str:
        return self.info.get("name", self.path.name)


def search_dirs() -> list[Path]:
    dirs = [Path(d.strip()).expanduser() for d in os.environ.get(ENV_PATH, "").split(os.pathsep) if d.strip()]
    return dirs + [PACKAGE_DIR]


def iter_assets() -> Iterator[Asset]:
    for d in search_dirs():
        if not d.is_dir():
            continue
        for sub in sorted(d.iterdir()):
            meta = sub / ASSET_JSON
            if meta.is_file():
                try:
                    info = json.loads(meta.read_text())
                except (OSError, json.JSONDecodeError):
                    continue
                yield Asset(sub, info)


def _model_config(model):
    cfg = getattr(model, "config", None)
    return getattr(cfg, "text_config", None) or cfg


def model_shape(model) -> dict[str, Any]:
    cfg = _model_config(model)
    out = {k: getattr(cfg, k, None) for k in SHAPE_KEYS}
    if out["head_dim"] is None and out["hidden_size"] and out["num_attention_heads"]:
        out["head_dim"] = out["hidden_size"] // out["num_attention_heads"]
    return out


def fingerprint(model) -> list[float] | None:
    """A few rows of the input embedding (first FINGERPRINT_COLS columns), or None without embeddings."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    w = getattr(emb, "weight", None)
    if w is None or w.dim() != 2 or w.is_meta:  # no embeddings, or weights not materialised yet
        return None
    rows = [r for r in FINGERPRINT_ROWS if r < w.shape[0]]
    cols = min(FINGERPRINT_COLS, w.shape[1])
    return w.detach()[rows, :cols].float().cpu().reshape(-1).tolist()


def _cosine(a: list[float], b: list[float]) -> float:
    if len(a) != len(b) or not a:
        return -1.0
    ta, tb = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return float(torch.nn.functional.cosine_similarity(ta, tb, dim=0))


def mismatch(asset: Asset, model) -> str | None:
    """Why `asset` was not trained for `model` (another shape; the same shape with other weights: the embedding
    fingerprint's cosine similarity below MIN_COSINE; no embedding to compare), or None when it was."""
    shape, want = model_shape(model), asset.info.get("model_shape") or {}
    diff = [f"{k} {want.get(k)!r} (this model: {shape.get(k)!r})" for k in SHAPE_KEYS if want.get(k) != shape.get(k)]
    if diff:
        return "it was trained for a model with " + ", ".join(diff)
    fp = fingerprint(model)
    if fp is None:
        return "this model's input embedding cannot be read (not materialised), so it cannot be matched"
    cos = _cosine(fp, asset.info.get("fingerprint") or [])
    if cos < MIN_COSINE:
        return (f"it was trained for a model of this shape with other weights (embedding fingerprint cosine "
                f"{cos:.3f}, below {MIN_COSINE})")
    return None


def find_asset(model, method_config, kind: str = "lolcats") -> Asset | None:
    """The first asset of `kind` trained for `model` (same shape, embedding fingerprint with cosine similarity
    >= MIN_COSINE) with the same feature_dim as `method_config`; None when there is none."""
    shape = model_shape(model)
    for a in iter_assets():
        want = a.info.get("method_config", {})
        if a.info.get("kind") != kind or a.info.get("model_shape") != shape:
            continue
        if "feature_dim" in want and getattr(method_config, "feature_dim", None) != want["feature_dim"]:
            continue
        if mismatch(a, model) is None:
            return a
    return None


def check_asset_for(path: str | os.PathLike, model) -> None:
    """`checkpoint=PATH` naming an asset folder (one holding asset.json): a CheckpointError when it was trained for
    another model (`mismatch`), before any of its weights is loaded. Other paths are left to the checkpoint reader."""
    p = Path(path)
    meta = p / ASSET_JSON
    if not meta.is_file():
        return
    try:
        info = json.loads(meta.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{meta} cannot be read ({type(e).__name__}); copy the asset folder again") from None
    if not isinstance(info, dict):
        raise CheckpointError(f"{meta} is not an asset description (an object); copy the asset folder again")
    why = mismatch(Asset(p, info), model)
    if why is not None:
        raise CheckpointError(f"{p} is the asset {info.get('name', p.name)!r}, not for this model: {why}. Load it "
                              "into the model it was trained for, pass checkpoint='auto' (an asset trained for this "
                              "model, else fresh feature maps) or checkpoint='none', or train this model's weights "
                              "(longctx finetune recipes/linearize.yaml)")


def write_asset(trainable_dir: str | os.PathLike, model, out_dir: str | os.PathLike, *, name: str,
                description: str, dtype: torch.dtype = torch.float16, extra: dict[str, Any] | None = None) -> Path:
    """Turns the `trainable/` folder of a linearize run into an asset folder: weights cast to `dtype`
    (float16 by default: half the bytes, well within the methods' tolerances), the adapter config, and an
    `asset.json` with the model's shape and fingerprint (`model` = the base model the run started from)."""
    from safetensors.torch import save_file

    src = Path(trainable_dir)
    if (src / TRAINABLE_DIR).is_dir():
        src = src / TRAINABLE_DIR
    weights = src / PATCH_WEIGHTS
    rec = src / PATCH_JSON
    if not weights.exists() or not rec.exists():
        raise CheckpointError(f"{src} lacks {PATCH_WEIGHTS}/{PATCH_JSON}; pass a linearize run's output folder or "
                              "its trainable/ subfolder")
    groups = read_patch_record(src)  # one group, or several (a hybrid: "patches")
    methods = {g["method"] for g in groups}
    if methods - set(LOLCATS_LAYOUT):
        raise CheckpointError(f"{src} was trained with {sorted(methods)}; assets hold {'/'.join(LOLCATS_LAYOUT)} "
                              "weights only")
    dims = sorted({g["config"].get("feature_dim") for g in groups}, key=str)
    if len(dims) > 1:
        raise CheckpointError(f"{src}: its patches use feature_dim {dims}; an asset holds feature maps of one "
                              "feature_dim (checkpoint=auto matches on it): train the layers with one feature_dim")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    def cast(sd):
        return {k: v.to(dtype).contiguous() for k, v in sd.items()}

    save_file(cast(read_method_weights(src)), str(out / PATCH_WEIGHTS))
    record = json.loads(rec.read_text())
    record.pop("files", None)  # the sizes of the run folder's files, which the asset does not hold all of
    (out / PATCH_JSON).write_text(json.dumps(record, indent=2))
    adapter = src / ADAPTER_DIR
    if (adapter / "adapter_config.json").exists():
        (out / ADAPTER_DIR).mkdir(exist_ok=True)
        shutil.copy(adapter / "adapter_config.json", out / ADAPTER_DIR / "adapter_config.json")
        save_file(cast(read_adapter_weights(src)), str(out / ADAPTER_DIR / "adapter_model.safetensors"))
    # the options every patch of the run agrees on (feature_dim always: checked above)
    cfg = {k: v for k, v in groups[0]["config"].items() if all(g["config"].get(k, v) == v for g in groups)}
    info = {
        "name": name,
        "kind": "lolcats",
        "description": description,
        "model_shape": model_shape(model),
        "fingerprint": fingerprint(model),
        "method_config": {k: cfg[k] for k in ("window", "feature_dim", "affine_factors") if k in cfg},
        "dtype": str(dtype).replace("torch.", ""),
        **(extra or {}),
    }
    (out / ASSET_JSON).write_text(json.dumps(info, indent=2) + "\n")
    return out


__all__ = ["LOLCATS_LAYOUT", "Asset", "check_asset_for", "find_asset", "fingerprint", "iter_assets", "mismatch", "search_dirs",
           "write_asset"]
