"""One result record: longctx_patch/provenance.py spells the device, date, commit and command of every result, and
nothing else in the tree defines its own."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import torch

from longctx_patch import provenance
from longctx_patch.provenance import DEVICE_SPELLING, command_line, device_description, result_header

REPO = Path(__file__).resolve().parents[1]


def test_the_device_of_this_machine_in_the_one_spelling():
    one = device_description("cpu")
    assert DEVICE_SPELLING.fullmatch(one), one
    assert one.startswith("CPU (") and f"{torch.get_num_threads()} thread" in one
    assert device_description("cpu", world=2) == f"2 x {one}"
    assert DEVICE_SPELLING.fullmatch(device_description())


def test_the_spelling_refuses_the_old_ones():
    for ok in ("NVIDIA H200", "NVIDIA H100 80GB HBM3", "2 x NVIDIA H200", "CPU", "CPU (x86_64, 2 cores)",
               "CPU (x86_64, 2 cores, 1 thread)", "AMD Instinct MI300X"):
        assert DEVICE_SPELLING.fullmatch(ok), ok
    for old in ("cuda: NVIDIA H200", "cpu", "cpu: x86_64 (2 cores, 2 threads)", "NVIDIA H200 x2 (one host)",
                "NVIDIA H200 (speed); errors on the same GPU", "cpu (smoke run)", ""):
        assert not DEVICE_SPELLING.fullmatch(old), old


def test_command_line(monkeypatch):
    assert command_line(["/usr/bin/longctx", "eval", "niah", "--name", "a b"]) == "longctx eval niah --name 'a b'"
    monkeypatch.setattr(sys, "orig_argv", ["/usr/bin/python3", "-u", "-m", "benchmarks.ops.bench_window", "--x", "1"])
    assert command_line() == "python3 -m benchmarks.ops.bench_window --x 1"
    monkeypatch.setattr(sys, "orig_argv", ["/venv/bin/python", "/venv/bin/longctx", "info"])
    monkeypatch.setattr(sys, "argv", ["/venv/bin/longctx", "info"])
    assert command_line() == "longctx info"


def test_result_header(monkeypatch):
    monkeypatch.setenv("LONGCTX_COMMIT", "abc1234")
    provenance.git_commit.cache_clear()
    try:
        head = result_header(device="cpu", command="longctx eval ppl")
    finally:
        provenance.git_commit.cache_clear()
    assert list(head) == ["device", "date", "commit", "command"]
    assert head["device"] == device_description("cpu") and head["commit"] == "abc1234"
    assert head["command"] == "longctx eval ppl" and re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", head["date"])


def test_no_other_module_defines_them():
    """device_description and command_line exist once (they were in train/runner.py and evals/common.py, with
    different spellings); the scripts that cannot import the package (bench_peers_kvpress.py runs in kvpress's
    environment) keep the spelling by hand."""
    found = []
    for root in (REPO / "longctx_patch", REPO / "benchmarks"):
        for p in root.rglob("*.py"):
            for node in ast.walk(ast.parse(p.read_text())):
                if isinstance(node, ast.FunctionDef) and node.name in ("device_description", "command_line"):
                    found.append(f"{p.relative_to(REPO).as_posix()}:{node.name}")
    assert sorted(found) == ["longctx_patch/provenance.py:command_line", "longctx_patch/provenance.py:device_description"]


def test_results_are_written_through_it(tmp_path):
    """The evaluations' result files and the fine-tune runner's summary take their header from result_header."""
    from longctx_patch.evals.common import write_result

    rec = __import__("json").loads(write_result(tmp_path / "r.json", task="t", model="m", runs=[], figures={},
                                                command="c").read_text())
    assert DEVICE_SPELLING.fullmatch(rec["device"]) and rec["command"] == "c"
    src = (REPO / "longctx_patch" / "train" / "runner.py").read_text()
    assert "result_header(" in src and "get_device_name" not in src
