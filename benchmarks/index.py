"""benchmarks/results/INDEX.md from every result JSON under benchmarks/results: one row per file with its task, model,
method, device, date, commit and a headline figure.

    python -m benchmarks.index              # rewrites benchmarks/results/INDEX.md
    python -m benchmarks.index --check      # exit 1 if the committed INDEX.md is not what the results give

The task is the JSON's own `task` field (`<task>` in the folder of one task, `<folder>-<kind>` in the folders of
several benchmarks: `lola/speed-h200-34dbded.json` says lola-speed), nothing read from the file's place. The
headline comes from a rule per task (accuracy, perplexity, speed-up, error, tokens/s ...); a task without a rule, or
a file of a layout its rule knows to carry none of its figures (the rule returns None), gets the first of a few
well-known figures found anywhere in it (a speed-up, an error, tokens/s), else "-"; a file its rule cannot read stops
the index with an error naming the file. A field the file does not have shows as "unknown" (task, device, date,
commit) or "-" (model, method), and a file without one of REQUIRED is listed at the end; nothing is filled in.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from benchmarks.shared import FULL_CACHE_METHODS, RESULTS

REQUIRED = ("task", "device", "date", "commit", "command")  # every result file says these
UNKNOWN = "unknown"
NONE = "-"


def task_of(d: dict) -> str:
    """The task or benchmark a result comes from, as the file says (`task`: `<task>` in the folder of one task,
    `<folder>-<kind>` in the folders of several benchmarks, e.g. lola-speed); UNKNOWN when it does not."""
    return d["task"] if isinstance(d.get("task"), str) and d["task"] else UNKNOWN


# ------------------------------------------------------------------------------------------------ formatting
def num(v: Any, digits: int = 4) -> str:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v)
    if isinstance(v, int):
        return str(v)
    return f"{v:.{digits}g}"


def short(label: str, n: int = 40) -> str:
    label = str(label)
    return label if len(label) <= n else label[: n - 1] + "…"


def per_label(values: dict, fmt: Callable[[Any], str] = num, limit: int = 6) -> str:
    items = [f"{short(k)} {fmt(v)}" for k, v in values.items() if v is not None]
    more = len(items) - limit
    return ", ".join(items[:limit]) + (f", … (+{more})" if more > 0 else "")


def longest(keys) -> str:
    """The longest length among keys such as '1k', '4k', '512', '65536'."""
    def size(k):
        m = re.fullmatch(r"(\d+)([km]?)", str(k))
        return int(m.group(1)) * {"": 1, "k": 1024, "m": 1 << 20}[m.group(2)] if m else -1
    return max(keys, key=size)


def cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ").strip() or NONE


# ------------------------------------------------------------------------------------------------ headlines
def h_niah(d):
    return "accuracy: " + per_label(d["overall"], lambda v: f"{v:.2f}")


def h_ruler(d):
    ctx = longest(next(iter(d["average"].values())))
    return f"RULER average @{ctx}: " + per_label({k: v.get(ctx) for k, v in d["average"].items()}, lambda v: f"{v:.1f}")


def h_peers(d):
    """Per length: the full cache's score and the best point at a decode-state fraction of at most 15%."""
    parts = []
    for L, pts in d["points"].items():
        full = [p["score"] for m, p in pts.items() if m in FULL_CACHE_METHODS]
        small = {m: p for m, p in pts.items() if p["fraction"] <= 0.15}
        best = max(small, key=lambda m: small[m]["score"]) if small else None
        parts.append(f"@{L}: full {max(full):.1f}" if full else f"@{L}:")
        if best:
            parts[-1] += f", best <=15% {short(best, 36)} {small[best]['score']:.1f} ({small[best]['fraction']:.2f})"
    return "RULER " + "; ".join(parts)


def h_ppl(d):
    ctx = longest(next(iter(d["ppl"].values())))
    return f"ppl@{ctx}: " + per_label({k: v.get(ctx) for k, v in d["ppl"].items()}, lambda v: f"{v:.2f}")


def h_approx(d):
    return "rel. error (layer mean): " + per_label(d["rel_error_mean"], lambda v: f"{v:.3g}")


def h_speed(d):
    ref, sp = d.get("reference", "reference"), d.get("speedup_vs_reference")
    if not sp:  # a run without a reference among its methods (one method per file, decode-first-steps): no speed-up
        return None
    if "layout" not in d:  # before 2026-12-02: speedup_vs_reference[method][context], batch 1
        ctx = longest(next(iter(sp.values())))
        parts = {k: v[ctx]["prefill"] for k, v in sp.items()}
        return f"prefill speed-up vs {ref} @{ctx}: " + per_label(parts, lambda v: f"{v:.3g}x")
    batch = max(next(iter(sp.values())), key=lambda b: int(b[1:]))  # speedup_vs_reference[method][b<batch>][context]
    ctx = longest(next(iter(sp.values()))[batch])
    kind = "decode" if d.get("decode_tokens") else "prefill"
    parts = {k: v[batch][ctx][kind] for k, v in sp.items()}
    return f"{kind} speed-up vs {ref}, batch {batch[1:]} @{ctx}: " + per_label(parts, lambda v: f"{v:.3g}x")


def h_speed_op(d):
    L = longest(d["results"])
    mode = next(iter(d["results"][L]))
    rows = {k: v["ratio_vs_best_exact"] for k, v in d["results"][L][mode].items() if "ratio_vs_best_exact" in v}
    return f"{mode} time / best SDPA @{L}: " + per_label(rows, lambda v: f"{v:.3g}")


def h_finetune(d):
    last = d["stages"][-1]
    loss = last.get("final_eval_loss", last.get("final_loss"))
    rate = d["tokens"] / d["time_s"] if d.get("tokens") and d.get("time_s") else None
    out = f"{last['name']}: final {'eval ' if 'final_eval_loss' in last else ''}loss {num(loss)}"
    return out + (f", {rate:.0f} tokens/s" if rate else "")


def h_synthetic(d):
    if "summary" not in d:  # a file written from a run's log: its table
        cols = [k for k in d["table"][0] if re.fullmatch(r"[a-z]+_\d+k", k)]
        col = max(cols, key=lambda k: int(k.split("_")[1][:-1]))
        return f"{col.replace('_', '@')}: " + per_label({r["mixer"]: r[col] for r in d["table"]}, lambda v: f"{v:.3g}")
    metric = d.get("primary_metric", "accuracy")
    summary = {k: v["by_length"] for k, v in d["summary"].items() if v.get("by_length")}
    L = longest(next(iter(summary.values())))
    return f"{metric}@{L}: " + per_label({k: v.get(L) for k, v in summary.items()}, lambda v: f"{v:.3g}")


def h_multigpu(d):
    stage = next(iter(next(iter(d["runs"].values()))["stages"]))
    return f"{stage} tokens/s: " + per_label({m: r["stages"][stage]["tokens_per_s"] for m, r in d["runs"].items()},
                                             lambda v: f"{v:.0f}")


def h_lola_mass(d):
    shares = [r["linear_share_mean"] for r in d["records"]]
    return f"linear term's share of the normaliser: {sum(shares) / len(shares):.3f} (mean of {len(shares)} prompts)"


def h_needle(d):
    kept = [r["mean_share"] for r in d["records"]]
    rnd = [r["random_share"] for r in d["records"]]
    return f"needle pairs kept: {sum(kept) / len(kept):.3f} (a random token: {sum(rnd) / len(rnd):.3f})"


def h_needle_study(d):
    """bench_lola_needle_study: per method (exact first), the share of right answers and, for the others, the needle's
    pairs held exactly against a random token's, over every cell."""
    recs = d["records"]

    def fig(label):
        mine = [r for r in recs if r["method"] == label]
        out = f"right {sum(r['correct'] for r in mine) / len(mine):.2f}"
        if "needle_held_mean" in mine[0]:
            held = sum(r["needle_held_mean"] for r in mine) / len(mine)
            rnd = sum(r["random_held_mean"] for r in mine) / len(mine)
            out += f", needle held {held:.2f} (random {rnd:.2f})"
        return out

    return "; ".join(f"{short(lab, 60)}: {fig(lab)}" for lab in d["method"] if any(r["method"] == lab for r in recs))


def h_determinism(d):
    return "runs diverged: " + ", ".join(f"{c['runs_diverged']}/{c['runs']} ({short(c['condition'], 30)})"
                                          for c in d["conditions"])


def h_gpu_integration(d):
    rows = d["rows"]
    err = [r["logits_rel_err"] for r in rows if isinstance(r.get("logits_rel_err"), (int, float))]
    agree = [r["generate_token_agreement"] for r in rows if isinstance(r.get("generate_token_agreement"), (int, float))]
    out = f"{len(rows)} rows, Triton vs PyTorch logits rel. error <= {num(max(err), 3)}"
    return out + (f", token agreement >= {min(agree):.2f}" if agree else "")


def h_fidelity(d):
    rows = d["results"]
    best = min(rows, key=lambda r: r["mean_rel_err"])
    cfg = ",".join(f"{k}={v}" for k, v in best["config"].items())
    return f"mean rel. error {num(min(r['mean_rel_err'] for r in rows), 3)}-{num(max(r['mean_rel_err'] for r in rows), 3)} " \
           f"over {len(rows)} configs (best: {short(cfg, 50)})"


def h_lola_speed(d):
    errs = [v for k, v in d["check_rel_err"].items() if "same" not in k and isinstance(v, (int, float))]
    return f"Triton vs reference: rel. error <= {num(max(errs), 3)} ({len(errs)} checks)"


def h_racecheck(d):
    checks = [c for f in d["families"].values() for c in f["checks"]]
    errs = [float(v) for c in checks for k, v in c.items() if k not in ("family", "check") and _is_float(v)]
    return f"{len(checks)} checks in {len(d['families'])} families, Triton vs reference rel. error <= {num(max(errs), 3)}"


def _is_float(v) -> bool:
    try:
        float(v)
        return not isinstance(v, bool)
    except (TypeError, ValueError):
        return False


def h_decode_attention(d):
    if not any("Sq" in r for r in d["rows"]):  # bench_lola_decode_step: the LoLA step's rows, no query counts
        return None
    rows = [r for r in d["rows"] if r["Sq"] == 1 and not r["padded"] and r["B"] == 1]
    r = max(rows, key=lambda r: (r["Sk"], -r["D"]))
    return (f"decode step (1 query, B=1, D={r['D']}) over {r['Sk']} keys: package {num(r['package']['ms'], 3)} ms, "
            f"{100 * r['package']['floor_fraction']:.0f}% of the HBM floor")


def h_error_anatomy(d):
    layers = list(d["layers"].values())
    models = [m for m in layers[0]["err"] if all(m in lay["err"] for lay in layers)]
    mean = {m: sum(lay["err"][m] for lay in layers) / len(layers) for m in models}
    return f"rel. error, mean of {len(layers)} layers: " + per_label(mean, lambda v: f"{v:.3g}")


def h_guard(d):
    """bench_muse_guard: per length and variant, what the file's parts measured: perplexity against unpatched, the
    mean layer error and heads made exact, the prefill's speed-up; the needles' overall accuracy per variant."""
    parts = []
    for L, row in d["lengths"].items():
        ppl, err, speed = (row.get("ppl", {}), row.get("errors", {}).get("summary", {}), row.get("speed", {}))
        for label in dict.fromkeys([*ppl, *err, *speed]):
            if label in ("unpatched", "exact"):
                continue
            p, e, s = ppl.get(label, {}).get("vs_unpatched"), err.get(label, {}), speed.get(label, {})
            got = ([f"ppl {100 * p:+.2f}%"] if p is not None else []) \
                + ([f"error {100 * e['mean_layer_error']:.2f}%"] if "mean_layer_error" in e else []) \
                + ([f"{e['heads_exact']}/{e['heads']} heads exact"] if "heads_exact" in e else []) \
                + ([f"prefill {s['speedup_vs_unpatched']:.2f}x"] if "speedup_vs_unpatched" in s else [])
            if got:
                parts.append(f"{L} {label}: " + ", ".join(got))
    niah = d.get("niah", {}).get("overall")
    if niah:
        parts.append("needles: " + ", ".join(f"{k} {v:.2f}" for k, v in niah.items()))
    return "; ".join(parts)


def h_retrieval(d):
    return "mean rel. error: " + per_label(d["mean"], lambda v: f"{v:.3g}")


# per task: the field its rule reads (a file without it is of a layout that carries none of the rule's figures: bench_window
# in speed-op/, bench_train_throughput in finetune/, check_large_shapes in racecheck/ ...; None: the rule reads every
# layout of its task) and the rule (None from a rule: nothing of its figures in this file either)
RULES: dict[str, tuple[str | None, Callable[[dict], str | None]]] = {
    "niah": ("overall", h_niah), "ruler": ("average", h_ruler), "ppl": ("ppl", h_ppl),
    "approx": ("rel_error_mean", h_approx), "speed": ("speedup_vs_reference", h_speed),
    "speed-op": ("results", h_speed_op), "finetune": ("stages", h_finetune), "icr": (None, h_synthetic),
    "icl": (None, h_synthetic), "multigpu-linearize": ("runs", h_multigpu), "lola-mass": ("records", h_lola_mass),
    "lola-needle-in-cache": ("records", h_needle), "lola-needle-study": ("records", h_needle_study),
    "lola-determinism": ("conditions", h_determinism), "lola-determinism-fix": ("conditions", h_determinism),
    "gpu-integration": ("rows", h_gpu_integration), "muse-fidelity": ("results", h_fidelity),
    "muse-farfield-study": ("results", h_fidelity), "muse-fast-study": ("results", h_fidelity),
    "muse-retrieval-study": ("mean", h_retrieval), "lola-speed": ("check_rel_err", h_lola_speed),
    "racecheck": ("families", h_racecheck), "decode-attention": ("rows", h_decode_attention),
    "muse-error-anatomy": ("layers", h_error_anatomy), "peers": ("points", h_peers), "muse-guard": ("lengths", h_guard),
}
# the fallback: (key pattern, how to sum the values found under it, wording)
FALLBACK = (
    (re.compile(r"speedup"), max, "speed-up up to {}x"),
    (re.compile(r"(^|_)(rel_err|rel|rel_error|mean_rel_err|max_rel_err|fwd_vs_reference)$"), max, "max rel. error {}"),
    (re.compile(r"tokens_per_s$|^tok_s"), max, "up to {} tokens/s"),
    (re.compile(r"step_s$"), min, "{} s per step (fastest)"),
    (re.compile(r"(^|_)ms$"), min, "fastest {} ms"),
)


def numbers_under(x: Any, pattern: re.Pattern, key: str = "") -> list[float]:
    if isinstance(x, dict):
        return [v for k, val in x.items() for v in numbers_under(val, pattern, str(k))]
    if isinstance(x, list):
        return [v for val in x for v in numbers_under(val, pattern, key)]
    if isinstance(x, (int, float)) and not isinstance(x, bool) and pattern.search(key):
        return [float(x)]
    return []


class ResultLayoutError(ValueError):
    """A result file whose figures its task's rule cannot read: the message names the file."""


def headline(task: str, d: dict, where: str = "a result") -> str:
    """The task's rule's headline; for a file of a layout that carries none of the rule's figures (no field the rule
    reads, or the rule returns None), the first FALLBACK figure found anywhere in it, else "-". A file the rule cannot
    read is a ResultLayoutError naming `where` (the file)."""
    field, rule = RULES.get(task, (None, None))
    if rule is not None and (field is None or field in d):
        try:
            text = rule(d)
        except Exception as e:  # noqa: BLE001 - any failure of a rule is reported with the file it read
            raise ResultLayoutError(f"{where}: the {task!r} headline cannot be read from this file "
                                    f"({type(e).__name__}: {e}); give benchmarks/index.py's rule for {task!r} this "
                                    "layout") from e
        if text is not None:
            return text
    figures = {k: v for k, v in d.items() if k not in REQUIRED + ("task", "model", "method", "config")}
    for pattern, pick, words in FALLBACK:
        found = numbers_under(figures, pattern)
        if found:
            return words.format(num(pick(found), 3))
    return NONE


# ------------------------------------------------------------------------------------------------ the index
@dataclass
class Row:
    file: str  # relative to the results folder
    task: str
    model: str
    method: str
    device: str
    date: str
    commit: str
    headline: str
    missing: tuple[str, ...]


def describe_device(dev: Any) -> str:
    """The device as the file spells it: one spelling for every result (longctx_patch.provenance.DEVICE_SPELLING)."""
    return str(dev) if dev else UNKNOWN


def describe_method(m: Any) -> str:
    if m is None:
        return NONE
    labels = m if isinstance(m, list) else [m]
    return ", ".join(short(x, 60) for x in labels)


def read_row(path: Path, root: Path) -> Row:
    rel = path.relative_to(root)
    d = json.loads(path.read_text())
    if not isinstance(d, dict):
        raise ValueError(f"{rel}: a result file holds one JSON object")
    task = task_of(d)
    missing = tuple(k for k in REQUIRED if not d.get(k))
    date = str(d["date"])[:10] if d.get("date") else UNKNOWN
    commit = str(d["commit"]) if d.get("commit") else UNKNOWN
    return Row(file=rel.as_posix(), task=task, model=str(d["model"]) if d.get("model") else NONE,
               method=describe_method(d.get("method")), device=describe_device(d.get("device")), date=date,
               commit=commit, headline=headline(task, d, rel.as_posix()), missing=missing)


def collect(root: Path = RESULTS) -> list[Row]:
    return [read_row(p, root) for p in sorted(root.rglob("*.json"), key=lambda p: p.relative_to(root).as_posix())]


def render(rows: list[Row]) -> str:
    folders: dict[str, int] = {}
    for r in rows:
        folders[r.file.split("/")[0]] = folders.get(r.file.split("/")[0], 0) + 1
    out = ["# Results index", "",
           "Written by `python -m benchmarks.index` from every result JSON below this folder; do not edit it by hand "
           "(tests/test_results_index.py checks it is current). Layout and file names: benchmarks/README.md, "
           "section Results. `unknown`: the file does not say; `-`: the file has no such field.", "",
           f"{len(rows)} result files: " + ", ".join(f"[{f}/](#{f}) {n}" for f, n in folders.items()) + ".", ""]
    header = "| task | model | method | device | date | commit | headline | file |"
    for folder in folders:
        out += [f"## {folder}", "", header, "|---|---|---|---|---|---|---|---|"]
        for r in rows:
            if r.file.split("/")[0] == folder:
                name = r.file.split("/", 1)[1] if "/" in r.file else r.file
                out.append("| " + " | ".join(cell(x) for x in (r.task, r.model, r.method, r.device, r.date, r.commit,
                                                              r.headline)) + f" | [{cell(name)}]({r.file}) |")
        out.append("")
    lacking = [r for r in rows if r.missing]
    out += ["## Files without task, device, date, commit or command", ""]
    if lacking:
        out += [f"- `{r.file}`: no {', '.join(r.missing)}" for r in lacking]
    else:
        out.append("None.")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=str(RESULTS), help="results folder (default this checkout's benchmarks/results)")
    ap.add_argument("--out", default=None, help="where to write the index (default <results>/INDEX.md)")
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if the index is not current")
    a = ap.parse_args(argv)
    root = Path(a.results)
    out = Path(a.out) if a.out else root / "INDEX.md"
    text = render(collect(root))
    if a.check:
        current = out.read_text() if out.exists() else ""
        if current != text:
            print(f"{out} is not current: run python -m benchmarks.index", file=sys.stderr)
            return 1
        print(f"{out} is current")
        return 0
    out.write_text(text)
    print(f"wrote {out} ({text.count(chr(10))} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
