"""RULER score against decode-state fraction, one curve per method, one panel per length (kvpress's plots: score
against compression): kvpress's presses (predictions from benchmarks/quality/bench_peers_kvpress.py, rescored here with
longctx_patch.evals.ruler's scorer) beside this project's methods (`longctx eval ruler --samples-file` results) on
the same samples file. The decode-state fraction of a point is the mean over its samples of the state kept at the end
of the prompt over the exact K/V cache's (kvpress: measured in the compressed cache; ours: `state_bytes`); its score
is RULER's average over the tasks of the mean string_match_all, in percent. Unpatched runs (`none`, `exact`,
`kvpress-none`) are drawn as the full-cache line.

    python3 -m benchmarks.quality.plot_peers --samples S.jsonl --kvpress P.jsonl --ours 'OUT/ruler-*.json' \\
        --out OUT/peers-qwen2.5-coder-0.5b      # writes OUT/peers-qwen2.5-coder-0.5b.{json,png}
"""

from __future__ import annotations

import argparse
import datetime
import glob
import hashlib
import json
import sys
import textwrap
from collections import defaultdict
from pathlib import Path

from benchmarks.shared import FULL_CACHE_METHODS as FULL
from longctx_patch.errors import ConfigError
from longctx_patch.provenance import device_description, git_commit
from longctx_patch.evals.ruler_export import read_predictions, read_samples, score_predictions


def family(method: str) -> str:
    """The curve a method label belongs to: 'sliding-window(window=205)' -> 'sliding-window'."""
    return method.split("(")[0]


def ours_records(path: Path, samples) -> list[dict]:
    """The per-sample records of a `longctx eval ruler --samples-file` result, checked against the samples."""
    rec = json.loads(path.read_text())
    by_key = {(s.task, s.length, s.index): s for s in samples}
    rows = rec.get("samples") or []
    for r in rows:
        s = by_key.get((r["task"], r["length"], r["index"]))
        if s is None or s.answers != r["answers"] or s.prompt_tokens != r["prompt_tokens"]:
            raise ConfigError(f"{path}: its sample {r['task']} / {r['length']} / {r['index']} is not the samples "
                              "file's: run `longctx eval ruler --samples-file` on that file")
        if "state_fraction" not in r:
            raise ConfigError(f"{path} has no state_fraction per sample: rerun it with this version")
    return rows


def points(records: list[dict]) -> dict[int, dict[str, dict]]:
    """{length: {method: {fraction, score, by_task, tasks, samples}}}: the RULER average (mean over tasks of the mean
    sample score, %), each task's mean score (%) and the mean decode-state fraction of each method at each length."""
    cells: dict = defaultdict(lambda: defaultdict(list))
    fr: dict = defaultdict(list)
    for r in records:
        cells[r["length"], r["method"]][r["task"]].append(r["score"])
        fr[r["length"], r["method"]].append(r.get("state_fraction", 1.0))
    out: dict = defaultdict(dict)
    for (L, m), tasks in cells.items():
        by_task = {t: 100 * sum(v) / len(v) for t, v in sorted(tasks.items())}
        out[L][m] = {"fraction": round(sum(fr[L, m]) / len(fr[L, m]), 5),
                     "score": round(sum(by_task.values()) / len(by_task), 2),
                     "by_task": {t: round(x, 2) for t, x in by_task.items()},
                     "tasks": sorted(tasks), "samples": sum(len(v) for v in tasks.values())}
    return out


def plot(pts: dict, title: str, png: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted(pts)
    fams = sorted({family(m) for L in lengths for m in pts[L]} - set(FULL), key=lambda f: (not f.startswith("kvpress-"), f))
    color = {f: plt.get_cmap("tab10")(i % 10) for i, f in enumerate(fams)}  # one colour a method in every panel
    fig, axes = plt.subplots(1, len(lengths), figsize=(6 * len(lengths), 4.5), squeeze=False, sharey=True)
    for ax, L in zip(axes[0], lengths):
        curves: dict = defaultdict(list)
        for m, p in pts[L].items():
            curves[family(m)].append((p["fraction"], p["score"]))
        for fam in sorted(curves, key=lambda f: (f in FULL, not f.startswith("kvpress-"), f)):
            xy = sorted(curves[fam])
            if fam in FULL:
                for x, y in xy:
                    ax.axhline(y, color="black" if fam != "kvpress-none" else "grey", ls="--", lw=1,
                               label=f"full cache ({fam}) {y:.1f}")
                continue
            kv = fam.startswith("kvpress-")
            ax.plot([x for x, _ in xy], [y for _, y in xy], marker="o" if kv else "s", ls="-" if kv else "-.",
                    color=color[fam],
                    label=fam.replace("kvpress-", "kvpress ") if kv else f"longctx {fam}")
        ax.set_title(f"{L // 1024}k tokens" if L % 1024 == 0 else f"{L} tokens")
        ax.set_xlabel("decode-state fraction (of the exact K/V cache at the end of the prompt)")
        ax.set_xlim(left=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    axes[0][0].set_ylabel("RULER score (%)")
    axes[0][0].set_ylim(-2, 102)
    fig.suptitle("\n".join(textwrap.wrap(title, 75 * len(lengths))), fontsize=10)  # one line a panel's width
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", action="append", required=True,
                    help="a samples file both programs answered (repeatable: one a length)")
    ap.add_argument("--kvpress", action="append", default=[], help="bench_peers_kvpress.py predictions (repeatable, globs)")
    ap.add_argument("--ours", action="append", default=[], help="`longctx eval ruler` result JSONs (repeatable, globs)")
    ap.add_argument("--out", required=True, help="base name of OUT.json and OUT.png")
    ap.add_argument("--title", default=None)
    ap.add_argument("--model", default=None, help="the model's name in the record (default: the samples file's)")
    a = ap.parse_args(argv)
    expand = lambda pats: sorted({p for pat in pats for p in glob.glob(pat)})  # noqa: E731
    files = {}  # sha256 -> (path, header, samples)
    for f in a.samples:
        header, samples = read_samples(f)
        files[hashlib.sha256(Path(f).read_bytes()).hexdigest()] = (f, header, samples)
    every = [s for _, _, ss in files.values() for s in ss]
    records, sources = [], []
    for p in expand(a.kvpress):
        h, rows = read_predictions(p)
        if h.get("samples_sha256") not in files:
            raise ConfigError(f"{p} answered a samples file not given with --samples (sha256 {h.get('samples_sha256')})")
        recs = score_predictions(files[h["samples_sha256"]][2], rows)
        bad = [r for r, p_ in zip(recs, rows) if "score" in p_ and abs(p_["score"] - r["score"]) > 1e-4]
        if bad:
            raise ConfigError(f"{p}: {len(bad)} predictions scored differently by the runner and by RULER's scorer here")
        records += recs
        sources.append({"file": p, "program": h.get("program"), **{k: h.get(k) for k in (
            "device", "date", "commit", "command", "kvpress", "transformers", "torch")}})
    for p in expand(a.ours):
        records += ours_records(Path(p), every)
        r = json.loads(Path(p).read_text())
        sources.append({"file": p, "program": "longctx", **{k: r.get(k) for k in ("device", "date", "commit", "command")}})
    if not records:
        raise ConfigError("no results: give --kvpress and/or --ours files")
    pts = points(records)
    for L, methods in pts.items():  # a cell a run left unfinished is not a point (its rerun completes it)
        want = sum(1 for s in every if s.length == L)
        for m in [m for m, p in methods.items() if p["samples"] < want]:
            print(f"[peers] {m} at {L}: {methods[m]['samples']} of {want} samples answered; left out until its run "
                  "is finished", file=sys.stderr)
            del methods[m]
    out = Path(a.out)  # a base name: OUT.json and OUT.png (its dots kept: peers-qwen2.5-coder-0.5b)
    out.parent.mkdir(parents=True, exist_ok=True)
    js, png_path = out.parent / (out.name + ".json"), out.parent / (out.name + ".png")
    header = next(iter(files.values()))[1]
    title = a.title or (f"{header['model']}: RULER ({', '.join(header['tasks'])}; {header['samples_per_cell']} samples "
                        "a cell) against decode-state fraction")
    png = plot(pts, title, png_path)
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    command = "python3 -m benchmarks.quality.plot_peers " + " ".join(argv if argv is not None else sys.argv[1:])
    rec = {"task": "peers", "model": a.model or header["model"], "device": device_description(), "date": now,
           "commit": git_commit(), "command": command,
           "samples": [{**h, "file": f, "sha256": k} for k, (f, h, _) in files.items()],
           "sources": sources, "points": {str(L): v for L, v in sorted(pts.items())}}
    js.write_text(json.dumps(rec, indent=1))
    for L in sorted(pts):
        for m, p in sorted(pts[L].items(), key=lambda t: (family(t[0]), t[1]["fraction"])):
            tasks = "  ".join(f"{t} {x:.1f}" for t, x in p["by_task"].items())
            print(f"{L:>6}  {m:<40} fraction {p['fraction']:.4f}  score {p['score']:6.2f}  ({p['samples']} samples: {tasks})")
    print(f"wrote {js} and {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
