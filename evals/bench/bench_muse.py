"""MuSe on the GPU: Triton vs reference check, speed vs SDPA (cuDNN, flash), speed/error trade-off.

    python3 -m evals.bench.bench_muse            # writes $OUT/speed-<gpu>.json (+ -tradeoff.png), or in evals/results/muse/

(a) Triton forward/backward vs the PyTorch reference in bf16 at a few small shapes (same plan);
(b) forward and forward+backward times (triton.testing.do_bench, median) vs torch SDPA with the cuDNN and
    flash backends, causal, bf16, B=1, 32 query / 8 kv heads, D=64 and 128, 4k..128k;
(c) relative error vs exact attention for a grid of configs (random inputs) against their forward time.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import traceback

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from evals.shared import device_token, results_dir
from longctx_patch.evals.common import git_commit
from longctx_patch.kernels.muse import make_plan, muse_attention
from longctx_patch.kernels.muse.reference import muse_reference_planned
from longctx_patch.kernels.muse.ops import muse_triton_planned

RES: dict = {}
OUT = os.environ.get("OUT")  # None: the results' muse/ folder


def save():
    with open(results_dir("muse", OUT) / f"speed-{device_token()}.json", "w") as f:
        json.dump(RES, f, indent=1)


def log(*a):
    print(*a, flush=True)


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def bench(fn, rep=60):
    return triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median")


def sdpa(q, k, v, backend):
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def rand_qkv(S, D, Hq=32, Hkv=8, dtype=torch.bfloat16, grad=False, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda h: torch.randn(1, h, S, D, device="cuda", dtype=dtype, generator=g).requires_grad_(grad)  # noqa: E731
    return mk(Hq), mk(Hkv), mk(Hkv)


def check_correctness():
    rows = []
    cases = [(8, 2, 1000, 64, 64, 4, 4, 2, 4, 1), (8, 2, 1000, 64, 64, 4, 4, 999, 0, 1),
             (8, 2, 1000, 64, 64, 4, 4, 0, 0, 0), (4, 4, 1000, 64, 64, 4, 4, 2, 4, 1),
             (4, 4, 777, 64, 128, 4, 4, 1, 4, 1), (4, 1, 1500, 64, 32, 2, 8, 2, 8, 1),
             (4, 2, 900, 128, 64, 16, 4, 2, 4, 1)]
    for (Hq, Hkv, S, D, L, Cq, Ck, kb, kc, lb) in cases:
        try:
            q, k, v = rand_qkv(S, D, Hq, Hkv, grad=True, seed=S)
            kw = dict(scale=D**-0.5, block_size=L, q_clusters=Cq, k_clusters=Ck, kmeans_iters=2, topk_blocks=kb,
                      topk_clusters=kc, local_blocks=lb)
            km = torch.ones(1, S, dtype=torch.bool, device="cuda")
            km[0, :9] = False
            plan = make_plan(q.detach(), k.detach(), key_mask=km, **kw)
            o_t = muse_triton_planned(q, k, v, plan, scale=kw["scale"])
            o_r = muse_reference_planned(q, k, v, plan, scale=kw["scale"])
            do = torch.randn_like(o_t)
            gt = torch.autograd.grad(o_t, (q, k, v), do)
            gr = torch.autograd.grad(o_r, (q, k, v), do)
            row = dict(shape=[1, Hq, Hkv, S, D], config=dict(block_size=L, q_clusters=Cq, k_clusters=Ck, topk_blocks=kb,
                       topk_clusters=kc, local_blocks=lb), fwd=rel(o_t[:, 9:], o_r[:, 9:]), dq=rel(gt[0], gr[0]),
                       dk=rel(gt[1], gr[1]), dv=rel(gt[2], gr[2]), finite=bool(torch.isfinite(o_t).all()))
        except Exception as e:  # noqa: BLE001
            row = dict(shape=[1, Hq, Hkv, S, D], error=repr(e)[:300])
        log("check", row)
        rows.append(row)
    # forward only at block 128 x head_dim 128 (the backward needs block_size * head_dim <= 8192)
    try:
        q, k, v = rand_qkv(1000, 128, 4, 2, seed=3)
        kw = dict(scale=128**-0.5, block_size=128, q_clusters=4, k_clusters=4, kmeans_iters=2, topk_blocks=2,
                  topk_clusters=4)
        plan = make_plan(q, k, **kw)
        with torch.no_grad():
            row = dict(shape=[1, 4, 2, 1000, 128], config=kw, fwd=rel(muse_triton_planned(q, k, v, plan, scale=kw["scale"]),
                       muse_reference_planned(q, k, v, plan, scale=kw["scale"])))
    except Exception as e:  # noqa: BLE001
        row = dict(shape=[1, 4, 2, 1000, 128], error=repr(e)[:300])
    log("check", row)
    rows.append(row)
    RES["correctness_bf16"] = rows
    save()


def ceilings():
    """Measured ceilings: bf16 matmul rate and device-to-device copy bandwidth."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t = bench(lambda: a @ b, rep=100)
    x = torch.randn(2**30, device="cuda", dtype=torch.float32)
    y = torch.empty_like(x)
    tc = bench(lambda: y.copy_(x), rep=100)
    RES["ceilings"] = dict(bf16_matmul_tflops=2 * 8192**3 / t / 1e9, copy_tb_s=2 * 4 * 2**30 / tc / 1e9)
    log("ceilings", RES["ceilings"])
    del a, b, x, y
    save()


def speed(D, seqs, cfg, bwd_max):
    rows = []
    for S in seqs:
        row = dict(D=D, S=S)
        try:
            q, k, v = rand_qkv(S, D, grad=True, seed=S + D)
            kx, vx = (t.detach().repeat_interleave(4, 1).requires_grad_(True) for t in (k, v))
            qd = q.detach().requires_grad_(True)
            do = torch.randn(1, 32, S, D, device="cuda", dtype=torch.bfloat16)
            for name, be in [("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)]:
                try:
                    row[f"{name}_fwd_ms"] = bench(lambda: sdpa(qd, kx, vx, be))
                    if S <= bwd_max:
                        row[f"{name}_fwdbwd_ms"] = bench(lambda: sdpa(qd, kx, vx, be).backward(do))
                except Exception as e:  # noqa: BLE001
                    row[f"{name}_error"] = repr(e)[:200]
            kw = dict(scale=D**-0.5, kmeans_iters=2, **cfg)
            if S <= bwd_max and cfg.get("block_size", 64) * D > 8192:
                kw["block_size"] = 8192 // D  # the backward kernels' shared-memory limit (see triton_supported)
                row["block_size_fwdbwd"] = kw["block_size"]
            kwf = dict(kw, block_size=cfg.get("block_size", 64))
            with torch.no_grad():
                row["muse_fwd_ms"] = bench(lambda: muse_attention(q, k, v, **kwf))
                pkw = {x: y for x, y in kwf.items() if x not in ("backend", "dipole")}
                plan = make_plan(q, k, **pkw)
                row["muse_plan_ms"] = bench(lambda: make_plan(q, k, **pkw))
                row["muse_kernel_fwd_ms"] = bench(lambda: muse_triton_planned(q, k, v, plan, scale=kw["scale"]))
                del plan
            if S <= bwd_max:
                do2 = do.transpose(1, 2)
                row["muse_fwdbwd_ms"] = bench(lambda: muse_attention(q, k, v, **kw).backward(do2))
            base = row.get("cudnn_fwd_ms")
            if base:
                row["speedup_fwd_vs_cudnn"] = base / row["muse_fwd_ms"]
            if row.get("cudnn_fwdbwd_ms") and row.get("muse_fwdbwd_ms"):
                row["speedup_fwdbwd_vs_cudnn"] = row["cudnn_fwdbwd_ms"] / row["muse_fwdbwd_ms"]
            del q, k, v, kx, vx, qd, do
        except Exception as e:  # noqa: BLE001
            row["error"] = repr(e)[:300]
            traceback.print_exc()
        torch.cuda.empty_cache()
        log("speed", {x: (round(y, 3) if isinstance(y, float) else y) for x, y in row.items()})
        rows.append(row)
        RES.setdefault("speed", []).append(row)
        save()
    return rows


def tradeoff(grid, S_err, S_time, D):
    rows = []
    q, k, v = rand_qkv(S_err, D, seed=7)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        ref = F.scaled_dot_product_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1),
                                             is_causal=True).transpose(1, 2)
    qt, kt, vt = rand_qkv(S_time, D, seed=8)
    for cfg in grid:
        kw = dict(scale=D**-0.5, kmeans_iters=2, **cfg)
        try:
            with torch.no_grad():
                o = muse_attention(q, k, v, **kw)
                err = rel(o, ref)
                t = bench(lambda: muse_attention(qt, kt, vt, **kw))
            row = dict(config=cfg, D=D, rel_err=err, S_err=S_err, S_time=S_time, fwd_ms=t)
        except Exception as e:  # noqa: BLE001
            row = dict(config=cfg, error=repr(e)[:300])
        log("tradeoff", row)
        rows.append(row)
        RES.setdefault("tradeoff", []).append(row)
        save()
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        RES.setdefault("tradeoff_cudnn_fwd_ms", {})[f"D{D}_S{S_time}"] = bench(
            lambda: F.scaled_dot_product_attention(qt, kt.repeat_interleave(4, 1), vt.repeat_interleave(4, 1),
                                                   is_causal=True))
    save()
    return rows


def plot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001
        return
    rows = [r for r in RES.get("tradeoff", []) if "fwd_ms" in r]
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        c = r["config"]
        ax.scatter(r["fwd_ms"], r["rel_err"])
        ax.annotate(f"L{c['block_size']} q{c['q_clusters']} k{c['k_clusters']} b{c['topk_blocks']} c{c['topk_clusters']}"
                    f" l{c.get('local_blocks', 1)}",
                    (r["fwd_ms"], r["rel_err"]), fontsize=6)
    for key, val in RES.get("tradeoff_cudnn_fwd_ms", {}).items():
        ax.axvline(val, ls="--", c="gray")
        ax.text(val, ax.get_ylim()[1] * 0.9, f"cuDNN {key}", fontsize=7, rotation=90)
    ax.set_xlabel(f"forward ms at S={rows[0]['S_time']}, D={rows[0]['D']} (H200, bf16, 32/8 heads)")
    ax.set_ylabel(f"relative error vs exact at S={rows[0]['S_err']} (random inputs)")
    ax.set_title("MuSe speed / error trade-off")
    fig.tight_layout()
    fig.savefig(results_dir("muse", OUT) / f"speed-{device_token()}-tradeoff.png", dpi=120)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="ceil,check,speed128,tradeoff,speed64")
    ap.add_argument("--seqs", default="4096,8192,16384,32768,65536,131072")
    ap.add_argument("--seqs64", default="16384,65536,131072")
    ap.add_argument("--bwd-max", type=int, default=65536)
    ap.add_argument("--config", default='{"block_size": 128, "q_clusters": 4, "k_clusters": 4, "topk_blocks": 2, '
                                        '"topk_clusters": 4}')
    args = ap.parse_args()
    commit = git_commit()  # $LONGCTX_COMMIT on a copy of the tree, else git
    RES.update(device=torch.cuda.get_device_name(), date=datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"), commit=commit, command="python3 -m evals.bench.bench_muse " + " ".join(sys.argv[1:]),
        torch=torch.__version__, triton=triton.__version__, config=json.loads(args.config))
    cfg = json.loads(args.config)
    seqs = [int(s) for s in args.seqs.split(",")]
    t0 = time.time()
    parts = args.parts.split(",")
    if "ceil" in parts:
        ceilings()
    if "check" in parts:
        check_correctness()
        log(f"[{time.time() - t0:.0f}s] check done")
    if "speed128" in parts:
        speed(128, seqs, cfg, args.bwd_max)
        log(f"[{time.time() - t0:.0f}s] speed128 done")
    if "tradeoff" in parts:
        grid = [dict(block_size=64, q_clusters=4, k_clusters=4, topk_blocks=2, topk_clusters=4),
                dict(block_size=64, q_clusters=8, k_clusters=4, topk_blocks=2, topk_clusters=4),
                dict(block_size=128, q_clusters=4, k_clusters=4, topk_blocks=0, topk_clusters=0, local_blocks=0),
                dict(block_size=128, q_clusters=4, k_clusters=4, topk_blocks=2, topk_clusters=4),
                dict(block_size=128, q_clusters=8, k_clusters=4, topk_blocks=2, topk_clusters=4),
                dict(block_size=128, q_clusters=16, k_clusters=4, topk_blocks=2, topk_clusters=4),
                dict(block_size=128, q_clusters=8, k_clusters=4, topk_blocks=4, topk_clusters=8)]
        tradeoff(grid, 8192, 65536, 128)
        plot()
        log(f"[{time.time() - t0:.0f}s] tradeoff done")
    if "speed64" in parts:
        speed(64, [int(s) for s in args.seqs64.split(",")], cfg, args.bwd_max)
        log(f"[{time.time() - t0:.0f}s] speed64 done")
    save()
    log("\n D      S  cudnn_fwd  flash_fwd  muse_fwd (plan) x_cudnn | cudnn_fb  muse_fb x_cudnn")
    for r in RES.get("speed", []):
        f = lambda key: f"{r[key]:9.2f}" if key in r else "        -"  # noqa: E731
        x = lambda key: f"{r[key]:6.2f}" if key in r else "     -"  # noqa: E731
        log(f"{r['D']:3d} {r['S']:6d} {f('cudnn_fwd_ms')} {f('flash_fwd_ms')} {f('muse_fwd_ms')} {f('muse_plan_ms')}"
            f" {x('speedup_fwd_vs_cudnn')} | {f('cudnn_fwdbwd_ms')} {f('muse_fwdbwd_ms')} {x('speedup_fwdbwd_vs_cudnn')}")


if __name__ == "__main__":
    main()
