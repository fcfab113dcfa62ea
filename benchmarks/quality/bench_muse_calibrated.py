"""A calibrated MuSe patch on a real model against the unpatched model and `muse`'s defaults, in one run: held-out
perplexity, attention error per layer and attention time against cuDNN, at each length (issue 53's targets, on
Qwen2.5-Coder-0.5B).

    python3 -m benchmarks.quality.bench_muse_calibrated --model GGUF_OR_DIR --device cuda   # 16k, 32k; time at 64k too
    TRITON_INTERPRET=1 python3 -m benchmarks.quality.bench_muse_calibrated --smoke         # CPU: SmolLM2, 2 layers

1. Calibrate (`longctx_patch.calibrate`, docs/muse.md "Calibration") on the first --calib-len tokens of --calib-text
   (default: the Python standard library's source, from its first files) to --target-error (--objective; cost "auto":
   op time on CUDA), every layer (--layers).
2. At each --lengths L, on held-out text (--text; default: the standard library's source from its last files
   backwards, none of them in the calibration's text):
   - perplexity over --windows windows of L tokens, of the unpatched model, the calibrated patch and `muse` with its
     defaults, each as the patched model runs it (on CUDA below the crossover, min_seq_len's default, MuSe's layers run
     exact attention);
   - attention error per layer, ||o - o_exact|| / ||o_exact|| against exact attention in fp32 on the first window's
     Q/K/V (the unpatched model's), of both patches: as run at L, and MuSe forced (`MuseAttention.approximate`);
   - attention time (CUDA: do_bench median; off CUDA one call) of every layer as run at L, of both patches, against
     SDPA's cuDNN causal attention on the same Q/K/V, summed over the layers.
   --time-lengths: more lengths for the error and time alone (default 65536; off CUDA none).
Result: <out>/calibrated-<model>-<device>.json (device, date, commit, command; the calibration; per length the
perplexities, errors, times); --out folder (default $OUT, else benchmarks/results/muse).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shlex
import sys
import time

import torch

from benchmarks.quality.bench_muse_vs_moba import stdlib_text
from benchmarks.shared import device_token, model_token, results_dir
from longctx_patch.evals.common import format_table
from longctx_patch.provenance import device_description, git_commit


def stdlib_files_reversed(chars: int) -> str:
    """The standard library's source from its last files backwards (disjoint from `stdlib_text`'s first files while
    the two together are shorter than the library, 4.7 MB: 32k tokens of calibration and 8 x 32k held-out take 1.5)."""
    import glob
    from pathlib import Path

    parts, n = [], 0
    for p in sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")), reverse=True):
        parts.append(Path(p).read_text(encoding="utf-8", errors="replace"))
        n += len(parts[-1])
        if n >= chars:
            break
    return "\n".join(parts)


def texts(path, chars: int, default) -> list[str]:
    if path is None:
        return [default(chars)]
    from longctx_patch.evals.ppl import load_texts

    return load_texts(path)


def groups_of(model) -> list[tuple[str, dict, list[int]]]:
    from longctx_patch.patcher import patch_groups

    return [(g.method, g.config.to_dict(), list(g.layers)) for g in patch_groups(model)]


def apply(model, groups) -> None:
    import longctx_patch as lp

    for method, config, layers in groups:
        lp.patch(model, method, layers=layers, **config)


def rel(o, ref) -> float:
    return float((o.double() - ref.double()).norm() / ref.double().norm())


def perplexity(model, wins) -> float:
    from longctx_patch.evals.ppl import token_losses

    losses = [token_losses(model, torch.tensor([w], device=model.device)) for w in wins]
    return math.exp(float(torch.cat(losses).double().mean()))


def layer_figures(model, captured, bench) -> dict:
    """Per patched layer: error as run and MuSe forced, time as run, against exact attention (fp32) and cuDNN."""
    import torch.nn.functional as F

    from longctx_patch.kernels.softmax import softmax_attention
    from longctx_patch.patcher import patched_modules

    out = {"as_run": {}, "forced": {}, "ms": {}, "cudnn_ms": {}}
    for i, mod in patched_modules(model).items():
        q, k, v, _ = captured[i]
        ref = softmax_attention(q.float(), k.float(), v.float(), scale=mod.scaling)
        with torch.no_grad():
            out["as_run"][i] = rel(mod.attend(q, k, v, None, None), ref)
            out["forced"][i] = rel(mod.approximate(q, k, v) if mod.method_name == "muse" else
                                   mod.attend(q, k, v, None, None), ref)
            out["ms"][i] = bench(lambda: mod.attend(q, k, v, None, None))
            if q.is_cuda:
                from torch.nn.attention import SDPBackend, sdpa_kernel

                G = q.shape[1] // k.shape[1]
                kx, vx = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    out["cudnn_ms"][i] = bench(lambda: F.scaled_dot_product_attention(q, kx, vx, is_causal=True,
                                                                                        scale=mod.scaling))
    n = len(out["as_run"])
    out["mean_as_run"] = sum(out["as_run"].values()) / n
    out["mean_forced"] = sum(out["forced"].values()) / n
    out["max_forced"] = max(out["forced"].values())
    out["total_ms"] = sum(out["ms"].values())
    if out["cudnn_ms"]:
        out["total_cudnn_ms"] = sum(out["cudnn_ms"].values())
        out["vs_cudnn"] = out["total_cudnn_ms"] / out["total_ms"]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", help="alias, .gguf file or directory (load_model)")
    ap.add_argument("--calib-text", default=None, help="calibration text: file or folder (default: stdlib, first files)")
    ap.add_argument("--text", default=None, help="held-out text: file or folder (default: stdlib, last files)")
    ap.add_argument("--calib-len", type=int, default=32768, help="calibration tokens (default 32768)")
    ap.add_argument("--target-error", type=float, default=0.01)
    ap.add_argument("--objective", default="layer", choices=["layer", "mean"])
    ap.add_argument("--lengths", default="16384,32768", help="perplexity, error and time lengths (default 16k,32k)")
    ap.add_argument("--time-lengths", default="65536", help="error and time only (default 65536)")
    ap.add_argument("--windows", type=int, default=8, help="held-out windows per length for perplexity (default 8)")
    ap.add_argument("--layers", default=None, help="layers to calibrate and patch (default all)")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="a muse option of the calibration's config and the defaults' run, repeatable")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--smoke", action="store_true", help="CPU: SmolLM2, 2 layers, 640 tokens, blocks of 64")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="result folder (default $OUT, else results/muse)")
    a = ap.parse_args(argv)
    t0 = time.time()
    sets = dict(s.split("=", 1) for s in a.sets)
    if a.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("--smoke runs on the CPU through the Triton interpreter: set TRITON_INTERPRET=1")
        a.device, a.dtype, a.calib_len, a.windows, a.layers = "cpu", "float32", 640, 1, a.layers or "0,15"
        lengths, time_lengths = [640], []
        sets = {"block_size": "64", "k_clusters": "4", "min_seq_len": "0", **sets}
        ladder = [{"topk_blocks": 1, "peak_blocks": 1}, {"topk_blocks": 3, "peak_blocks": 3}]
    else:
        if a.device.startswith("cuda") and not torch.cuda.is_available():
            raise SystemExit("no CUDA GPU here: run on a GPU machine, or --smoke with TRITON_INTERPRET=1 on the CPU")
        lengths = [int(x) for x in a.lengths.split(",") if x]
        time_lengths = [int(x) for x in a.time_lengths.split(",") if x]
        ladder = None
    import longctx_patch as lp
    from longctx_patch.evals.approx import capture
    from longctx_patch.evals.ppl import token_stream, windows

    cuda = a.device.startswith("cuda")
    if cuda:
        import triton

    def bench(fn) -> float:
        if cuda:
            return triton.testing.do_bench(fn, warmup=3, rep=30, return_mode="median")
        t = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - t)

    model, tok = lp.load_model(a.model, dtype=a.dtype, device=a.device)
    calib = "\n\n".join(texts(a.calib_text, a.calib_len * 5, stdlib_text))
    cal = lp.calibrate(model, "muse", calib, tokenizer=tok, length=a.calib_len, target_error=a.target_error,
                       objective=a.objective, layers=a.layers, ladder=ladder, progress=print, **sets)
    print(cal.table(), flush=True)
    calibrated = groups_of(model)
    lp.unpatch(model)
    need = max([L * a.windows for L in lengths] + time_lengths)  # held-out tokens; ~3.5 characters a token of code
    stream = token_stream(tok, texts(a.text, need * 5, stdlib_files_reversed))
    res = dict(task="muse-calibrated", device=device_description(a.device),
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), commit=git_commit(),
               command=" ".join(["python3 -m benchmarks.quality.bench_muse_calibrated",
                                 *map(shlex.quote, sys.argv[1:] if argv is None else argv)]),
               model=a.model, dtype=a.dtype, calib_text=a.calib_text or "stdlib, first files",
               text=a.text or "stdlib, last files", calibration=cal.to_record(), calibrated_groups=calibrated,
               defaults=dict(sets), timer="do_bench median (ms)" if cuda else "one CPU call", lengths={})
    for L in sorted(set(lengths + time_lengths)):
        wins = windows(stream, L, a.windows if L in lengths else 1)
        if not wins:
            res["lengths"][str(L)] = dict(skipped=f"the held-out text has {len(stream)} tokens, fewer than {L}")
            continue
        row: dict = {}
        got = capture(model, torch.tensor([wins[0]], device=model.device))
        for name, groups in (("calibrated", calibrated), ("defaults", None)):
            if groups is None:
                lp.patch(model, "muse", layers=a.layers, **sets)
            else:
                apply(model, groups)
            row[name] = layer_figures(model, got, bench)
            if L in lengths:
                row[name]["ppl"] = perplexity(model, wins)
            lp.unpatch(model)
        del got
        if L in lengths:
            row["unpatched_ppl"] = perplexity(model, wins)
            for name in ("calibrated", "defaults"):
                row[name]["ppl_vs_unpatched"] = row[name]["ppl"] / row["unpatched_ppl"] - 1
        row["windows"] = len(wins) if L in lengths else 0
        res["lengths"][str(L)] = row
        print(json.dumps({n: {k: v for k, v in row[n].items() if not isinstance(v, dict)} if isinstance(row[n], dict)
                          else row[n] for n in row}), flush=True)
    res["wall_s"] = round(time.time() - t0, 1)
    path = results_dir("muse", a.out) / f"calibrated-{model_token(a.model)}{'-smoke' if a.smoke else ''}-" \
                                         f"{device_token(a.device)}.json"
    path.write_text(json.dumps(res, indent=1))
    rows = []
    for L, row in res["lengths"].items():
        for name in ("calibrated", "defaults"):
            if name not in row:
                continue
            r = row[name]
            rows.append([L, name, f"{100 * r['ppl_vs_unpatched']:+.2f}%" if "ppl" in r else "-",
                         f"{100 * r['mean_as_run']:.2f}%", f"{100 * r['mean_forced']:.2f}%",
                         f"{100 * r['max_forced']:.2f}%", f"{r['total_ms']:.2f}",
                         f"{r['vs_cudnn']:.2f}x" if "vs_cudnn" in r else "-"])
    print(format_table(["L", "patch", "ppl vs unpatched", "error as run", "MuSe's error", "worst layer",
                        "attention ms", "vs cuDNN"], rows))
    print(f"wrote {path} ({res['wall_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
