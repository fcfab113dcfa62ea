"""The device machine's shell recipes (benchmarks/<group>/*.sh): each parses, and the helpers they source are defined
once, in train_text.sh (split_text, build_train_text, write_run_asset)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DEVICE = REPO / "benchmarks" / "train"  # train_text.sh and the recipes that source it
SCRIPTS = sorted((REPO / "benchmarks").rglob("*.sh"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_parses(script):
    r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_shared_helpers_defined_once_and_sourced_where_used():
    defs = {}
    for s in SCRIPTS:
        for name in re.findall(r"^(\w+)\(\) \{", s.read_text(), re.M):
            defs.setdefault(name, []).append(s.name)
    for name in ("split_text", "build_train_text", "write_run_asset"):
        assert defs.get(name) == ["train_text.sh"], (name, defs.get(name))
    for s in SCRIPTS:
        text = s.read_text()
        if s.name != "train_text.sh" and re.search(r"^\s*(split_text|build_train_text|write_run_asset)\b", text, re.M):
            assert "train_text.sh" in text, f"{s.name} calls a helper of train_text.sh without sourcing it"


def test_ovq_mixed_refuses_unknown_variants(tmp_path):
    """The usage errors come before any work (no model, no text needed)."""
    r = subprocess.run(["bash", str(DEVICE / "ovq_mixed.sh"), "train", str(tmp_path)], capture_output=True, text=True,
                       cwd=DEVICE.parents[1])
    assert r.returncode == 2 and "name at least one variant" in r.stderr
    r = subprocess.run(["bash", str(DEVICE / "ovq_mixed.sh"), "train", str(tmp_path), "all", "base"],
                       capture_output=True, text=True, cwd=DEVICE.parents[1])
    assert r.returncode == 2 and "unknown step or variant: train base" in r.stderr


def test_ovq_variants_as_recipe_options():
    """train_text.sh's OVQ_HYBRID and lora_only_stage, as the scripts pass them, load as recipe overrides: the
    hybrid's layers and rest method, and the LoRA-only reference stage (with later --set still applied to it)."""
    from longctx_patch.train.recipe import load_recipe

    root = DEVICE.parents[1]
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")  # its python3
    out = subprocess.run(["bash", "-c", '. benchmarks/train/train_text.sh && printf "%s\\n" "${OVQ_HYBRID[@]}" '
                          '&& echo --set && lora_only_stage'], capture_output=True, text=True, cwd=root, env=env)
    assert out.returncode == 0, out.stderr
    args = out.stdout.splitlines()
    sets = [a for i, a in enumerate(args) if i % 2 == 1 and args[i - 1] == "--set"]
    assert len(sets) == 4
    hyb = load_recipe(root / "recipes" / "ovq-finetune.yaml", sets[:3])
    assert hyb.layers == list(range(0, 30, 2)) and hyb.rest_method == "sliding-window" and hyb.rest_config == {"window": 256}
    qwen = subprocess.run(["bash", "-c", '. benchmarks/train/train_text.sh && printf "%s\\n" "${OVQ_HYBRID[@]}"'],
                          capture_output=True, text=True, cwd=root, env=dict(env, OVQ_HYBRID_LAYERS="[0,2,4,6,8,10,12,14,16,18,20,22]"))
    qargs = qwen.stdout.splitlines()
    assert load_recipe(root / "recipes" / "ovq-finetune.yaml", qargs[1::2]).layers == list(range(0, 24, 2))  # Qwen's 24
    ref = load_recipe(root / "recipes" / "ovq-finetune.yaml", ["method=null", "method_config={}", sets[3],
                                                              "stages.finetune.steps=7"])
    (stage,) = ref.stages
    assert ref.method is None and stage.name == "finetune" and stage.trainable == ["lora"] and stage.steps == 7
