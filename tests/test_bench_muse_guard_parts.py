"""benchmarks/ops/bench_muse_guard_parts.py on a CPU at a small shape: every part timed, the parts' arithmetic, the
kernel table, the result's provenance."""

import json

from benchmarks.ops import bench_muse_guard_parts


def test_profile_runs_and_records_each_part(tmp_path):
    out = tmp_path / "p.json"
    assert bench_muse_guard_parts.main(["--device", "cpu", "--dtype", "float32", "--lengths", "1024", "--block-size", "32",
                                    "--heads", "4", "--kv-heads", "2", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["task"] == "muse-guard-profile" and {"device", "date", "commit", "command"} <= set(res)
    row, = res["rows"]
    ms = row["ms"]
    assert row["first"] < 1024 and row["sampled"] >= row["rows"]
    for name in ("muse", "exact_sdpa", "estimate", "estimate_ops", "estimate_sample", "estimate_rows_attention",
                 "guard_no_head", "guard_no_head_ops", "exact_heads_1", "exact_heads_2", "exact_heads_4"):
        assert ms[name] > 0, name
    assert ("estimate_kernel_sample" in ms) == row["guard_kernels_run"]
    assert abs(ms["estimate_ops_rest"] - (ms["estimate_ops"] - ms["estimate_sample"] - ms["estimate_rows_attention"])) < 1e-9
    table = row["estimate_ops_kernels"]
    assert table["by"] == "self_cpu_us" and table["top"] and any("topk" in r["name"] for r in table["top"])
    assert row["estimate_kernels"]["top"] and row["estimate_vs_ops_same_nan"] and row["estimate_vs_ops_max_abs"] < 1e-5
