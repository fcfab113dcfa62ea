"""benchmarks/ops/bench_lola_sets.py without a GPU: a small run writes its record, and the linear-time pass it times
agrees with the dense one it is timed against (outputs and every gradient)."""

import json

from benchmarks.ops import bench_lola_sets as bench


def test_a_small_cpu_run_writes_agreeing_passes(tmp_path):
    out = tmp_path / "sets.json"
    assert bench.main(["--device", "cpu", "--lengths", "203,256", "--heads", "4", "--kv-heads", "2", "--window", "24",
                       "--sparse-cache", "16", "--chunk", "8", "--block", "64", "--dtype", "float32",
                       "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["task"] == "lola-train-sets" and res["device"].startswith("CPU") and res["commit"]
    assert [r["seq_len"] for r in res["rows"]] == [203, 256]
    for r in res["rows"]:
        assert max(r["rel_err_vs_dense"].values()) < 1e-5
        assert r["dense_fwd_bwd_ms"] > 0 and r["linear_fwd_bwd_ms"] > 0 and r["sparse_positions_ms"] > 0
        assert r["sparse_positions_loop_ms"] > 0 and r["sets_equal_loop"] and not r["sparse_positions_kernels"]
