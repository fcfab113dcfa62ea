"""Where a decode step's time goes: a Llama-3.2-1B-shaped model (random weights, bf16, `--batch` rows) prefills a
context, then decodes greedily, unpatched (sdpa) and patched with each of `--methods`.

For each: tokens/s over `--steps` steps with SDPA free to pick its backend, the same with cuDNN's attention
excluded (`sdpa_kernel`), and a `torch.profiler` table of the ops with the most self CPU and self device time over
`--profile-steps` steps. Eager decoding (decode graphs off, so that the profile sees every kernel; no
compilation); `--decode-graphs on` times the replayed steps instead.

    python3 -m benchmarks.generate.bench_decode_profile --context 16k --out $OUT/decode-profile.json
    python3 -m benchmarks.generate.bench_decode_profile --methods lola,lolcats --batch 16 --context 32k --out ...
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import shlex
import sys
import time

import torch

import longctx_patch as lp
from benchmarks.shared import device_token, result_file
from longctx_patch.cache import cache_argument
from longctx_patch.evals.common import parse_sizes
from longctx_patch.provenance import device_description, git_commit


def _decode(model, nxt, cache, steps):
    cache_arg = cache_argument(model.forward)
    for _ in range(steps):
        out = model(input_ids=nxt, use_cache=True, **{cache_arg: cache})
        cache = out.past_key_values
        nxt = out.logits[:, -1:].argmax(-1)
    return nxt, cache


def _top(prof, key, n):
    rows = sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)[:n]
    return [{"op": e.key, "calls": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3,
             "self_cuda_ms": getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)) / 1e3}
            for e in rows]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", default="16k")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--profile-steps", type=int, default=4)
    ap.add_argument("--methods", default="none,exact,muse")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--decode-graphs", choices=("on", "off"), default="off")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run of the script (small --context)")
    ap.add_argument("--out", default=None, help="file (default benchmarks/results/decode/profile-llama-3.2-1b-shaped-<device>.json)")
    args = ap.parse_args()
    dev = args.device
    if dev == "cuda" and not torch.cuda.is_available():
        sys.exit("needs a CUDA device (or --device cpu with a small --context)")
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.shared import llama_1b_shaped

    C = parse_sizes(args.context)[0]
    model = llama_1b_shaped(dev, torch.bfloat16)
    ids = torch.randint(100, 128256, (args.batch, C), generator=torch.Generator().manual_seed(0)).to(dev)
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    no_cudnn = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    results = {}
    for method in args.methods.split(","):
        if method != "none":
            lp.patch(model, method, decode_graphs=args.decode_graphs == "on")
        row = {}
        for label, ctx in (("default", None), ("no_cudnn", no_cudnn))[: 2 if dev == "cuda" else 1]:
            with torch.no_grad(), (sdpa_kernel(ctx) if ctx else contextlib.nullcontext()):
                out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
                nxt, cache = out.logits[:, -1:].argmax(-1), out.past_key_values
                del out
                nxt, cache = _decode(model, nxt, cache, 2)  # warm-up
                sync()
                t0 = time.perf_counter()
                nxt, cache = _decode(model, nxt, cache, args.steps)
                sync()
                row[f"tok_s_{label}"] = args.batch * args.steps / (time.perf_counter() - t0)
                if label == "default":
                    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
                    with profile(activities=acts) as prof:
                        nxt, cache = _decode(model, nxt, cache, args.profile_steps)
                        sync()
                    row["top_self_cpu"] = _top(prof, "self_cpu_time_total", 12)
                    row["top_self_cuda"] = _top(prof, "self_device_time_total"
                                                if hasattr(prof.key_averages()[0], "self_device_time_total")
                                                else "self_cuda_time_total", 12)
                del cache
                if dev == "cuda":
                    torch.cuda.empty_cache()
        print(f"{method}: {row['tok_s_default']:.1f} tok/s (sdpa free), {row.get('tok_s_no_cudnn', float('nan')):.1f}"
              " (no cuDNN)")
        for t in ("top_self_cpu", "top_self_cuda"):
            print(f"  {t}:")
            for e in row[t][:8]:
                print(f"    {e['op'][:60]:60s} x{e['calls']:5d} cpu {e['self_cpu_ms']:8.2f} ms "
                      f"cuda {e['self_cuda_ms']:8.2f}")
        results[method] = row
        if method != "none":
            lp.unpatch(model)
    record = {"task": "decode-profile", "device": device_description(dev),
              "date": datetime.date.today().isoformat(), "commit": git_commit(),
              "command": "python3 -m benchmarks.generate.bench_decode_profile " + shlex.join(sys.argv[1:]),
              "model": "llama-3.2-1b-shaped-random", "context": C, "batch": args.batch, "steps": args.steps,
              "decode_graphs": args.decode_graphs, "profile_steps": args.profile_steps, "results": results}
    out = result_file("decode", f"profile-llama-3.2-1b-shaped-{device_token() if dev == 'cuda' else 'cpu'}.json", args.out)
    with open(out, "w") as f:
        json.dump(record, f, indent=1)
    print("wrote", out)


if __name__ == "__main__":
    main()
