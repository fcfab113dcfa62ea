"""One figure for the ICR learning-rate sweep on the H200: for every mixer, its best of the learning rates run
(by accuracy at the longest length), accuracy against length and against decode-state bytes, basic and
positional side by side. Reads the result JSONs of `benchmarks/quality/bench_synthetic.py`; every run of a mixer and task
found in them counts (a run stopped by its deadline is drawn hollow). `--seeds-table` prints instead, per task
and mixer, the mean accuracy over the seeds run at lr 3e-3 with its lowest and highest (the README's table).

    python3 -m benchmarks.quality.plot_icr_sweep [--out benchmarks/results/synthetic/h200-icr-sweep-best.png] [--seeds-table]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.shared import RESULTS

DEFAULT = {
    "icr-basic": ["synthetic/h200-curriculum-4000-icr-basic.json", "synthetic/h200-curriculum-4000-lrs-icr-basic.json",
                  "synthetic/h200-sweep-a-icr-basic.json", "synthetic/h200-sweep-b-icr-basic.json"],
    "icr-positional": ["synthetic/h200-curriculum-4000-icr-positional.json",
                       "synthetic/h200-curriculum-4000-lrs-icr-positional.json",
                       "synthetic/h200-sweep-c-icr-positional.json", "synthetic/h200-sweep-b-icr-positional.json"],
}
SEEDS = {  # lr 3e-3: seed 0 (the sweep's runs) and seeds 1, 2
    "icr-basic": ["synthetic/h200-curriculum-4000-icr-basic.json", "synthetic/h200-sweep-b-icr-basic.json",
                  "synthetic/h200-seeds-icr-basic.json", "synthetic/h200-seeds-b-icr-basic.json"],
    "icr-positional": ["synthetic/h200-curriculum-4000-icr-positional.json",
                       "synthetic/h200-sweep-b-icr-positional.json", "synthetic/h200-seeds-icr-positional.json",
                       "synthetic/h200-seeds-b-icr-positional.json"],
}


def seed_table(files, lr: float = 3e-3) -> str:
    """Markdown rows: mixer | seeds | mean accuracy (lowest-highest) per length, over the complete runs at `lr`."""
    by = {}
    for f in files:
        d = json.loads(Path(f).read_text())
        for r in d["runs"]:
            if r.get("eval") and abs(r["lr"] - lr) < 1e-12 and r["steps_done"] >= d["train_config"]["steps"]:
                by.setdefault(r["mixer"].split("(")[0].split(":")[0], {})[r["seed"]] = r
    rows = []
    for mixer, runs in by.items():
        lengths = sorted(next(iter(runs.values()))["eval"], key=int)
        cells = []
        for L in lengths:
            a = [100 * r["eval"][L]["accuracy"] for r in runs.values()]
            cells.append(f"{sum(a) / len(a):.1f} ({min(a):.1f}-{max(a):.1f})" if len(a) > 1 else f"{a[0]:.1f}")
        rows.append(f"| {mixer} | {len(runs)} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


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
            name = r["mixer"].split("(")[0].split(":")[0]
            if name not in best or acc > best[name]["eval"][max(best[name]["eval"], key=int)]["accuracy"]:
                best[name] = r
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(RESULTS / "synthetic/h200-icr-sweep-best.png"))
    ap.add_argument("--seeds-table", action="store_true", help="print the seeds table (lr 3e-3) instead of plotting")
    args = ap.parse_args()
    if args.seeds_table:
        for task, names in SEEDS.items():
            print(f"{task}: mixer | seeds | accuracy by length, mean (lowest-highest)")
            print(seed_table([RESULTS / n for n in names]))
        return
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
