"""One figure for the ICR learning-rate sweep on the H200: for every mixer, its best of the learning rates run
(by accuracy at the longest length), accuracy against length and against decode-state bytes, basic and
positional side by side. Reads the result JSONs of `evals/bench_synthetic.py`; every run of a mixer and task
found in them counts (a run stopped by its deadline is drawn hollow).

    python3 evals/plot_icr_sweep.py [--out evals/results/synthetic-h200-icr-sweep-best.png] [JSON ...]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
DEFAULT = {
    "icr-basic": ["synthetic-h200-curriculum-4000-icr-basic.json", "synthetic-h200-curriculum-4000-lrs-icr-basic.json",
                  "synthetic-h200-sweep-a-icr-basic.json", "synthetic-h200-sweep-b-icr-basic.json"],
    "icr-positional": ["synthetic-h200-curriculum-4000-icr-positional.json",
                       "synthetic-h200-curriculum-4000-lrs-icr-positional.json",
                       "synthetic-h200-sweep-c-icr-positional.json", "synthetic-h200-sweep-b-icr-positional.json"],
}


def best_runs(files):
    """{mixer: run} with the highest accuracy at the longest length over the runs of `files`."""
    best = {}
    for f in files:
        d = json.loads(Path(f).read_text())
        steps = d["train_config"]["steps"]
        for r in d["runs"]:
            if not r.get("eval"):
                continue
            L = max(r["eval"], key=int)
            acc = r["eval"][L]["accuracy"]
            r = dict(r, planned_steps=steps)
            name = r["mixer"].split(":")[0]
            if name not in best or acc > best[name]["eval"][max(best[name]["eval"], key=int)]["accuracy"]:
                best[name] = r
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(RESULTS / "synthetic-h200-icr-sweep-best.png"))
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for col, (task, names) in enumerate(DEFAULT.items()):
        best = best_runs([RESULTS / n for n in names])
        for mixer, r in sorted(best.items()):
            lengths = sorted(r["eval"], key=int)
            acc = [100 * r["eval"][L]["accuracy"] for L in lengths]
            full = r["steps_done"] >= r["planned_steps"]
            label = f"{mixer} (lr {r['lr']:g})" + ("" if full else f", {r['steps_done']} steps")
            line = axes[0, col].plot([int(L) for L in lengths], acc, marker="o", label=label,
                                     markerfacecolor=None if full else "none")
            L = lengths[-1]
            axes[1, col].scatter(r["state_bytes"][L] / 2**10, acc[-1], color=line[0].get_color(),
                                 facecolors=None if full else "none", s=60)
            axes[1, col].annotate(mixer, (r["state_bytes"][L] / 2**10, acc[-1]), textcoords="offset points",
                                  xytext=(5, 3), fontsize=8)
        axes[0, col].set(title=f"{task}: best of 3 learning rates", xscale="log", xlabel="sequence length (tokens)",
                         ylabel="accuracy (%)", ylim=(-2, 102))
        axes[0, col].legend(fontsize=7)
        axes[1, col].set(title=f"{task}: accuracy at 4k vs decode state", xscale="log",
                         xlabel="state at 4k (KiB, batch 1)", ylabel="accuracy at 4k (%)", ylim=(-2, 102))
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
