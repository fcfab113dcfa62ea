"""MuSe's run-time guard on a real model: per-head attention error with and without it, held-out perplexity, needles
and whole-model prefill time against the unpatched model, for `muse`'s defaults at several guard budgets.

    python3 -m benchmarks.quality.bench_muse_guard --model GGUF_OR_DIR --device cuda --text ESSAYS   # 32k, 64k
    python3 -m benchmarks.quality.bench_muse_guard --device cpu --dtype float32 --lengths 8192 \\
        --parts errors,ppl --windows 1 --text tests/data/pg_essays                                    # SmolLM2, CPU
    TRITON_INTERPRET=1 python3 -m benchmarks.quality.bench_muse_guard --smoke                         # CPU, 1 minute

Variants: the unpatched model, `muse` with the guard off (`guard_error=None`: the defaults as before the guard) and
`muse` with `guard_error=B` for each B of --budgets; every other option the defaults' or --set's (so on CUDA
`min_seq_len` is the crossover: a 16k window runs exact attention there, as a user's default does; the errors part
runs MuSe whatever the length).
Parts (--parts):
- errors: the first window of each --lengths L, every layer's post-rotary Q/K/V of the unpatched model
  (`evals.approx.capture`); per layer and head MuSe's error against exact attention in fp32, over the rows MuSe
  approximates (the guard's measure) and over the whole call (the issue's per-layer measure), the guard's estimate
  of the former, and per budget the heads made exact and the layer's error after the guard (as the patched layer
  runs it: `guard.guard` over MuSe's output, what `MuseAttention._muse` runs after it); times (CUDA: do_bench
  median; CPU: one call) of MuSe, of the guard's estimate, of each budget's guard (estimate and exact heads) and
  of exact attention (SDPA) on the same inputs.
- ppl: perplexity over --windows windows of L tokens of --text (`evals.ppl`), each variant; the guard's decisions
  per variant (`guard_log`: estimates taken, over budget, worst).
- niah: `evals.niah.run_niah` on --niah-tasks at --niah-lengths and --niah-depths, each variant.
- speed: the decoder's forward over one window (no logits, no cache) at each length, each variant, against the
  unpatched model (CUDA events, median of --repeats after one warm-up; CPU: one call).
Result: <out>/guard-<model>-<device>.json (device, date, commit, command, config, per part and length the figures);
--out folder (default $OUT, else benchmarks/results/muse).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shlex
import statistics
import sys
import time

import torch

from benchmarks.shared import device_token, model_token, results_dir
from longctx_patch.evals.common import format_table
from longctx_patch.provenance import device_description, git_commit
from longctx_patch.timing import cuda_median_ms

PARTS = ("errors", "ppl", "niah", "speed")


def variants(budgets, sets) -> list[tuple[str, dict | None]]:
    """[(label, muse options or None for the unpatched model)]."""
    out = [("unpatched", None), ("guard off", {**sets, "guard_error": None})]
    out += [(f"guard {100 * b:g}%", {**sets, "guard_error": b}) for b in budgets]
    return out


def head_errors(o, ref, first: int) -> tuple[list[float], list[float], list[float], list[float]]:
    """Per head: (squared error and squared norm over the rows from `first` on, the same over every row)."""
    d = (o.float() - ref).double().pow(2).sum(-1)[0]  # [S, H]
    n = ref.double().pow(2).sum(-1)[0]
    return d[first:].sum(0).tolist(), n[first:].sum(0).tolist(), d.sum(0).tolist(), n.sum(0).tolist()


def ratio(a: float, b: float) -> float:
    return math.sqrt(a / b) if b > 0 else 0.0


def errors_part(model, ids, budgets, sets, timer) -> dict:
    from longctx_patch.evals.approx import capture
    from longctx_patch.kernels.muse import muse_attention
    from longctx_patch.kernels.softmax import softmax_attention
    import longctx_patch as lp
    from longctx_patch.methods.muse.guard import estimate_errors, first_approximated, guard, guard_log
    from longctx_patch.patcher import patched_modules

    got = capture(model, ids)
    out: dict = {"layers": {}}
    mods = {}
    for label, cfg in variants(budgets, sets)[1:]:
        lp.patch(model, "muse", **cfg)
        mods[label] = patched_modules(model)
        lp.unpatch(model)
    off = mods["guard off"]
    tot = {label: [0.0, 0.0] for label in mods}
    for i, (q, k, v, _) in sorted(got.items()):
        mod = off[i]
        c = mod.method_config
        first = first_approximated(c)
        with torch.no_grad():
            ref = softmax_attention(q.float(), k.float(), v.float(), scale=mod.scaling)
            o, muse_ms = timer(lambda: muse_attention(q, k, v, scale=mod.scaling, options=c.kernel_options(),
                                                      backend=c.backend))
            sq, den, sq_all, den_all = head_errors(o, ref, first)
            (est, _), estimate_ms = timer(lambda: estimate_errors(o, q, k, v, None, scale=mod.scaling, first=first,
                                                                  rows=c.guard_rows))
            row = dict(first=first,
                       approx_rows_error=[ratio(a, b) for a, b in zip(sq, den)],
                       call_error=[ratio(a, b) for a, b in zip(sq_all, den_all)],
                       estimate=est[0].tolist(), muse_ms=muse_ms, estimate_ms=estimate_ms,
                       exact_ms=timer(lambda: softmax_attention(q, k, v, scale=mod.scaling))[1],
                       layer_error=ratio(sum(sq_all), sum(den_all)), budgets={})
            tot["guard off"][0] += row["muse_ms"]
            tot["guard off"][1] += row["layer_error"]
            for label, m in mods.items():
                if label == "guard off":
                    continue
                g = m[i]  # what its _muse runs after MuSe: the guard over MuSe's output (exact_heads: none here)
                with guard_log() as log:
                    og, guard_ms = timer(lambda: guard(o, q, k, v, None, config=g.method_config, scale=g.scaling,
                                                       layer=i))
                s2, d2, s2_all, d2_all = head_errors(og, ref, first)
                made = sorted({h for call in log.calls for _, h in call.exact})
                row["budgets"][label] = dict(
                    heads_exact=made, approx_rows_error=[ratio(a, b) for a, b in zip(s2, d2)],
                    layer_error=ratio(sum(s2_all), sum(d2_all)), guard_ms=guard_ms, ms=muse_ms + guard_ms)
                tot[label][0] += row["budgets"][label]["ms"]
                tot[label][1] += row["budgets"][label]["layer_error"]
        out["layers"][str(i)] = row
        print(f"  layer {i}: MuSe {100 * row['layer_error']:.2f}% (worst head over the approximated rows "
              f"{100 * max(row['approx_rows_error']):.1f}%), "
              + ", ".join(f"{lab} {100 * b['layer_error']:.2f}% ({len(b['heads_exact'])} exact)"
                          for lab, b in row["budgets"].items()), flush=True)
    n = len(out["layers"])
    rows = out["layers"].values()
    out["summary"] = {label: dict(mean_layer_error=t[1] / n, ms=t[0]) for label, t in tot.items()}
    out["summary"]["exact"] = dict(mean_layer_error=0.0, ms=sum(r["exact_ms"] for r in rows))
    out["summary"]["guard off"]["estimate_ms"] = sum(r["estimate_ms"] for r in rows)
    out["summary"]["guard off"]["estimate_vs_muse"] = out["summary"]["guard off"]["estimate_ms"] / \
        out["summary"]["guard off"]["ms"]
    pairs = [(e, t) for r in rows for e, t in zip(r["estimate"], r["approx_rows_error"]) if t > 0]
    logs = sorted(abs(math.log(e / t)) for e, t in pairs if e > 0)
    out["estimate_vs_true"] = dict(heads=len(pairs), median_abs_log_ratio=statistics.median(logs) if logs else None,
                                   p90_abs_log_ratio=logs[int(0.9 * (len(logs) - 1))] if logs else None,
                                   max_abs_log_ratio=logs[-1] if logs else None)
    for label in mods:
        if label == "guard off":
            continue
        made = sum(len(r["budgets"][label]["heads_exact"]) for r in rows)
        heads = sum(len(r["estimate"]) for r in rows)
        out["summary"][label].update(heads_exact=made, heads=heads,
                                     worst_head_after=max(max(r["budgets"][label]["approx_rows_error"])
                                                          for r in rows))
    out["summary"]["guard off"]["worst_head"] = max(max(r["approx_rows_error"]) for r in rows)
    return out


def ppl_part(model, wins, budgets, sets) -> dict:
    import longctx_patch as lp
    from longctx_patch.evals.ppl import token_losses
    from longctx_patch.methods.muse.guard import guard_log

    out = {}
    for label, cfg in variants(budgets, sets):
        if cfg is not None:
            lp.patch(model, "muse", **cfg)
        t = time.perf_counter()
        with guard_log() as log:
            losses = [token_losses(model, torch.tensor([w], device=model.device)) for w in wins]
        ppl = math.exp(float(torch.cat(losses).double().mean()))
        if cfg is not None:
            lp.unpatch(model)
        w = log.worst()
        out[label] = dict(ppl=ppl, s=round(time.perf_counter() - t, 1), estimates=log.measured(),
                          over_budget=sum(len(c.exact) for c in log.calls),
                          worst_estimate=None if w is None else w[0], exact_heads=log.exact_heads())
        print(f"  {label}: ppl {ppl:.4f} ({out[label]['s']} s; {out[label]['over_budget']} of "
              f"{out[label]['estimates']} head estimates over budget)", flush=True)
    base = out["unpatched"]["ppl"]
    for label in out:
        out[label]["vs_unpatched"] = out[label]["ppl"] / base - 1
    return out


def speed_part(model, ids, budgets, sets, repeats: int) -> dict:
    import longctx_patch as lp
    from longctx_patch.architectures import base_model
    from longctx_patch.methods.muse.guard import guard_log

    cuda = ids.is_cuda

    def once():
        with torch.no_grad():
            base_model(model)(input_ids=ids, use_cache=False)

    def timed() -> float:
        if not cuda:
            t = time.perf_counter()
            once()
            return 1e3 * (time.perf_counter() - t)
        return cuda_median_ms(once, reps=repeats, warmup=1)

    out = {}
    for label, cfg in variants(budgets, sets):
        if cfg is not None:
            lp.patch(model, "muse", **cfg)
        with guard_log() as log:
            once()
        out[label] = dict(ms=timed(), over_budget=sum(len(c.exact) for c in log.calls), estimates=log.measured())
        if cfg is not None:
            lp.unpatch(model)
        if cuda:
            torch.cuda.empty_cache()
    for label in out:
        out[label]["speedup_vs_unpatched"] = out["unpatched"]["ms"] / out[label]["ms"]
        print(f"  {label}: {out[label]['ms']:.1f} ms, {out[label]['speedup_vs_unpatched']:.2f}x unpatched", flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", help="alias, .gguf file or directory (load_model)")
    ap.add_argument("--text", default=None, help="held-out text: a file or folder (default: tests/data/pg_essays)")
    ap.add_argument("--lengths", default="32768,65536", help="window lengths (default 32k, 64k)")
    ap.add_argument("--windows", type=int, default=4, help="perplexity windows per length (default 4)")
    ap.add_argument("--budgets", default="0.05,0.1,0.2", help="guard_error values (default 5%%, 10%%, 20%%)")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"of {', '.join(PARTS)} (default all)")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="a muse option of every variant, repeatable")
    ap.add_argument("--niah-tasks", default="s-niah-1,s-niah-2")
    ap.add_argument("--niah-lengths", default="16384,32768")
    ap.add_argument("--niah-depths", default=",".join(f"{d / 7:.4f}" for d in range(8)), help="8 depths, 0 to 1")
    ap.add_argument("--niah-haystack", default=None, help="haystack folder or file (default: --text)")
    ap.add_argument("--repeats", type=int, default=3, help="timed prefills per variant on CUDA (default 3)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--smoke", action="store_true", help="CPU: SmolLM2, one window of 640 tokens, blocks of 32")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="result folder (default $OUT, else results/muse)")
    a = ap.parse_args(argv)
    t0 = time.time()
    sets = dict(s.split("=", 1) for s in a.sets)
    parts = [p for p in a.parts.split(",") if p]
    bad = [p for p in parts if p not in PARTS]
    if bad:
        raise SystemExit(f"--parts: unknown {bad}; of {', '.join(PARTS)}")
    if a.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("--smoke runs on the CPU through the Triton interpreter: set TRITON_INTERPRET=1")
        a.device, a.dtype, a.windows, a.lengths, parts = "cpu", "float32", 1, "640", ["errors", "ppl", "speed"]
        sets = {"block_size": "32", "k_clusters": "1", "topk_blocks": "2", "peak_blocks": "2", "min_seq_len": "0",
                **sets}
    elif a.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU here: run on a GPU machine, or --smoke with TRITON_INTERPRET=1 on the CPU")
    budgets = [float(x) for x in a.budgets.split(",") if x]
    lengths = [int(x) for x in a.lengths.split(",") if x]
    import longctx_patch as lp
    from longctx_patch.evals.ppl import load_texts, token_stream, windows

    cuda = a.device.startswith("cuda")
    if cuda:
        import triton

    def timer(fn):
        """(fn's result, its time in ms): CUDA do_bench's median over repeated calls, else the one call."""
        if cuda:
            return fn(), triton.testing.do_bench(fn, warmup=3, rep=30, return_mode="median")
        t = time.perf_counter()
        r = fn()
        return r, 1e3 * (time.perf_counter() - t)

    text = a.text or os.path.join(os.path.dirname(__file__), "..", "..", "tests", "data", "pg_essays")
    model, tok = lp.load_model(a.model, dtype=a.dtype, device=a.device)
    model.eval()
    stream = token_stream(tok, load_texts(text))
    res = dict(task="muse-guard", device=device_description(a.device),
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), commit=git_commit(),
               command=" ".join(["python3 -m benchmarks.quality.bench_muse_guard",
                                 *map(shlex.quote, sys.argv[1:] if argv is None else argv)]),
               model=a.model, dtype=a.dtype, text=a.text or "tests/data/pg_essays", tokens=len(stream),
               config=lp.get_method("muse").parse_config(sets).to_dict(), budgets=budgets, parts=parts,
               timer="do_bench median (ms)" if cuda else "one CPU call (ms)", lengths={})
    for L in lengths:
        wins = windows(stream, L, a.windows)
        if not wins:
            res["lengths"][str(L)] = dict(skipped=f"the text has {len(stream)} tokens, fewer than {L}")
            continue
        row: dict = {"windows": len(wins)}
        ids = torch.tensor([wins[0]], device=model.device)
        if "errors" in parts:
            print(f"{L}: attention error per layer and head", flush=True)
            row["errors"] = errors_part(model, ids, budgets, sets, timer)
        if "ppl" in parts:
            print(f"{L}: perplexity over {len(wins)} windows", flush=True)
            row["ppl"] = ppl_part(model, wins, budgets, sets)
        if "speed" in parts:
            print(f"{L}: prefill time", flush=True)
            row["speed"] = speed_part(model, ids, budgets, sets, a.repeats)
        res["lengths"][str(L)] = row
    if "niah" in parts:
        from longctx_patch.evals.common import MethodRun
        from longctx_patch.evals.niah import run_niah

        runs = [MethodRun("none") if cfg is None else MethodRun("muse", {k: v for k, v in cfg.items()})
                for _, cfg in variants(budgets, sets)]
        got = run_niah((model, tok), runs, tasks=a.niah_tasks.split(","),
                       lengths=[int(x) for x in a.niah_lengths.split(",")],
                       depths=[float(x) for x in a.niah_depths.split(",")], haystack=a.niah_haystack or text,
                       out_dir=None, progress=False)
        fig = got["figures"]
        res["niah"] = {k: fig[k] for k in ("accuracy", "overall", "paired", "tasks", "lengths", "depths", "haystack")}
        res["niah"]["labels"] = {label: r.label for (label, _), r in zip(variants(budgets, sets), runs)}
    res["wall_s"] = round(time.time() - t0, 1)
    path = results_dir("muse", a.out) / f"guard-{model_token(a.model)}{'-smoke' if a.smoke else ''}-" \
                                         f"{device_token(a.device)}.json"
    path.write_text(json.dumps(res, indent=1))
    table = []
    for L, row in res["lengths"].items():
        for label, _ in variants(budgets, sets):
            e = row.get("errors", {}).get("summary", {}).get(label, {})
            p = row.get("ppl", {}).get(label)
            s = row.get("speed", {}).get(label)
            table.append([L, label, f"{100 * p['vs_unpatched']:+.2f}%" if p else "-",
                          f"{100 * e['mean_layer_error']:.2f}%" if e else "-",
                          f"{e.get('heads_exact', '-')}/{e.get('heads', '-')}" if e else "-",
                          f"{s['speedup_vs_unpatched']:.2f}x" if s else "-"])
    print(format_table(["L", "variant", "ppl vs unpatched", "mean layer error", "heads exact", "prefill vs unpatched"],
                       table))
    print(f"wrote {path} ({res['wall_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
