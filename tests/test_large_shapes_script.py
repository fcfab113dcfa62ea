"""benchmarks/ops/check_large_shapes.py without a GPU: its case list, argument parsing and how it reads a child process
(the kernels at those shapes run on the H200 only; `--smoke` runs every case tiny on the CPU, ~3 min, by hand)."""

import json

import pytest

from benchmarks.ops import check_large_shapes as ls


def test_every_case_has_a_function_and_a_timeout_under_ten_minutes_in_all():
    assert all(callable(getattr(ls, f"case_{name}", None)) for name in ls.CASES)
    assert {"lola_prefill", "lolcats_hybrid", "decode_exact", "muse_prefill", "ovq_prefill"} <= set(ls.CASES)
    assert sum(t for _, t in ls.CASES.values()) < 600


def test_parse_args_and_command():
    a = ls.parse_args(["--only", "lola_prefill,decode_exact", "--memcheck"])
    assert a.cases == ["lola_prefill", "decode_exact"] and a.memcheck
    assert ls.child_command("lola_prefill", True)[:3] == ["compute-sanitizer", "--tool", "memcheck"]
    assert ls.child_command("lola_prefill", False)[-2:] == ["--child", "lola_prefill"]
    assert ls.parse_args([]).cases == list(ls.CASES)
    with pytest.raises(SystemExit):
        ls.parse_args(["--only", "lola_prefill,nope"])


def test_list_needs_no_gpu(capsys):
    assert ls.main(["--list"]) == 0
    assert len(capsys.readouterr().out.strip().splitlines()) == len(ls.CASES)


def test_parse_child_statuses():
    line = "LARGE_SHAPES " + json.dumps({"case": "x", "status": "ok", "row_rel_diff": 0.0})
    assert ls.parse_child("x", 0, "noise\n" + line, "", 1.0)["status"] == "ok"
    assert ls.parse_child("x", -11, "", "Segmentation fault", 1.0)["status"] == "crash"
    assert ls.parse_child("x", None, "", "", 60.0)["status"] == "timeout"
    assert ls.parse_child("x", 99, line, "========= Invalid __global__ read", 1.0)["status"] == "memcheck"
    bad = ls.parse_child("x", 1, line.replace('"ok"', '"mismatch"'), "err", 1.0)
    assert bad["status"] == "mismatch" and bad["stderr_tail"] == "err"


def test_status_of_the_row_comparison():
    assert ls._status({"finite": True, "row_rel_diff": 0.0, "inner": {"finite": True, "row_rel_diff": 1e-6}}) == "ok"
    assert ls._status({"finite": True, "row_rel_diff": 0.5}) == "mismatch"
    assert ls._status({"finite": True, "row_rel_diff": 0.0, "state": {"finite": False}}) == "nonfinite"
