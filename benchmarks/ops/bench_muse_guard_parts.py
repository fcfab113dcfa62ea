"""Where one layer's MuSe guard spends its time (docs/muse.md, "The estimate's implementation": ~0.85 ms a layer at
32k that is not the sampled rows' attention). One layer at Qwen2.5-Coder-0.5B's shapes (14 query / 2 kv heads, D 64,
bf16, random inputs: the guard's work does not depend on the values), `muse`'s default config (--block-size: another
block size, for a quick check on a CPU):

- `muse`: MuSe's own kernels (`muse_attention`), and exact attention (SDPA) on the same inputs;
- `estimate`: the guard's whole estimate as a call runs it (`estimate_errors`: on CUDA the guard's Triton kernels,
  kernels/muse/triton_guard.py), with its sample (`guard_top_sample`: row norms and each head's top rows) where the
  kernels run;
- `estimate_ops`: the same estimate through PyTorch ops (`kernels=False`, the kernels' reference and the CPU's path),
  and its parts: the sample (`sampled_rows` without a key mask: row norms, their top-k over S), the sampled rows'
  exact attention (`exact_rows`, the split-key kernels on CUDA) and the rest (the estimate minus both: gathers and
  the error's arithmetic);
- `guard`: the estimate with its host read and no head over budget (what every layer of a call pays; `guard_kernels`
  on, and `_ops` off, its default), and with 1, 7 (one kv group) and 14 heads made exact (`with_exact_heads`);
- a kernel table of one estimate each way (torch.profiler: each kernel's total time, calls) and its launches.

Timed with `triton.testing.do_bench` (median) on CUDA, the best of 3 wall times elsewhere.

    python3 -m benchmarks.ops.bench_muse_guard_parts --out $OUT/guard-profile-qwen-h100.json
    python3 -m benchmarks.ops.bench_muse_guard_parts --device cpu --dtype float32 --lengths 1024 --block-size 32  # a check
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.shared import qwen_layer_arguments, timed_ms, write_bench_result
from longctx_patch.kernels.muse import muse_attention
from longctx_patch.kernels.muse.support import guard_kernels_missing
from longctx_patch.kernels.softmax import softmax_attention
from longctx_patch.methods.muse.config import MuseConfig
from longctx_patch.methods.muse.guard import (estimate_errors, exact_rows, first_approximated, guard, kept_stratified,
                                              sampled_rows, top_rows)
from longctx_patch.methods.muse.heads import with_exact_heads


def kernel_table(fn, dev: torch.device, top: int = 15) -> dict:
    """One call of fn under torch.profiler: the kernels (CUDA) or operators (CPU) by total time, and how many."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        fn()
        if dev.type == "cuda":
            torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        dev_us = getattr(e, "device_time_total", None)
        if dev_us is None:
            dev_us = getattr(e, "cuda_time_total", 0)
        rows.append(dict(name=e.key[:90], calls=e.count, device_us=round(float(dev_us), 1),
                         self_cpu_us=round(float(e.self_cpu_time_total), 1)))
    key = "device_us" if dev.type == "cuda" else "self_cpu_us"
    kernels = [r for r in rows if r["device_us"] > 0] if dev.type == "cuda" else rows
    launches = sum(r["calls"] for r in rows if r["name"] in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
    kernels.sort(key=lambda r: -r[key])
    return dict(by=key, total_us=round(sum(r[key] for r in kernels if not r["name"].startswith("aten::")
                                           or dev.type != "cuda"), 1),
                launches=launches, top=kernels[:top])


def measure(S: int, a, dev: torch.device) -> dict:
    dt = getattr(torch, a.dtype)
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(1, a.heads, S, a.head_dim, device=dev, generator=g).to(dt)
    k = torch.randn(1, a.kv_heads, S, a.head_dim, device=dev, generator=g).to(dt)
    v = torch.randn(1, a.kv_heads, S, a.head_dim, device=dev, generator=g).to(dt)
    sets = {"block_size": a.block_size} if a.block_size else {}
    cfg = MuseConfig(**sets)
    scale = a.head_dim ** -0.5
    first, rows = first_approximated(cfg), cfg.guard_rows
    opts = cfg.kernel_options()
    with torch.no_grad():
        o = muse_attention(q, k, v, scale=scale, options=opts, backend=cfg.backend)
        pos, w, _ = sampled_rows(o, None, first, rows)
        t = {"muse": lambda: muse_attention(q, k, v, scale=scale, options=opts, backend=cfg.backend),
             "exact_sdpa": lambda: softmax_attention(q, k, v, scale=scale),
             "estimate": lambda: estimate_errors(o, q, k, v, None, scale=scale, first=first, rows=rows),
             "estimate_ops": lambda: estimate_errors(o, q, k, v, None, scale=scale, first=first, rows=rows,
                                                     kernels=False),
             "estimate_sample": lambda: sampled_rows(o, None, first, rows),
             "estimate_rows_attention": lambda: exact_rows(q, k, v, pos, None, scale=scale)}
        top = top_rows(rows) if S - first > rows else 0
        kernels_run = top > 0 and guard_kernels_missing(o, top) is None
        if kernels_run:
            from longctx_patch.kernels.muse.triton_guard import guard_top_sample

            ranks, _ = kept_stratified(S, first, rows - top, dev)
            t["estimate_kernel_sample"] = lambda: guard_top_sample(o, ranks, first, top)
        never = MuseConfig(**sets, guard_error=0.999, guard_kernels=True)  # every head measured, none over budget
        never_ops = MuseConfig(**sets, guard_error=0.999)  # the same through the ops (guard_kernels' default)
        t["guard_no_head"] = lambda: guard(o, q, k, v, None, config=never, scale=scale)
        t["guard_no_head_ops"] = lambda: guard(o, q, k, v, None, config=never_ops, scale=scale)
        for n in (1, a.heads // a.kv_heads, a.heads):
            t[f"exact_heads_{n}"] = lambda n=n: with_exact_heads(o, q, k, v, list(range(n)), scale=scale)
        row: dict = {"seq_len": S, "first": first, "rows": rows, "sampled": int(pos.shape[-1]),
                     "guard_kernels_run": kernels_run}
        got, want = t["estimate"]()[0], t["estimate_ops"]()[0]
        row["estimate_vs_ops_max_abs"] = float((got - want).abs().nan_to_num(0.0).max())  # the two paths agree
        row["estimate_vs_ops_same_nan"] = bool(torch.equal(got.isnan(), want.isnan()))
        row["ms"] = {name: timed_ms(fn, dev) for name, fn in t.items()}
        ms = row["ms"]
        ms["estimate_ops_rest"] = ms["estimate_ops"] - ms["estimate_sample"] - ms["estimate_rows_attention"]
        ms["guard_host_read"] = ms["guard_no_head"] - ms["estimate"]
        row["estimate_kernels"] = kernel_table(t["estimate"], dev)
        row["estimate_ops_kernels"] = kernel_table(t["estimate_ops"], dev)
        row["guard_kernels"] = kernel_table(t["guard_no_head"], dev)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    qwen_layer_arguments(p, "32768,65536")
    p.add_argument("--block-size", type=int, default=None, help="MuSe's block size (default: the config's)")
    a = p.parse_args(argv)
    dev = torch.device(a.device)
    rows = []
    for S in (int(x) for x in a.lengths.split(",")):
        row = measure(S, a, dev)
        print(json.dumps({"seq_len": S, "ms": row["ms"], "vs_ops": row["estimate_vs_ops_max_abs"],
                          "launches": row["estimate_kernels"]["launches"],
                          "launches_ops": row["estimate_ops_kernels"]["launches"]}), flush=True)
        for key in ("estimate_kernels", "estimate_ops_kernels"):
            table = row[key]
            print(f"  {key}:", flush=True)
            for r in table["top"]:
                print(f"    {r[table['by']]:9.1f} us  {r['calls']:4d}x  {r['name']}", flush=True)
        rows.append(row)
    write_bench_result("muse", f"guard-profile-qwen-{a.device}.json", a.out, task="muse-guard-profile",
                       module="benchmarks.ops.bench_muse_guard_parts", argv=argv, device=a.device,
                       shape=dict(heads=a.heads, kv_heads=a.kv_heads, head_dim=a.head_dim, dtype=a.dtype), rows=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
