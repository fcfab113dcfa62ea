"""MuSe's speed / error trade-off at 64k from measured results (no GPU needed): forward speedup over cuDNN
(`evals/bench/bench_muse_cells.py` rows, D=64 and 128, plan included) against the mean attention error over SmolLM2's
30 layers on a 64k-token text (`evals/studies/muse_fidelity.py --seq-len 65536`), for every configuration measured by
both. Later result files win for the same configuration and shape, so a configuration's point is at the kernels
of its latest speed file (the files name their commit).

    python3 -m evals.plots.plot_muse_tradeoff     # writes evals/results/muse/tradeoff-64k-<gpu>.{json,png}
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import subprocess
import sys

from evals.shared import RESULTS, device_token
from longctx_patch.evals.common import git_commit, size_label

TILTED_KEYS = ("block_size", "q_clusters", "k_clusters", "topk_blocks", "topk_clusters")
CELLS_KEYS = ("block_size", "k_clusters", "topk_blocks")


def key(cfg: dict) -> tuple:
    """A configuration's identity: its far field and the knobs that far field reads. A cells result without
    `sink_blocks` predates that option (149988f), so it had none; one without `peak_blocks` had none either (the
    plan's default is 0)."""
    ff = cfg.get("far_field", "tilted" if "q_clusters" in cfg else "cells")
    if ff == "tilted":
        return (ff,) + tuple(cfg.get(k) for k in TILTED_KEYS)
    return (ff,) + tuple(cfg.get(k) for k in CELLS_KEYS) + (cfg.get("sink_blocks", 0), cfg.get("peak_blocks", 0))


def label(k: tuple) -> str:
    if k[0] == "cells":
        return (f"cells L{k[1]} Ck{k[2]} b{k[3]}" + (f"+{k[5]}peak" if k[5] else "")
                + (f" sink{k[4]}" if k[4] else ""))
    return f"tilted L{k[1]} q{k[2]} k{k[3]} b{k[4]} c{k[5]}"


def load(pattern: str) -> list[tuple[str, dict]]:
    """The matching result files, oldest first: by date, then by their commit's place in the history."""
    try:
        log = subprocess.run(["git", "log", "--format=%h", "-n", "2000"], capture_output=True, text=True,
                             check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        log = []
    age = lambda c: next((i for i, h in enumerate(log) if c and (h.startswith(c) or c.startswith(h))), len(log))  # noqa: E731
    rs = [(f, json.load(open(f))) for f in glob.glob(pattern)]
    return sorted(rs, key=lambda fr: (fr[1].get("date", "")[:10], -age(fr[1].get("commit")), fr[0]))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=str(RESULTS), help="results folder (default this checkout's evals/results)")
    ap.add_argument("--seq", type=int, default=65536)
    a = ap.parse_args()
    speed, err, sources = {}, {}, set()
    for f, r in load(os.path.join(a.results, "muse", "cells-speed-*.json")):
        for row in r.get("speed", []):
            if row.get("S") == a.seq and "speedup_fwd_vs_cudnn" in row:
                speed[(key(row["cfg"]), row["D"])] = dict(row, source=os.path.basename(f), device=r["device"])
                sources.add(os.path.basename(f))
    for f, r in load(os.path.join(a.results, "muse", "fidelity-*.json")):
        if r.get("seq_len") != a.seq or r.get("dtype", "float32") != "float32":  # the fp32 errors (bf16 adds rounding)
            continue
        for row in r["results"]:
            err[key(row["config"])] = dict(mean=row["mean_rel_err"], max=row["max_rel_err"], source=os.path.basename(f))
            sources.add(os.path.basename(f))
    points = []
    for (k, D), s in sorted(speed.items(), key=lambda kv: str(kv[0])):
        if k in err:
            points.append(dict(config=label(k), D=D, speedup_fwd=s["speedup_fwd_vs_cudnn"],
                               speedup_fwdbwd=s.get("speedup_fwdbwd_vs_cudnn"), err_mean=err[k]["mean"],
                               err_max=err[k]["max"], speed_source=s["source"], err_source=err[k]["source"]))
    if not points:
        sys.exit(f"no configuration has both a speed row at S={a.seq} and a {a.seq}-token fidelity result")
    devices = sorted({s["device"] for s in speed.values()})
    out = dict(device=", ".join(devices), date=datetime.date.today().isoformat(), commit=git_commit(),
               command="python3 -m evals.plots.plot_muse_tradeoff", seq=a.seq, sources=sorted(sources),
               metric="forward speedup over cuDNN (bf16, B=1, 32/8 heads, plan included) vs mean relative error of "
                      "the attention output over SmolLM2-135M's 30 layers on a 64k-token text", points=points)
    stem = os.path.join(a.results, "muse", f"tradeoff-{size_label(a.seq)}-{device_token(devices[0])}")
    with open(stem + ".json", "w") as fh:
        json.dump(out, fh, indent=1)
    for p in points:
        print(f"{p['config']:32} D{p['D']:<4} fwd {p['speedup_fwd']:5.2f}x  err {100 * p['err_mean']:5.1f}%")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for D, marker in ((64, "o"), (128, "s")):
        ps = [p for p in points if p["D"] == D]
        ax.scatter([p["speedup_fwd"] for p in ps], [100 * p["err_mean"] for p in ps], marker=marker, label=f"D={D}")
        for p in ps if D == 64 else []:  # one label per configuration (its D=128 point sits beside it)
            ax.annotate(p["config"], (p["speedup_fwd"], 100 * p["err_mean"]), fontsize=7, xytext=(4, 4),
                        textcoords="offset points")
    ax.axvline(1, ls=":", c="gray")
    ax.axvline(3, ls="--", c="gray")
    ax.text(3, 0.3, " target 3x", fontsize=7)
    ax.axhline(1, ls="--", c="gray")
    ax.text(ax.get_xlim()[0], 1.2, " target 1%", fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel(f"forward speedup over cuDNN at {a.seq // 1024}k ({devices[0]}, bf16, plan included)")
    ax.set_ylabel("attention error at 64k, mean of SmolLM2's 30 layers (%)")
    ax.set_title("MuSe: speed / error at 64k")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(stem + ".png", dpi=120)


if __name__ == "__main__":
    main()
