"""MoBA with block gating (kernels/moba: the block-list Triton kernels) on a CUDA GPU: its forward and
forward+backward time against SDPA's cuDNN causal attention, and the error against speed of MoBA, MuSe `cells` and
MuSe `tilted` at matched sparsity (about the same number of exactly attended keys per query), on the same Q/K/V.

    python3 -m benchmarks.ops.bench_moba                     # GPU: 16k, 32k, 64k; writes moba-speed-<gpu>.json
    python3 -m benchmarks.ops.bench_moba --smoke             # CPU (Triton interpreter) at tiny shapes: the code runs
    python3 -m benchmarks.ops.bench_moba --qkv FILE          # real Q/K/V instead of random ones

Shapes: B = 1, 32 query / 8 kv heads, D = 64, bf16 (with --qkv: the file's heads and head size). The times include
each method's plan (MoBA: block means, gate and top-k; MuSe: clustering and retrieval). Errors: ||o - o_exact|| /
||o_exact|| over every position and head, o_exact from SDPA in fp32 on the same (bf16-rounded) inputs.

Matched sparsity: `--keys E` (default 4096) exactly attended keys per late query, own block counted at half a
block on average; each method gets the configuration closest to E (`configs`; the JSON records each one's count):
MoBA block_size 512 and top_k - 1 earlier blocks; cells block_size 256, the sink, local, top-k and peak blocks
(k_clusters 8 cells summarise the rest); tilted block_size 128, the local and top-k blocks per query cluster and
8 cells of about 32 keys (4 clusters per block; q_clusters 16; the rest summarised).

--qkv FILE: `torch.save` of what `longctx_patch.evals.approx.capture(model, ids)` returns ({layer: (q, k, v, o)},
post-rotary, one row), e.g. SmolLM2 over a long essay; `--layers` picks the layers (default: every fourth); a
length above the capture's is skipped. No such capture is stored with the repository.
Result: $OUT/moba-speed-<gpu>.json (else benchmarks/results/moba/), with device, date, commit ($LONGCTX_COMMIT or git),
command; a table on stdout; `--budget` seconds (default 110) after which the remaining rows are skipped (recorded).
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
import torch.nn.functional as F

from benchmarks.shared import device_token, results_dir
from longctx_patch.evals.common import format_table
from longctx_patch.provenance import device_description, git_commit
from longctx_patch.kernels.moba import moba_attention, moba_reference
from longctx_patch.kernels.muse import MuseOptions, muse_attention


def configs(keys: int, scale_down: int = 1) -> dict:
    """Each method's settings for about `keys` exactly attended keys per late query (own block: half a block on
    average); `scale_down` divides the block sizes (the smoke run's tiny shapes; MoBA's blocks stay multiples of
    128 for its kernels). Returns {name: (kwargs, exact keys per query)}."""
    Lm, Lc, Lt = max(128, 512 // scale_down), max(128, 256 // scale_down), max(16, 128 // scale_down)
    top_k = max(2, round((keys - Lm / 2) / Lm) + 1)
    moba = dict(block_size=Lm, top_k=top_k, gating="block")
    n = max(2, round((keys - Lc / 2) / Lc))  # exact earlier blocks: 1 sink + 1 local + top-k + peak
    cells = dict(far_field="cells", block_size=Lc, k_clusters=8, local_blocks=1, sink_blocks=1,
                 topk_blocks=math.ceil((n - 2) / 2), peak_blocks=(n - 2) // 2)
    Ck, tc = 4, 8
    tb = max(0, round((keys - Lt / 2 - tc * Lt / Ck) / Lt) - 1)
    tilted = dict(far_field="tilted", block_size=Lt, q_clusters=16, k_clusters=Ck, topk_blocks=tb, topk_clusters=tc,
                  local_blocks=1)
    return {"moba": (moba, (top_k - 1) * Lm + Lm // 2),
            "cells": (cells, n * Lc + Lc // 2),
            "tilted": (tilted, (1 + tb) * Lt + tc * Lt // Ck + Lt // 2)}


def run(name: str, cfg: dict, q, k, v, scale: float):
    if name == "moba":
        return moba_attention(q, k, v, scale=scale, backend="triton", **cfg)
    return muse_attention(q, k, v, scale=scale, options=MuseOptions(**cfg), backend="triton")


def exact(q, k, v, scale: float) -> torch.Tensor:
    """fp32 causal attention [B, S, Hq, D] (SDPA, memory-efficient kernel on CUDA)."""
    G = q.shape[1] // k.shape[1]
    o = F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(G, 1),
                                       v.float().repeat_interleave(G, 1), is_causal=True, scale=scale)
    return o.transpose(1, 2)


def rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


def random_qkv(S, D, dtype, device, H=32, Hkv=8, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    mk = lambda h: torch.randn(1, h, S, D, device=device, generator=g).to(dtype)  # noqa: E731
    return [("random", mk(H), mk(Hkv), mk(Hkv))]


def file_qkv(path, S, dtype, device, layers):
    cap = torch.load(path, map_location="cpu")
    picked = sorted(cap)[::4] if layers is None else layers
    out = []
    for i in picked:
        q, k, v = cap[i][:3]
        if q.shape[2] < S:
            continue
        out.append((f"layer {i}", *(t[:1, :, :S].to(device=device, dtype=dtype).contiguous() for t in (q, k, v))))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", default="16384,32768,65536")
    ap.add_argument("--keys", type=int, default=4096, help="exactly attended keys per query to match (default 4096)")
    ap.add_argument("--qkv", default=None, help="torch.save of approx.capture's {layer: (q, k, v, o)}")
    ap.add_argument("--layers", default=None, help="with --qkv: comma-separated layers (default every fourth)")
    ap.add_argument("--budget", type=float, default=110.0, help="seconds; later rows are skipped (default 110)")
    ap.add_argument("--smoke", action="store_true", help="CPU (TRITON_INTERPRET=1) at tiny shapes")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="result folder (default $OUT, else benchmarks/results/moba)")
    a = ap.parse_args(argv)
    t0 = time.time()
    if a.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("--smoke runs the Triton kernels through the interpreter: set TRITON_INTERPRET=1")
        device, dtype, seqs, scale_down, keys = "cpu", torch.float32, [640], 4, 320
        heads = dict(H=4, Hkv=2)
    else:
        if not torch.cuda.is_available():
            raise SystemExit("bench_moba needs a CUDA GPU (or --smoke with TRITON_INTERPRET=1 on the CPU)")
        device, dtype, seqs, scale_down, keys = "cuda", torch.bfloat16, [int(s) for s in a.seqs.split(",")], 1, a.keys
        heads = {}
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def bench(fn) -> float:
        if a.smoke:  # the interpreter: one timed call
            t = time.perf_counter()
            fn()
            return 1e3 * (time.perf_counter() - t)
        return triton.testing.do_bench(fn, warmup=3, rep=30, return_mode="median")

    cfgs = configs(keys, scale_down)
    res = dict(task="moba", device=device_description(device),
               date=datetime.date.today().isoformat(), commit=git_commit(),
               command=" ".join(["python3 -m benchmarks.ops.bench_moba", *map(shlex.quote, sys.argv[1:] if argv is None
                                                                             else argv)]),
               torch=torch.__version__, triton=triton.__version__, dtype=str(dtype), keys=keys,
               configs={n: dict(cfg=c, exact_keys_per_query=e) for n, (c, e) in cfgs.items()},
               qkv=a.qkv or "random", checks=[], rows=[], skipped=[])
    layers = None if a.layers is None else [int(x) for x in a.layers.split(",")]
    mcfg = cfgs["moba"][0]

    # 1. the Triton path against the PyTorch reference (forward and gradients), one small shape
    S0 = (mcfg["top_k"] + 1) * mcfg["block_size"]  # past top_k blocks: MoBA is not exact there
    _, q, k, v = random_qkv(S0, 64 if not a.smoke else 16, dtype, device, **heads)[0]
    sc = q.shape[-1] ** -0.5
    qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))
    o = moba_attention(qg, kg, vg, scale=sc, backend="triton", **mcfg)
    r = moba_reference(qg, kg, vg, scale=sc, **mcfg)
    do = torch.randn_like(o)
    g1, g2 = torch.autograd.grad(o, (qg, kg, vg), do), torch.autograd.grad(r, (qg, kg, vg), do)
    res["checks"].append(dict(S=S0, fwd=rel(o, r), **{f"d{n}": rel(x, y) for n, x, y in zip("qkv", g1, g2)}))

    # 2. per length: errors at matched sparsity and times against cuDNN
    for S in seqs:
        sources = file_qkv(a.qkv, S, dtype, device, layers) if a.qkv else random_qkv(S, 64 if not a.smoke else 16,
                                                                                      dtype, device, **heads)
        for src, q, k, v in sources:
            if time.time() - t0 > a.budget:
                res["skipped"].append(dict(S=S, qkv=src, why=f"over the {a.budget:.0f} s budget"))
                continue
            sc = q.shape[-1] ** -0.5
            G = q.shape[1] // k.shape[1]
            ref = exact(q, k, v, sc)
            row = dict(S=S, qkv=src, Hq=q.shape[1], Hkv=k.shape[1], D=q.shape[-1])
            with torch.no_grad():
                for name, (cfg, _) in cfgs.items():
                    row[f"{name}_err"] = rel(run(name, cfg, q, k, v, sc), ref)
                    row[f"{name}_fwd_ms"] = bench(lambda: run(name, cfg, q, k, v, sc))
                if device == "cuda":
                    kx, vx = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        row["cudnn_fwd_ms"] = bench(lambda: F.scaled_dot_product_attention(q, kx, vx, is_causal=True,
                                                                                           scale=sc))
            if src == sources[0][0] and time.time() - t0 < a.budget:  # forward+backward: the first source only
                qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))
                do = torch.randn(q.shape[0], S, q.shape[1], q.shape[-1], device=device, dtype=dtype)
                row["moba_fwdbwd_ms"] = bench(lambda: moba_attention(qg, kg, vg, scale=sc, backend="triton",
                                                                     **mcfg).backward(do))
                row["cells_fwdbwd_ms"] = bench(lambda: run("cells", cfgs["cells"][0], qg, kg, vg, sc).backward(do))
                if device == "cuda":
                    kxg, vxg = (t.detach().repeat_interleave(G, 1).requires_grad_(True) for t in (k, v))
                    dot = do.transpose(1, 2)
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        row["cudnn_fwdbwd_ms"] = bench(lambda: F.scaled_dot_product_attention(
                            qg, kxg, vxg, is_causal=True, scale=sc).backward(dot))
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
    res["wall_s"] = round(time.time() - t0, 1)
    path = results_dir("moba", a.out) / f"moba-speed-{device_token(device)}.json"
    path.write_text(json.dumps(res, indent=1))
    print(table(res))
    print(f"checks (Triton vs reference, relative): {res['checks']}")
    print(f"skipped: {res['skipped']}" if res["skipped"] else "skipped: none")
    print(f"wrote {path} ({res['wall_s']} s)")
    return 0


def table(res: dict) -> str:
    """One line per (length, Q/K/V) and method: error, forward ms and speed-up against cuDNN, fwd+bwd likewise."""
    rows = []
    for r in res["rows"]:
        for n in ("moba", "cells", "tilted"):
            fb = r.get(f"{n}_fwdbwd_ms")
            rows.append([r["S"], r["qkv"], n, res["configs"][n]["exact_keys_per_query"], f"{r[f'{n}_err']:.4f}",
                         f"{r[f'{n}_fwd_ms']:.2f}",
                         f"{r['cudnn_fwd_ms'] / r[f'{n}_fwd_ms']:.2f}x" if "cudnn_fwd_ms" in r else "-",
                         f"{fb:.2f}" if fb else "-",
                         f"{r['cudnn_fwdbwd_ms'] / fb:.2f}x" if fb and "cudnn_fwdbwd_ms" in r else "-"])
        if "cudnn_fwd_ms" in r:
            rows.append([r["S"], r["qkv"], "cudnn", r["S"] // 2, "0", f"{r['cudnn_fwd_ms']:.2f}", "1.00x",
                         f"{r['cudnn_fwdbwd_ms']:.2f}" if "cudnn_fwdbwd_ms" in r else "-", "-"])
    return format_table(["S", "qkv", "method", "exact keys/query", "rel err", "fwd ms", "fwd vs cuDNN",
                         "fwd+bwd ms", "fwd+bwd vs cuDNN"], rows)


if __name__ == "__main__":
    sys.exit(main())
