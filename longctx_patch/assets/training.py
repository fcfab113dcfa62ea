"""A linearize run as a packaged asset with its training record (what `asset.json`'s "training" holds).

    package_run(RUN, model, OUT, name=..., description=..., corpus=CORPUS/corpus.json)

RUN is a `longctx finetune` output folder (its `trainable/` and `train_log.json`, the log of the last command: each
stage's entry keeps the text it read and the commands that ran it, also across `--resume`); `model` the base model
the run started from (its shape and embedding fingerprint are what `checkpoint=auto` matches); `corpus` the
corpus.json of `benchmarks.data.build_corpus build` when the text came from such a corpus: the record then names,
for each set a stage read, its documents and tokens by kind (code / prose) and by source, and the held-out sets the
training never read. Nothing is trained or measured here; `python -m longctx_patch.train.package` is the command.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError

STAGE_KEYS = ("name", "objective", "trainable", "steps", "steps_done", "batch_size", "seq_len", "grad_accum", "lr",
              "tokens", "time_s", "tokens_per_s", "steady_tokens_per_s", "peak_memory_gib", "estimated_peak_gib",
              "first_loss", "final_loss", "final_eval_loss", "stopped_early", "commands")
# the names a run of the embedded models packages its asset under (the alias of `models.EMBEDDED` -> asset folder)
ASSET_NAMES = {"smollm2-135m": "smollm2-135m-instruct-lolcats",
               "qwen2.5-coder-0.5b": "qwen2.5-coder-0.5b-instruct-lolcats"}


def _read_json(path: Path, if_missing: str, if_unreadable: str) -> Any:
    """The JSON at `path`; a CheckpointError saying what to do when it is missing or unreadable."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} not found: {if_missing}") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} cannot be read ({type(e).__name__}); {if_unreadable}") from None


def read_train_log(run_dir: str | os.PathLike) -> dict[str, Any]:
    path = Path(run_dir) / "train_log.json"
    log = _read_json(path, "pass the output folder of a `longctx finetune` run", "copy the run's folder again")
    if not isinstance(log, dict) or not isinstance(log.get("stages"), list):
        raise CheckpointError(f"{path} is not a fine-tune log (no \"stages\")")
    if log.get("stopped_after"):
        raise CheckpointError(f"{path}: the run stopped after stage {log['stopped_after']!r}; finish it (the same "
                              "command with --resume) before packaging it")
    unfinished = [s["name"] for s in log["stages"] if s.get("steps_done", 0) < s.get("steps", 0)
                  and not s.get("stopped_early")]
    if unfinished:
        raise CheckpointError(f"{path}: stage(s) {', '.join(unfinished)} did not run all their steps; finish the run "
                              "(the same command with --resume) before packaging it")
    return log


def _set_name(source: str | None, sets: dict[str, Any]) -> str | None:
    """The corpus set a stage's text source is (its folder, e.g. /tmp/corpus/train-a -> train-a)."""
    if not source:
        return None
    parts = Path(source).parts
    for n in range(min(2, len(parts)), 0, -1):
        name = "/".join(parts[-n:])
        if name in sets:
            return name
    return None


def text_mix(stages: list[dict[str, Any]], corpus: dict[str, Any] | None) -> dict[str, Any]:
    """Which text the stages read: per set (a corpus set, or the source as given), its documents and tokens, by kind
    and by source where corpus.json says, the stages that read it and the share of it each drew."""
    sets = (corpus or {}).get("sets", {})
    read: dict[str, dict[str, Any]] = {}
    for s in stages:
        text = s.get("text") or {}
        name = _set_name(text.get("source"), sets) or text.get("source") or "unknown"
        entry = read.setdefault(name, {"source": text.get("source"), "documents": text.get("documents"),
                                       "tokens": text.get("tokens"), "sha256": text.get("sha256"), "read_by": []})
        if text.get("sha256") and entry["sha256"] and text["sha256"] != entry["sha256"]:
            raise CheckpointError(f"stages {entry['read_by']} and {s['name']} read {name} with different contents "
                                  f"(sha256 {entry['sha256'][:12]} / {text['sha256'][:12]}); package runs of one corpus")
        share = s.get("tokens", 0) / text["tokens"] if text.get("tokens") else None
        entry["read_by"].append({"stage": s["name"], "tokens": s.get("tokens"),
                                 "share": None if share is None else round(share, 4)})
        if name in sets:
            kinds: dict[str, int] = {}
            for src in sets[name].get("by_source", {}).values():
                kinds[src["kind"]] = kinds.get(src["kind"], 0) + src["tokens"]
            entry.update(kinds=kinds, by_source=sets[name].get("by_source", {}))
    out: dict[str, Any] = {"sets": read}
    out["distinct_tokens"] = sum(e["tokens"] or 0 for e in read.values())
    out["max_reads"] = max((sum(1 for _ in e["read_by"]) for e in read.values()), default=0)
    if corpus:
        out["heldout"] = {k: {"documents": len(v.get("documents", [])), "tokens": v.get("tokens")}
                          for k, v in sets.items() if k.startswith("heldout")}
        out["corpus"] = {k: corpus[k] for k in ("built", "command", "python", "tokenizer", "pack", "settings",
                                                "train_tokens") if k in corpus}
        sel = corpus.get("code_selection", {})
        out["corpus"]["code_roots"] = sel.get("roots")
    return out


def training_record(log: dict[str, Any], corpus: dict[str, Any] | None = None) -> dict[str, Any]:
    """asset.json's "training": totals (tokens, steps, training time), the device, date, commit and commands of the
    run, each stage's settings and results, and the text mix (`text_mix`)."""
    stages = log["stages"]
    commands = []
    for s in stages:
        for c in s.get("commands") or []:
            if c not in commands:
                commands.append(c)
    if log.get("command") and log["command"] not in commands:
        commands.append(log["command"])
    return {
        "tokens": int(sum(s.get("tokens", 0) for s in stages)),
        "steps": int(sum(s.get("steps_done", 0) for s in stages)),
        "time_s": round(float(sum(s.get("time_s", 0.0) for s in stages)), 1),
        "device": log.get("device"),
        "date": log.get("date"),
        "commit": log.get("commit"),
        "model": log.get("model"),
        "mixed_precision": log.get("mixed_precision"),
        "commands": commands,
        "stages": [{k: s.get(k) for k in STAGE_KEYS} | {"text": (s.get("text") or {}).get("source")} for s in stages],
        "text": text_mix(stages, corpus),
    }


def lineage(asset_dir: str | os.PathLike) -> dict[str, Any]:
    """What the asset a run continued (its `method_config.checkpoint`, e.g. recipes/linearize-qwen-lola.yaml's)
    passes on to the asset of that run: `based_on` (its name, commit, recipe, description and training record, and
    its own `based_on`: the whole chain of runs behind the new weights) and its measured `method_defaults`, which
    the new asset keeps until it is measured itself (`method_defaults_why` says where they come from)."""
    from . import ASSET_JSON

    path = Path(asset_dir) / ASSET_JSON
    info = _read_json(path, "pass the folder of the packaged asset the run continued", "copy the asset folder again")
    if not isinstance(info, dict):
        raise CheckpointError(f"{path} is not an asset description (an object)")
    name = info.get("name", Path(asset_dir).name)
    out: dict[str, Any] = {"based_on": {"name": name, **{k: info.get(k) for k in ("commit", "recipe", "description",
                                                                                   "training", "based_on")}}}
    if info.get("method_defaults"):
        out["method_defaults"] = info["method_defaults"]
        out["method_defaults_why"] = (f"carried over from the asset these weights continue ({name}, commit "
                                      f"{info.get('commit')}), not yet measured on this one; there: "
                                      f"{info.get('method_defaults_why', 'no reason recorded')}")
    return out


def package_run(run_dir: str | os.PathLike, model, out_dir: str | os.PathLike, *, name: str, description: str,
                corpus: str | os.PathLike | dict | None = None, dtype: torch.dtype = torch.float16,
                extra: dict[str, Any] | None = None, based_on: str | os.PathLike | None = None) -> Path:
    """The asset folder of a finished linearize run (`write_asset`) with its training record in asset.json; `based_on`:
    the packaged asset the run continued (`lineage`). A run that trained no adapter of its own on top of an asset
    that has one (a transfer of the maps with the asset's LoRA merged and frozen) keeps that adapter: the maps were
    fitted with it in place."""
    from ..checkpoint import ADAPTER_DIR
    from . import write_asset

    log = read_train_log(run_dir)
    if corpus is not None and not isinstance(corpus, dict):
        corpus = json.loads(Path(corpus).read_text())
    record = training_record(log, corpus)
    info = {"commit": record["commit"], "training": record, **(lineage(based_on) if based_on else {}), **(extra or {})}
    out = write_asset(run_dir, model, out_dir, name=name, description=description, dtype=dtype, extra=info)
    theirs = Path(based_on) / ADAPTER_DIR if based_on else None
    if theirs is not None and (theirs / "adapter_config.json").exists() and not (out / ADAPTER_DIR).exists():
        shutil.copytree(theirs, out / ADAPTER_DIR)  # write_asset wrote none: the run trained no adapter of its own
    return out


__all__ = ["ASSET_NAMES", "lineage", "package_run", "read_train_log", "text_mix", "training_record"]
