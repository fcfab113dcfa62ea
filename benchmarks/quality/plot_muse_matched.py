"""Error against speed at matched sparsity (about 4.2k exactly attended keys per query) from measured results (no GPU
needed): MoBA, MuSe `cells`, `tilted-cells` and the per-block `tilted` design. Error: mean relative error of the
attention output over Qwen2.5-Coder-0.5B's 24 layers at 32k tokens, bf16 (`benchmarks/quality/bench_muse_fidelity.py
--matched 4096` and the tilted-cells rows at the same exact part); speed: forward time against cuDNN at 32k on
random Q/K/V, 32 / 8 heads, D = 64, plan included (`benchmarks/ops/bench_moba.py` for moba and tilted,
`benchmarks/ops/bench_muse_tilted.py` with TILT_CFG at the matched exact part for cells and tilted-cells, each against
cuDNN in its own run).

    python3 -m benchmarks.quality.plot_muse_matched     # writes benchmarks/results/muse/tradeoff-matched-32k-h200.{json,png}
"""

from __future__ import annotations

import argparse
import datetime
import json
import os

from benchmarks.shared import RESULTS
from longctx_patch.provenance import git_commit

ERR = ("muse/fidelity-matched-qwen2.5-coder-0.5b-32k-bf16-h200.json",
       "muse/fidelity-matched-tilted-cells-qwen2.5-coder-0.5b-32k-bf16-h200.json")
MOBA_SPEED = "moba/moba-speed-h200.json"
TILT_SPEED = "muse/tilted-cells-speed-matched-h200.json"


def name(cfg: dict) -> str:
    if cfg.get("method") == "moba":
        return "moba"
    ff = cfg.get("far_field", "tilted")
    return f"tilted-cells q{cfg['q_clusters']}" if ff == "tilted-cells" else ff


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=str(RESULTS))
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--D", type=int, default=64)
    a = ap.parse_args()
    rd = lambda p: json.load(open(os.path.join(a.results, p)))  # noqa: E731
    err = {}
    for f in ERR:
        for row in rd(f)["results"]:
            if not row["config"].get("exact"):
                err[name(row["config"])] = row["mean_rel_err"]
    speed = {}
    m = next(r for r in rd(MOBA_SPEED)["rows"] if r["S"] == a.seq and r["D"] == a.D)
    speed["moba"] = m["cudnn_fwd_ms"] / m["moba_fwd_ms"]
    speed["tilted"] = m["cudnn_fwd_ms"] / m["tilted_fwd_ms"]
    t = next(r for r in rd(TILT_SPEED)["speed"] if r["S"] == a.seq and r["D"] == a.D)
    speed["cells"] = t["cudnn_fwd_ms"] / t["cells_fwd_ms"]
    for k, v in t.items():
        if k.startswith("tilted_q"):
            speed[f"tilted-cells q{v['q_clusters']}"] = v["speedup_fwd_vs_cudnn"]
    points = [dict(method=k, err_mean=err[k], speedup_fwd_vs_cudnn=speed[k]) for k in err if k in speed]
    out = os.path.join(a.results, "muse", f"tradeoff-matched-{a.seq // 1024}k-h200")
    res = dict(task="muse-tradeoff", device="NVIDIA H200",  # speed and errors measured on the same GPU
               date=datetime.date.today().isoformat(),
               commit=git_commit(), command="python3 -m benchmarks.quality.plot_muse_matched", seq=a.seq, D=a.D,
               sources=list(ERR) + [MOBA_SPEED, TILT_SPEED], points=points)
    with open(out + ".json", "w") as f:
        json.dump(res, f, indent=1)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for p in points:
        ax.scatter(p["speedup_fwd_vs_cudnn"], 100 * p["err_mean"])
        ax.annotate(p["method"], (p["speedup_fwd_vs_cudnn"], 100 * p["err_mean"]), textcoords="offset points",
                    xytext=(5, 3), fontsize=8)
    ax.set_xscale("log")
    ax.axvline(1.0, color="grey", lw=0.8, ls=":")
    ax.set_xlabel(f"forward speed-up over cuDNN at {a.seq // 1024}k (D={a.D}, random Q/K/V)")
    ax.set_ylabel("mean attention error, Qwen2.5-Coder-0.5B at 32k (%)")
    ax.set_title("matched sparsity: ~4.2k exact keys per query")
    fig.tight_layout()
    fig.savefig(out + ".png", dpi=120)
    for p in points:
        print(f"{p['method']:>20}  err {100 * p['err_mean']:5.2f}%  fwd {p['speedup_fwd_vs_cudnn']:.2f}x cuDNN")
    print(f"wrote {out}.json and {out}.png")


if __name__ == "__main__":
    main()
