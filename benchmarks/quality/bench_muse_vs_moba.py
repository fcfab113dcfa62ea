"""MuSe against MoBA at equal exactly-attended keys, on a real model's Q/K/V: attention error and op time in one run,
and the plot of error against exactly attended keys (one curve per method and length).

    python3 -m benchmarks.quality.bench_muse_vs_moba --model GGUF_OR_DIR --device cuda      # 32k and 64k (~6 min)
    TRITON_INTERPRET=1 python3 -m benchmarks.quality.bench_muse_vs_moba --smoke            # CPU: SmolLM2, 1k tokens

Q/K/V: one forward of the model over the first max(--seqs) tokens of --text (a file or a folder of text files;
default: the Python standard library's source, present on every machine), every layer exact, the post-rotary q, k, v
of --layers kept (default every fourth; `longctx_patch.evals.approx.capture`); a shorter length is the same tensors'
first S positions (a causal model's Q/K/V there do not depend on later tokens). Past the model's trained context (64k
on a 32k model) rotary extrapolates, as it would in use.

The sweep: for each budget E of --keys (exactly attended keys per query, the mean over the S queries) each method
takes its setting whose count is nearest E, counted from the setting (`kernels.muse.attended_keys`,
`kernels.moba.moba_attended_keys`; the JSON records each count, the plot's x): MoBA (block_size --moba-block, top_k:
its own block plus top_k - 1 gated blocks), MuSe `cells` (blocks of 256, the sink and local block, topk_blocks =
peak_blocks; k_clusters 8 cells summarise every other block: MuSe's super-keys, counted apart) and `tilted-cells` (the
same exact part, 256 global query clusters). Error: ||o - o_exact|| / ||o_exact|| per layer, o_exact exact attention
in fp32 on the same (model-dtype) Q/K/V; the mean over the layers is the curve. At each length and method the ratio
of MuSe's error to MoBA's at equal keys (MoBA's curve interpolated, linearly in log keys) is the headline.

Op time (CUDA): `triton.testing.do_bench` median of each setting's op (plan included) on the first layer's Q/K/V, and
SDPA's cuDNN causal attention on the same inputs in the same run (off CUDA: the first layer's call timed once, no
baseline: the code runs, the number is no speed).
Result: <out>/muse-vs-moba-<model>-<device>.json (device, date, commit, command, settings, rows, ratios) and the .png
beside it; --out folder (default $OUT, else benchmarks/results/muse); --budget seconds after which rows are skipped.
"""

from __future__ import annotations

import argparse
import bisect
import datetime
import glob
import json
import math
import os
import shlex
import sys
import time
from pathlib import Path

import torch

from benchmarks.shared import device_token, model_token, results_dir
from longctx_patch.evals.common import format_table, pyplot
from longctx_patch.provenance import device_description, git_commit
from longctx_patch.kernels.moba import moba_attended_keys, moba_attention
from longctx_patch.kernels.muse import MuseOptions, attended_keys, muse_attention
from longctx_patch.kernels.softmax import softmax_attention

METHODS = ("moba", "cells", "tilted-cells")


def stdlib_text(chars: int) -> str:
    """The Python standard library's source, file by file in name order, until `chars` characters."""
    parts, n = [], 0
    for p in sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py"))):
        parts.append(Path(p).read_text(encoding="utf-8", errors="replace"))
        n += len(parts[-1])
        if n >= chars:
            break
    return "\n".join(parts)


def read_text(path: str | None, chars: int) -> str:
    if path is None:
        return stdlib_text(chars)
    from longctx_patch.texts import text_files

    return "\n\n".join(f.read_text(encoding="utf-8", errors="replace") for f in text_files(path, skip_meta=True))


def settings(method: str, S: int, keys: int, *, moba_block: int, muse_block: int, k_clusters: int,
             q_clusters: int) -> tuple[dict, float, float]:
    """The setting of `method` whose exactly attended keys per query (mean over S queries) are nearest `keys`:
    (its options, exact keys, super-keys)."""
    L = moba_block if method == "moba" else muse_block
    nb = -(-S // L)
    best = None
    for b in range(nb + 1):
        if method == "moba":
            cfg = dict(block_size=moba_block, top_k=b + 1, gating="block")
            exact, sup = moba_attended_keys(S, **cfg), 0.0
        else:
            cfg = dict(far_field=method, block_size=muse_block, k_clusters=k_clusters, topk_blocks=(b + 1) // 2,
                       peak_blocks=b // 2, local_blocks=1, sink_blocks=1, kmeans_iters=2)
            if method == "tilted-cells":
                cfg["q_clusters"] = q_clusters
            exact, sup = attended_keys(S, **cfg)
        if best is None or abs(exact - keys) < abs(best[1] - keys):
            best = (cfg, exact, sup)
    return best


def run(method: str, cfg: dict, q, k, v, scale: float):
    if method == "moba":
        return moba_attention(q, k, v, scale=scale, backend="auto", **cfg)
    return muse_attention(q, k, v, scale=scale, options=MuseOptions(**cfg), backend="auto")


def rel(o, ref) -> float:
    return float((o.double() - ref.double()).norm() / ref.double().norm())


def ratios(rows: list[dict]) -> dict:
    """At each length, each MuSe point's error over MoBA's at the same exactly attended keys (MoBA's errors
    interpolated linearly in log keys; points outside MoBA's range are left out)."""
    out = {}
    for S in sorted({r["S"] for r in rows}):
        moba = sorted((r["exact_keys"], r["error"]) for r in rows if r["S"] == S and r["method"] == "moba")
        xs = [math.log(x) for x, _ in moba]
        for m in METHODS[1:]:
            got = []
            for r in rows:
                if r["S"] != S or r["method"] != m:
                    continue
                x = math.log(r["exact_keys"])
                i = bisect.bisect_left(xs, x)
                if not xs or x < xs[0] or x > xs[-1]:
                    continue
                if xs[i] == x:
                    e = moba[i][1]
                else:
                    t = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
                    e = moba[i - 1][1] + t * (moba[i][1] - moba[i - 1][1])
                got.append(dict(exact_keys=r["exact_keys"], error=r["error"], moba_error=e, ratio=r["error"] / e))
            if got:
                out[f"{S}/{m}"] = dict(points=got, max_ratio=max(g["ratio"] for g in got),
                                       mean_ratio=sum(g["ratio"] for g in got) / len(got))
    return out


def plot(res: dict, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    styles = {"moba": ("tab:red", "o"), "cells": ("tab:blue", "s"), "tilted-cells": ("tab:green", "^")}
    for S in sorted({r["S"] for r in res["rows"]}):
        for m in METHODS:
            pts = sorted((r["exact_keys"], r["error"]) for r in res["rows"] if r["S"] == S and r["method"] == m)
            if pts:
                color, marker = styles[m]
                ax.plot(*zip(*pts), marker=marker, color=color, linestyle="-" if S == max(res["seqs"]) else "--",
                        label=f"{m}, {S // 1024}k")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("exactly attended keys per query (mean over the queries)")
    ax.set_ylabel("attention error ||o - o_exact|| / ||o_exact||")
    ax.set_title(f"{res['model']}: MuSe vs MoBA at equal exact keys ({res['device']}, {res['commit']})", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", help="alias, .gguf file or directory (load_model)")
    ap.add_argument("--text", default=None, help="a text file or folder (default: the standard library's source)")
    ap.add_argument("--seqs", default="32768,65536", help="lengths, comma-separated (default 32768,65536)")
    ap.add_argument("--keys", default="1024,2048,4096,8192,12288",
                    help="budgets: exactly attended keys per query (default 1024,2048,4096,8192,12288)")
    ap.add_argument("--layers", default=None, help="comma-separated layers (default every fourth)")
    ap.add_argument("--methods", default=",".join(METHODS), help=f"any of {','.join(METHODS)}")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", help="the model's dtype (the Q/K/V's; default bfloat16)")
    ap.add_argument("--budget", type=float, default=540.0, help="seconds; later rows are skipped (default 540)")
    ap.add_argument("--smoke", action="store_true", help="CPU (TRITON_INTERPRET=1): SmolLM2, 1k tokens, small blocks")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="result folder (default $OUT, else results/muse)")
    a = ap.parse_args(argv)
    t0 = time.time()
    blocks = dict(moba_block=512, muse_block=256, k_clusters=8, q_clusters=256)
    if a.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("--smoke runs on the CPU through the Triton interpreter: set TRITON_INTERPRET=1")
        a.device, a.dtype, seqs, keys = "cpu", "float32", [1024], [160, 320]
        blocks = dict(moba_block=128, muse_block=64, k_clusters=4, q_clusters=16)
        layers = [0, 15] if a.layers is None else [int(x) for x in a.layers.split(",")]
    else:
        if a.device.startswith("cuda") and not torch.cuda.is_available():
            raise SystemExit("no CUDA GPU here: run on a GPU machine, or --smoke with TRITON_INTERPRET=1 on the CPU")
        seqs, keys = [int(s) for s in a.seqs.split(",")], [int(x) for x in a.keys.split(",")]
        layers = None if a.layers is None else [int(x) for x in a.layers.split(",")]
    methods = [m for m in a.methods.split(",") if m]
    bad = sorted(set(methods) - set(METHODS))
    if bad:
        raise SystemExit(f"--methods: unknown {bad}; any of {','.join(METHODS)}")
    import longctx_patch
    from longctx_patch.evals.approx import capture

    model, tok = longctx_patch.load_model(a.model, dtype=a.dtype, device=a.device)
    n_layers = len(model.model.layers)
    layers = layers if layers is not None else list(range(0, n_layers, 4))
    S_max = max(seqs)
    ids = tok(read_text(a.text, S_max * 8), return_tensors="pt").input_ids[:, :S_max]
    if ids.shape[1] < S_max:
        raise SystemExit(f"the text has {ids.shape[1]} tokens; --seqs asks for {S_max}")
    got = capture(model, ids.to(model.device), layers=layers)
    scale = float(model.model.layers[layers[0]].self_attn.scaling)
    del model
    cuda = a.device.startswith("cuda")
    if cuda:
        import triton
        from torch.nn.attention import SDPBackend, sdpa_kernel
        import torch.nn.functional as F

    def bench(fn) -> float:
        return triton.testing.do_bench(fn, warmup=3, rep=30, return_mode="median")

    res = dict(task="muse-muse-vs-moba", device=device_description(a.device),
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), commit=git_commit(),
               command=" ".join(["python3 -m benchmarks.quality.bench_muse_vs_moba",
                                 *map(shlex.quote, sys.argv[1:] if argv is None else argv)]),
               model=a.model, dtype=a.dtype, text=a.text or "the Python standard library's source", layers=layers,
               seqs=seqs, keys=keys, blocks=blocks, timer="do_bench median (ms)" if cuda else "the first layer's call, once (CPU: no speed)",
               metric="||o - o_exact|| / ||o_exact||, o_exact fp32 on the same Q/K/V; mean over the layers",
               rows=[], cudnn_fwd_ms={}, skipped=[])
    for S in seqs:
        qkv = {i: tuple(t[:, :, :S].contiguous() for t in got[i][:3]) for i in layers}
        refs = {i: softmax_attention(*(t.float() for t in qkv[i]), scale=scale) for i in layers}
        q0, k0, v0 = qkv[layers[0]]
        if cuda:
            G = q0.shape[1] // k0.shape[1]
            kx, vx = k0.repeat_interleave(G, 1), v0.repeat_interleave(G, 1)
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                res["cudnn_fwd_ms"][str(S)] = bench(lambda: F.scaled_dot_product_attention(q0, kx, vx, is_causal=True,
                                                                                             scale=scale))
        for E in keys:
            for m in methods:
                if time.time() - t0 > a.budget:
                    res["skipped"].append(dict(S=S, keys=E, method=m, why=f"over the {a.budget:.0f} s budget"))
                    continue
                cfg, exact, sup = settings(m, S, E, **blocks)
                if any(r["S"] == S and r["method"] == m and r["config"] == cfg for r in res["rows"]):
                    continue  # the same setting nearest two budgets: measured once
                with torch.no_grad():
                    errs, first = [], None
                    for i in layers:
                        t = time.perf_counter()
                        errs.append(rel(run(m, cfg, *qkv[i], scale), refs[i]))
                        first = first if first is not None else 1e3 * (time.perf_counter() - t)
                    ms = bench(lambda: run(m, cfg, q0, k0, v0, scale)) if cuda else first
                row = dict(S=S, method=m, budget=E, config=cfg, exact_keys=exact, super_keys=sup,
                           error=sum(errs) / len(errs), error_per_layer=errs, fwd_ms=ms)
                if cuda:
                    row["fwd_vs_cudnn"] = res["cudnn_fwd_ms"][str(S)] / ms
                res["rows"].append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "error_per_layer"}), flush=True)
        del qkv, refs
    res["ratios_vs_moba"] = ratios(res["rows"])
    res["wall_s"] = round(time.time() - t0, 1)
    name = f"muse-vs-moba-{model_token(a.model)}{'-smoke' if a.smoke else ''}-{device_token(a.device)}"
    path = results_dir("muse", a.out) / f"{name}.json"
    path.write_text(json.dumps(res, indent=1))
    plot(res, path.with_suffix(".png"))
    print(format_table(["S", "method", "exact keys/query", "super-keys", "error", "fwd ms", "vs cuDNN"],
                       [[r["S"], r["method"], f"{r['exact_keys']:.0f}", f"{r['super_keys']:.0f}", f"{r['error']:.4f}",
                         f"{r['fwd_ms']:.2f}", f"{r['fwd_vs_cudnn']:.2f}x" if "fwd_vs_cudnn" in r else "-"]
                        for r in res["rows"]]))
    for key, v in res["ratios_vs_moba"].items():
        print(f"{key}: MuSe error / MoBA error at equal keys: max {v['max_ratio']:.3f}, mean {v['mean_ratio']:.3f}")
    print(f"wrote {path} and {path.with_suffix('.png').name} ({res['wall_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
