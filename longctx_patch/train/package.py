"""`python -m longctx_patch.train.package`: a finished linearize run as a packaged asset folder with its training
record (`assets.training.package_run`), checked by loading it back with checkpoint=auto."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from .. import patch
from ..assets import ENV_PATH
from ..assets.training import ASSET_NAMES, package_run, read_train_log
from ..models import load_model_only
from ..patcher import patched_modules

USAGE = """A finished linearize run as a packaged asset folder with its training record, checked with checkpoint=auto.

    python -m longctx_patch.train.package RUN --model MODEL --out DIR [--corpus CORPUS/corpus.json]
        [--name NAME] [--description TEXT] [--recipe recipes/linearize-qwen.yaml] [--based-on ASSET] [--check]

RUN: the `longctx finetune` output folder (trainable/ and train_log.json); MODEL: the base model the run started
from (the same string the run was given: /tmp/qwen-hf on the GPU machine, the alias qwen2.5-coder-0.5b elsewhere);
the asset is written to DIR/NAME (NAME: the embedded model's asset name for a Qwen or SmolLM2 model). `--based-on`:
the packaged asset the run continued (recipes/linearize-qwen-lola.yaml's checkpoint): its measured method defaults
carry over and its own record is kept as `based_on`. `--check` then patches the model with lolcats, checkpoint=auto
and DIR on LONGCTX_ASSET_PATH, and fails unless the asset it loads is DIR/NAME (not an asset of the same name
elsewhere, e.g. the one shipped). Copy DIR/NAME into longctx_patch/assets/ to ship it.
"""


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m longctx_patch.train.package", description=USAGE,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run")
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True, help="folder the asset folder is written into")
    p.add_argument("--corpus", default=None, help="corpus.json of the text the run read")
    p.add_argument("--name", default=None)
    p.add_argument("--description", default=None)
    p.add_argument("--recipe", default="recipes/linearize-qwen.yaml")
    p.add_argument("--based-on", default=None, help="the packaged asset folder the run continued")
    p.add_argument("--check", action="store_true", help="load it back with checkpoint=auto")
    a = p.parse_args(argv)

    low = a.model.lower()  # an alias, or a folder such as /tmp/qwen-hf
    name = a.name or ASSET_NAMES.get(a.model) or next((v for k, v in ASSET_NAMES.items() if k[:4] in low), None)
    if name is None:
        p.error("--name is needed for a model that is not an embedded alias")
    log = read_train_log(a.run)
    what = f"{log.get('model')} linearized by {a.recipe}"
    if a.based_on:  # the model as its earlier asset names it, not the folder it was read from on the device
        what = f"the asset {Path(a.based_on).name} (its record: based_on) with its training continued by {a.recipe}"
    description = a.description or (
        f"{what} on {log.get('device')}: "
        + ", ".join(f"{s['name']} {s['steps_done']} steps x {s['batch_size']} x {s['seq_len']}" for s in log["stages"])
        + f"; {sum(s['tokens'] for s in log['stages']) / 1e6:.1f}M tokens. float16.")
    model = load_model_only(a.model, device="cpu")
    out = package_run(a.run, model, Path(a.out) / name, name=name, description=description, corpus=a.corpus,
                      extra={"recipe": a.recipe}, based_on=a.based_on)
    print(f"asset: {out}")
    if a.check:
        os.environ[ENV_PATH] = str(Path(a.out).resolve()) + os.pathsep + os.environ.get(ENV_PATH, "")
        layers = sorted({int(k.split(".")[1]) for k in _keys(out)})
        fdim = json.loads((out / "asset.json").read_text())["method_config"].get("feature_dim")  # auto matches on it
        patch(model, "lolcats", layers=layers, **({"feature_dim": fdim} if fdim else {}))
        src = patched_modules(model)[layers[0]].weights_source
        print(f"checkpoint=auto on layers {layers[0]}..{layers[-1]}: {src}")
        if not src.startswith(f"packaged asset {name} ({Path(a.out).resolve() / name})"):
            print(f"checkpoint=auto did not load {Path(a.out).resolve() / name}")
            return 1
        with torch.no_grad():  # a forward of the loaded asset (finite logits)
            logits = model(torch.arange(100, 164)[None]).logits
        if not torch.isfinite(logits).all():
            print("the patched model's logits are not finite")
            return 1
    return 0


def _keys(asset_dir: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(asset_dir / "longctx_patch.safetensors"), framework="pt") as f:
        return list(f.keys())


__all__ = ["main"]


if __name__ == "__main__":
    sys.exit(main())
