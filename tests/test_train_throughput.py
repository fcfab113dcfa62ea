"""benchmarks/train/bench_train_throughput.py in its CPU smoke mode: both stages through the runner's step, and a merged file."""

from __future__ import annotations

import json

import torch


def test_train_throughput_smoke(tmp_path):
    from benchmarks.train import bench_train_throughput as train_throughput

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = train_throughput.main(["--device", "cpu", "--seq", "64", "--batch", "1", "--layers", "2", "--vocab", "512",
                                     "--dtype", "float32", "--steps", "1", "--warmup", "1", "--profile",
                                     "--out", str(tmp_path / "runs" / "a.json")])
    finally:
        torch.set_num_threads(n)
    res = json.loads(out.read_text())
    assert {"device", "date", "commit", "command"} <= res.keys()
    assert [r["stage"] for r in res["rows"]] == ["transfer", "lora"]
    for r in res["rows"]:
        assert "error" not in r, r
        assert r["tokens_per_step"] == 64 and r["tokens_per_s"] > 0
        assert set(r["breakdown_ms"]) == {"forward", "backward", "optimizer"}
        assert all(v >= 0 for v in r["breakdown_ms"].values())
        assert r["trainable_params"] > 0 and all(l == l for l in r["loss"])  # finite (not NaN)
        prof = r["profile"]  # one more step's ops by time: the GEMMs are there, and the kinds add up
        assert prof["by_kind_ms"]["gemm"] > 0 and prof["launches"] >= len(prof["top"]) > 0
        assert abs(sum(prof["by_kind_ms"].values()) - prof["total_ms"]) < 0.01 * prof["total_ms"] + 0.01
    merged = train_throughput.main(["--merge", str(tmp_path / "runs"), "--out", str(tmp_path / "all.json")])
    assert [r["stage"] for r in json.loads(merged.read_text())["rows"]] == ["transfer", "lora"]


def test_train_throughput_other_methods(tmp_path):
    """--method: the OVQ hybrid's two stages (OVQ on even layers, sliding window on the others) and the unpatched
    reference's LoRA stage alone (no method parameters trained)."""
    from benchmarks.train import bench_train_throughput as train_throughput

    common = ["--device", "cpu", "--seq", "64", "--batch", "1", "--layers", "2", "--vocab", "512", "--steps", "1",
              "--warmup", "0"]
    hyb = json.loads(train_throughput.main(common + ["--method", "ovq-hybrid", "--out", str(tmp_path / "h.json")])
                     .read_text())
    assert hyb["config"]["method"] == "ovq-hybrid" and hyb["config"]["recipe"] == "ovq-finetune.yaml"
    assert [r["stage"] for r in hyb["rows"]] == ["calibrate", "finetune"]
    assert hyb["rows"][0]["trainable_params"] == 9  # one inverse temperature per query head of the one OVQ layer
    ref = json.loads(train_throughput.main(common + ["--method", "none", "--out", str(tmp_path / "n.json")])
                     .read_text())
    (row,) = ref["rows"]
    assert row["stage"] == "finetune" and "error" not in row
    assert row["trainable_params"] == hyb["rows"][1]["trainable_params"] - 9  # the same LoRA, no temperatures
