"""benchmarks/quality/bench_muse_vs_moba.py runs on the CPU (--smoke: SmolLM2's real Q/K/V at 1k tokens, small blocks,
the Triton interpreter) and writes its JSON and plot; its settings match the budgets in exactly attended keys."""

import json
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from benchmarks.quality import bench_muse_vs_moba as bench  # noqa: E402
from longctx_patch.kernels.moba import moba_attended_keys  # noqa: E402
from longctx_patch.kernels.muse import attended_keys  # noqa: E402


@pytest.mark.parametrize("method", bench.METHODS)
@pytest.mark.parametrize("S,keys", [(32768, 2048), (65536, 4096), (65536, 12288)])
def test_each_method_takes_the_setting_nearest_the_budget(method, S, keys):
    blocks = dict(moba_block=512, muse_block=256, k_clusters=8, q_clusters=256)
    cfg, exact, sup = bench.settings(method, S, keys, **blocks)
    counted = moba_attended_keys(S, **cfg) if method == "moba" else attended_keys(S, **cfg)[0]
    assert counted == exact
    step = 512 if method == "moba" else 256  # one more or one fewer exact block changes the count by about a block
    assert abs(exact - keys) <= step
    assert (sup == 0) == (method == "moba")


@pytest.mark.slow
def test_the_smoke_run_writes_its_result_and_plot(tmp_path):
    from longctx_patch.provenance import device_description

    assert bench.main(["--smoke", "--layers", "15", "--out", str(tmp_path)]) == 0
    path = tmp_path / "muse-vs-moba-smollm2-135m-smoke-cpu.json"
    res = json.loads(path.read_text())
    assert {"device", "date", "commit", "command"} <= set(res) and res["device"] == device_description("cpu")
    assert res["layers"] == [15] and res["seqs"] == [1024] and not res["skipped"]
    assert sorted({r["method"] for r in res["rows"]}) == sorted(bench.METHODS)
    for r in res["rows"]:
        assert 0 < r["error"] < 1 and r["fwd_ms"] > 0 and len(r["error_per_layer"]) == 1
    # at equal keys (within a block) MuSe's error is below MoBA's on these Q/K/V
    assert set(res["ratios_vs_moba"]) == {"1024/cells", "1024/tilted-cells"}
    assert all(v["max_ratio"] < 1 for v in res["ratios_vs_moba"].values())
    assert path.with_suffix(".png").stat().st_size > 10000
