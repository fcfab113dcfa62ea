"""The device machine's shell recipes (evals/device/*.sh): each parses, and the helpers they source are defined
once, in train_text.sh (split_text, build_train_text, write_run_asset)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

DEVICE = Path(__file__).resolve().parents[1] / "evals" / "device"
SCRIPTS = sorted(DEVICE.glob("*.sh"))


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
