"""Reports of a synthetic sweep: the best learning rate per mixer, the tables, the plots and the result JSON."""

from __future__ import annotations

import os
from dataclasses import asdict
from typing import Any, Sequence

from .model import ModelConfig
from .registry import MixerSpec
from .train import TrainConfig


# ================================================================================================ reporting
def summarize(task, specs: Sequence[MixerSpec], records: Sequence[dict], lengths: Sequence[int]) -> dict[str, Any]:
    """Best learning rate per mixer (mean of the primary metric over lengths and seeds) and its figures."""
    key = task.primary
    better = max if task.higher_is_better else min
    out: dict[str, Any] = {}
    for s in specs:
        recs = [r for r in records if r.get("mixer") == s.label and not r.get("error") and not r.get("diverged")]
        by_lr: dict[float, list[dict]] = {}
        for r in recs:
            by_lr.setdefault(r["lr"], []).append(r)

        def score(rs):
            vals = [r["eval"][str(L)][key] for r in rs for L in lengths if str(L) in r["eval"]]
            return sum(vals) / len(vals) if vals else None

        scored = {lr: score(rs) for lr, rs in by_lr.items() if score(rs) is not None}
        errors = [r["error"] for r in records if r.get("mixer") == s.label and r.get("error")]
        entry: dict[str, Any] = {"spec": s.label, "errors": errors,
                                 "diverged_lrs": sorted({r["lr"] for r in records if r.get("mixer") == s.label and r.get("diverged")})}
        if scored:
            best_lr = better(scored, key=scored.get)
            rs = by_lr[best_lr]
            entry["best_lr"] = best_lr
            entry["by_length"] = {str(L): sum(r["eval"][str(L)][key] for r in rs) / len(rs) for L in lengths}
            entry["state_bytes"] = rs[0]["state_bytes"]
            entry["score_by_lr"] = {str(lr): v for lr, v in scored.items()}
            entry["eval"] = rs[0]["eval"] if len(rs) == 1 else [r["eval"] for r in rs]
        out[s.label] = entry
    return out


def tables(task, summary: dict[str, Any], lengths: Sequence[int]) -> str:
    from ..common import format_bytes, format_table, size_label

    key = task.primary
    ref = summary.get("softmax", {}).get("state_bytes", {})
    Lmax = str(max(lengths))
    header = ["mixer", "best lr"] + [f"{key}@{size_label(L)}" for L in lengths] + [f"state@{size_label(int(Lmax))}", "vs softmax"]
    rows = []
    for label, e in summary.items():
        if "by_length" not in e:
            rows.append([label, None] + [None] * len(lengths) + [None, ("error: " + e["errors"][0][:60]) if e["errors"] else "diverged"])
            continue
        sb = e["state_bytes"].get(Lmax)
        ratio = f"{100 * sb / ref[Lmax]:.1f}%" if ref.get(Lmax) else None
        row = [label, e["best_lr"]] + [round(e["by_length"][str(L)], 4) for L in lengths] + [format_bytes(sb) if sb is not None else None, ratio]
        ev = e["eval"] if isinstance(e["eval"], dict) else e["eval"][0]
        if "functions_learned" in ev.get(Lmax, {}):
            row.append(f"{ev[Lmax]['functions_learned']}/{ev[Lmax]['functions_measured']}")
        rows.append(row)
    if any(len(r) > len(header) for r in rows):
        header.append(f"learned@{size_label(int(Lmax))}")
        rows = [r + [None] * (len(header) - len(r)) for r in rows]
    return format_table(header, rows)


def plot(task, summary: dict[str, Any], lengths: Sequence[int], stem: str, title: str) -> list[str]:
    """``<stem>-length.png`` (metric vs length), ``<stem>-state.png`` (metric vs state bytes at each length) and,
    for ICL, ``<stem>-shots.png`` (error vs earlier examples of the same function, at the longest length)."""
    from ..common import pyplot

    plt = pyplot()
    key = task.primary
    paths = []

    def save(fig, ax, suffix: str, xlabel: str, ylabel: str, ylog: bool, plot_title: str) -> None:
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        if ylog:
            ax.set_yscale("log")
        ax.set_title(plot_title)
        ax.grid(alpha=0.3)
        if ax.get_lines():
            ax.legend(fontsize=7)
        fig.tight_layout()
        p = f"{stem}-{suffix}.png"
        fig.savefig(p, dpi=120)
        plt.close(fig)
        paths.append(p)

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for label, e in summary.items():
        if "by_length" in e:
            ax.plot(lengths, [e["by_length"][str(L)] for L in lengths], marker="o", label=label)
    ax.set_xscale("log", base=2)
    save(fig, ax, "length", "sequence length (tokens)", key, not task.higher_is_better, title)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    markers = "os^vD<>ph*"
    for i, (label, e) in enumerate(summary.items()):
        if "by_length" in e:
            xs = [e["state_bytes"][str(L)] for L in lengths]
            ys = [e["by_length"][str(L)] for L in lengths]
            ax.plot(xs, ys, marker=markers[i % len(markers)], linestyle=":", label=label)
    ax.set_xscale("log")
    save(fig, ax, "state", "decode state (bytes, all layers, batch 1; points = lengths)", key,
         not task.higher_is_better, title)
    Lmax = str(max(lengths))
    curves = {}
    for label, e in summary.items():
        ev = e.get("eval")
        ev = ev[0] if isinstance(ev, list) else ev
        if ev and "mse_by_shots" in ev.get(Lmax, {}):
            pts = [(c["shots_from"], c["mse"]) for c in ev[Lmax]["mse_by_shots"] if c["mse"] is not None]
            if pts:
                curves[label] = pts
    if curves:  # ICL: error against the number of earlier examples of the same function
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for label, pts in curves.items():
            ax.plot([x + 1 for x, _ in pts], [y for _, y in pts], marker="o", label=label)
        ax.set_xscale("log", base=2)
        save(fig, ax, "shots", "1 + earlier examples of the same function (bin start)", "mse (1.0 = predicting 0)",
             True, f"{title} (length {Lmax})")
    return paths


def write_report(path, task, specs: Sequence[MixerSpec], records: Sequence[dict], lengths: Sequence[int],
                 mcfg: ModelConfig, tcfg: TrainConfig, *, label: str = "", command: str | None = None,
                 plots: bool = True, extra: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
    """Writes the result JSON (common fields device/date/commit/command) and the PNG plots; returns the tables."""
    from pathlib import Path

    from ...provenance import device_description
    from ..common import MethodRun, write_result

    path = Path(path)
    summary = summarize(task, specs, records, lengths)
    text = tables(task, summary, lengths)
    figures: dict[str, Any] = {
        "label": label,
        "mixer_options": {s.label: s.config.to_dict() for s in specs}, "lengths": list(lengths),
        "task_config": task.describe(), "model_config": asdict(mcfg),
        "train_config": asdict(tcfg), "primary_metric": task.primary, "summary": summary, "runs": list(records),
        "table": text,
    }
    if extra:
        figures.update(extra)
    if plots:
        stem = str(path.with_suffix(""))
        path.parent.mkdir(parents=True, exist_ok=True)
        figures["plots"] = [os.path.basename(p) for p in plot(task, summary, lengths, stem, f"{task.name} {label}".strip())]
    runs = [MethodRun(s.label) for s in specs]
    write_result(path, task=task.name, model=f"from-scratch {mcfg.n_layers}x{mcfg.d_model} (heads {mcfg.n_heads})",
                 runs=runs, figures=figures, command=command, device=device_description(tcfg.device))
    return text, summary


__all__ = ["summarize", "tables", "plot", "write_report"]
