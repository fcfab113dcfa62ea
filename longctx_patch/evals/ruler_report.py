"""RULER's report: the scores per method, task and length, their table and their heatmaps (`ruler_run.run_ruler` writes
them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from . import niah
from .common import format_table, pyplot, size_label


def summarize(records, labels, tasks, lengths) -> dict[str, Any]:
    """Scores in percent (RULER's): per method, task and length; the mean over tasks per length; overall."""

    def mean(rows):
        return round(100 * sum(r["score"] for r in rows) / len(rows), 2) if rows else None

    scores: dict[str, Any] = {}
    average: dict[str, Any] = {}
    overall: dict[str, Any] = {}
    for lab in labels:
        mine = [r for r in records if r["method"] == lab]
        scores[lab] = {t: {size_label(L): mean([r for r in mine if r["task"] == t and r["length"] == L])
                           for L in lengths} for t in tasks}
        average[lab] = {}
        for L in lengths:
            cells = [scores[lab][t][size_label(L)] for t in tasks]
            cells = [c for c in cells if c is not None]
            average[lab][size_label(L)] = round(sum(cells) / len(cells), 2) if cells else None
        overall[lab] = mean(mine)
    return {"score": scores, "average": average, "overall": overall,
            "paired": niah.paired(records, labels, tasks, lengths)}


def score_table(figures, labels, tasks, lengths) -> str:
    header = ["method", "task"] + [size_label(L) for L in lengths]
    rows = []
    for lab in labels:
        for t in tasks:
            rows.append([lab, t] + [figures["score"][lab][t][size_label(L)] for L in lengths])
        rows.append([lab, "average"] + [figures["average"][lab][size_label(L)] for L in lengths])
    return format_table(header, rows)


def plot_scores(figures, labels, tasks, lengths, path) -> Path:
    """Scores (percent) as task x length heatmaps, one panel per method, with the average as the last row."""
    import numpy as np

    plt = pyplot()
    rows = list(tasks) + ["average"]
    fig, axes = plt.subplots(1, len(labels), figsize=(1.2 + 0.8 * len(lengths) * len(labels) + 1.6 * len(labels),
                                                      0.9 + 0.32 * len(rows)), squeeze=False, layout="constrained")
    im = None
    for j, lab in enumerate(labels):
        ax = axes[0][j]
        cells = [[figures["score"][lab][t][size_label(L)] for L in lengths] for t in tasks]
        cells.append([figures["average"][lab][size_label(L)] for L in lengths])
        grid = np.array([[np.nan if v is None else v for v in row] for row in cells], dtype=float)
        im = ax.imshow(grid, vmin=0, vmax=100, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(lengths)), [size_label(L) for L in lengths], fontsize=7)
        ax.set_yticks(range(len(rows)), rows if j == 0 else [""] * len(rows), fontsize=7)
        for (y, x), v in np.ndenumerate(grid):
            if not np.isnan(v):
                ax.text(x, y, f"{v:.0f}", ha="center", va="center", fontsize=7)
        ax.set_title(lab, fontsize=8)
        ax.set_xlabel("length (tokens)", fontsize=8)
    fig.colorbar(im, ax=axes, shrink=0.8, label="score (%)")
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
