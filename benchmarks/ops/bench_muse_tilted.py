"""MuSe's tilted-cells far field (`kernels/muse/reference_tilted_cells.py`) on a CUDA GPU: the Triton forward against the PyTorch
reference, then its forward time (plan included) against torch SDPA (cuDNN) and against the cells far field with the
same exact part, in the same run, with the time split into the plan, the summaries, the exact part and the far field;
the backward likewise (against autograd through the reference; forward + backward against cuDNN's and the cells').

    python3 -m benchmarks.ops.bench_muse_tilted      # writes $OUT/tilted-cells-speed-<gpu>.json (else benchmarks/results/muse/)

Shapes: B = 1, 32 query / 8 kv heads, bf16, D = 64 and 128 (the issue's op-level setting). Env: TILT_SEQS (default
16384,65536,131072,32768), TILT_QC (query clusters, default 256,64), TILT_CFG (the cells plan, JSON; default the
package's cells defaults), TILT_BUDGET_S (default 400), TILT_PROFILE_D (default 64), TILT_PARTS (default
checks,speed,profile; also far_tune (a tile sweep of the far field, the summaries and the exact part, whose fastest
the later parts use), cluster_tune (likewise for the clustering's kernels), bwd_checks, bwd_speed, bwd_profile),
TILT_BWD_SWEEP=1 (bwd_profile also sweeps the backward's tiles; TILT_BWD_OPTIONS, JSON {part: [tiles, ...]}: which).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import shlex
import sys
import time
import traceback

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks.ops.bench_muse_cells import bench, fastest, qkv, rel
from benchmarks.shared import device_token, results_dir
from longctx_patch.provenance import device_description, git_commit
from longctx_patch.kernels.muse import MuseOptions, MuseTiles, muse_attention
from longctx_patch.kernels.muse.reference_cells import make_cells_plan
from longctx_patch.kernels.muse.ops import cells_triton, tilted_cells_triton
from longctx_patch.kernels.muse.reference_tilted_cells import make_tilt_plan, tilted_cells_reference
from longctx_patch.methods.muse import FAR_FIELD_DEFAULTS

OUT = os.environ.get("OUT")
T0 = time.time()
BUDGET = float(os.environ.get("TILT_BUDGET_S", "400"))
SEQS = [int(x) for x in os.environ.get("TILT_SEQS", "16384,65536,131072,32768").split(",")]
QCS = [int(x) for x in os.environ.get("TILT_QC", "256,64").split(",")]
CFG = json.loads(os.environ["TILT_CFG"]) if os.environ.get("TILT_CFG") else dict(FAR_FIELD_DEFAULTS["tilted-cells"],
                                                                                 sink_blocks=1)
RES: dict = dict(task="muse-tilted-cells-speed", device=None, date=datetime.date.today().isoformat(), commit=git_commit(),
                 command=" ".join([f"{k}={shlex.quote(v)}" for k, v in sorted(os.environ.items()) if k.startswith("TILT_")]
                                  + ["python3 -m benchmarks.ops.bench_muse_tilted"]), torch=torch.__version__,
                 triton=triton.__version__, cells_plan=CFG, checks=[], speed=[], profile=None)


# head_dim -> the kernels' tiles the sweeps kept (far_tune, cluster_tune), passed as `tiles=` to the later parts'
# bf16 calls
TUNED: dict[int, MuseTiles] = {}


def tuned(D: int, dtype=torch.bfloat16) -> MuseTiles | None:
    """The tiles the sweeps kept for head_dim D (for bf16 inputs: the sweeps' dtype), else None (the defaults)."""
    return TUNED.get(D) if dtype == torch.bfloat16 else None


def tc_options(cfg: dict) -> MuseOptions:
    """The tilted-cells options of a plan config (CFG's keys and q_clusters), for `muse_attention(options=)`."""
    return MuseOptions(far_field="tilted-cells", **cfg)


def save():
    with open(results_dir("muse", OUT) / f"tilted-cells-speed-{device_token()}.json", "w") as f:
        json.dump(RES, f, indent=1)


def checks():
    """Triton forward against the reference (fp32 and bf16, D 64 and 128, odd length, 14 / 2 heads)."""
    for dtype in (torch.float32, torch.bfloat16):
        for D in (64, 128):
            q, k, v = qkv(3001, D, dtype, H=14, Hkv=2, seed=D)
            sc = D**-0.5
            cfg = dict(block_size=256, k_clusters=8, topk_blocks=2, peak_blocks=2, q_clusters=32)
            plan = make_tilt_plan(q, k, scale=sc, tiles=tuned(D, dtype), **cfg)
            from longctx_patch.kernels.muse.triton_tilted import tilted_cells_fwd

            o = tilted_cells_fwd(q, k, v, plan, sc, tiles=tuned(D, dtype))
            r = tilted_cells_reference(q, k, v, plan, scale=sc)
            ex = F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(7, 1),
                                                v.float().repeat_interleave(7, 1), is_causal=True, scale=sc)
            oc = cells_triton(q, k, v, plan.cells, scale=sc, tiles=tuned(D, dtype))
            row = dict(dtype=str(dtype), D=D, S=3001, cfg=cfg, fwd_vs_reference=rel(o, r),
                       err_vs_exact_random=rel(o, ex.transpose(1, 2)), cells_err_vs_exact_random=rel(oc, ex.transpose(1, 2)))
            RES["checks"].append(row)
            print(json.dumps(row), flush=True)
    save()


# the first choice of each list is the package's default; the wider sweeps that chose them are in
# benchmarks/results/muse/tilted-cells-speed-tune-far-h200-e7e7d4c.json and tilted-cells-speed-tune-h200-e42ffc1.json
FAR = {64: [(64, 64, 4, 3), (128, 64, 4, 2)], 128: [(64, 64, 4, 3), (64, 64, 4, 2)]}
SUMM = {64: [(64, 32, 4), (64, 16, 4)], 128: [(64, 32, 4), (128, 32, 8)]}
# the exact part's forward tiles (the cells kernel without a far field: BM, BN, warps, stages), the first the default
EXACT = {64: [(128, 128, 4, 2), (128, 64, 4, 3), (128, 128, 8, 2), (64, 64, 4, 3), (128, 64, 8, 2)],
         128: [(128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3), (128, 128, 8, 2)]}


def far_tune(S=65536):
    """The tilted forward (plan apart) per tile choice at S, 256 clusters: of the far field (BM, BN, warps, stages),
    then of the summaries (centroids BC, keys BK, warps), then of the exact part (the cells forward kernel's tiles:
    shared with `cells`, whose far field they also serve); the fastest whose output matches the first choice's is
    kept (TUNED: MuseTiles.tilted_far, tilted_summ, cells_fwd) for the later parts."""
    from longctx_patch.kernels.muse.triton_tilted import tilted_cells_fwd

    RES["far_tune"], RES["summ_tune"], RES["exact_tune"] = [], [], []
    for D in FAR:
        q, k, v = qkv(S, D, torch.bfloat16, seed=2)
        with torch.no_grad():
            plan = make_tilt_plan(q, k, scale=D**-0.5, tiles=tuned(D), **dict(CFG, q_clusters=QCS[0]))
            for key, field, choices in (("far", "tilted_far", FAR[D]), ("summ", "tilted_summ", SUMM[D]),
                                        ("exact", "cells_fwd", EXACT[D])):
                base = tuned(D) or MuseTiles()

                def make_run(t, base=base, field=field):
                    return lambda: tilted_cells_fwd(q, k, v, plan, D**-0.5, tiles=base.replace(**{field: t}))

                best = fastest(RES[f"{key}_tune"], D, S, choices, make_run, "attn_ms", rep=20)
                TUNED[D] = base.replace(**{field: best})
                RES.setdefault(f"{key}_tiles_used", {})[D] = best
        plan = None
        torch.cuda.empty_cache()
    save()


MEMBER = [(64, 64, 4, 3, 16), (64, 64, 4, 3, 8)]
NEAREST = {64: [(128, 64, 4), (128, 64, 8), (64, 64, 4), (128, 128, 8), (256, 64, 8), (128, 32, 4)],
           128: [(128, 64, 8), (128, 64, 4), (64, 64, 4), (128, 128, 8), (128, 32, 4)]}


def cluster_tune(S=65536):
    """The query clustering (`cluster_queries`, 256 clusters, Triton rounds) per tile choice of the members' sums
    (centroids per program, tokens per step, warps, stages, token chunks), then of the assignment (tokens, centroids,
    warps); the fastest whose centroids match the first choice's is kept (TUNED: MuseTiles.cluster_member,
    cluster_nearest) for the later parts."""
    from longctx_patch.kernels.muse.reference_tilted_cells import cluster_queries

    RES["cluster_tune"] = []
    for D in (64, 128):
        q, _, _ = qkv(S, D, torch.bfloat16, seed=3)
        valid = torch.ones(1, S, dtype=torch.bool, device=q.device)
        for key, field, choices in (("member", "cluster_member", MEMBER), ("nearest", "cluster_nearest", NEAREST[D])):
            base = tuned(D) or MuseTiles()

            def make_run(t, base=base, field=field):
                return lambda: cluster_queries(q, valid, QCS[0], CFG.get("kmeans_iters", 2), triton=True,
                                               tiles=base.replace(**{field: t}))[0]

            best = fastest(RES["cluster_tune"], D, S, choices, make_run, "ms", rep=20)
            TUNED[D] = base.replace(**{field: best})
            RES.setdefault(f"{key}_tiles_used", {})[D] = best
        torch.cuda.empty_cache()
    save()


def speed():
    from longctx_patch.kernels.muse.triton_tilted import tilted_cells_fwd

    cells_cfg = {k: v for k, v in CFG.items() if k != "q_clusters"}
    for D in (64, 128):
        for S in SEQS:
            if time.time() - T0 > BUDGET:
                RES.setdefault("skipped", []).append(dict(D=D, S=S))
                continue
            row = dict(D=D, S=S)
            try:
                q, k, v = qkv(S, D, torch.bfloat16, seed=S + D)
                sc = D**-0.5
                kx, vx = k.repeat_interleave(4, 1), v.repeat_interleave(4, 1)
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION), torch.no_grad():
                    row["cudnn_fwd_ms"] = bench(lambda: F.scaled_dot_product_attention(q, kx, vx, is_causal=True))
                tiles = tuned(D)
                with torch.no_grad():
                    row["cells_fwd_ms"] = bench(lambda: cells_triton(q, k, v, make_cells_plan(q, k, scale=sc, **cells_cfg),
                                                                     scale=sc, tiles=tiles))
                    for qc in QCS:
                        kw = dict(cells_cfg, q_clusters=qc)
                        r = dict(q_clusters=qc)
                        r["fwd_ms"] = bench(lambda: muse_attention(q, k, v, scale=sc, options=tc_options(kw),
                                                                   tiles=tiles))
                        r["plan_ms"] = bench(lambda: make_tilt_plan(q, k, scale=sc, tiles=tiles, **kw))
                        plan = make_tilt_plan(q, k, scale=sc, tiles=tiles, **kw)
                        r["attn_ms"] = bench(lambda: tilted_cells_fwd(q, k, v, plan, sc, tiles=tiles))
                        r["speedup_fwd_vs_cudnn"] = row["cudnn_fwd_ms"] / r["fwd_ms"]
                        r["vs_cells"] = row["cells_fwd_ms"] / r["fwd_ms"]
                        row[f"tilted_q{qc}"] = r
                        plan = None  # noqa: F841  (frees the summaries before the next row)
                        torch.cuda.empty_cache()
            except Exception as e:  # noqa: BLE001
                row["error"] = repr(e)[:400]
                traceback.print_exc()
            torch.cuda.empty_cache()
            RES["speed"].append(row)
            print(json.dumps(row), f"t={time.time() - T0:.0f}s", flush=True)
            save()


def profile(S=65536, D=int(os.environ.get("TILT_PROFILE_D", "64"))):
    """One forward at S by kernel (self CUDA time, ms), the plan's PyTorch ops included; D: TILT_PROFILE_D."""
    q, k, v = qkv(S, D, torch.bfloat16, seed=1)
    kw = dict({k_: v_ for k_, v_ in CFG.items()}, q_clusters=QCS[0])
    with torch.no_grad():
        muse_attention(q, k, v, scale=D**-0.5, options=tc_options(kw), tiles=tuned(D))
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            muse_attention(q, k, v, scale=D**-0.5, options=tc_options(kw), tiles=tuned(D))
            torch.cuda.synchronize()
    rows = sorted(((e.key, e.self_device_time_total / 1e3, e.count) for e in prof.key_averages()),
                  key=lambda r: -r[1])[:20]
    RES["profile"] = dict(S=S, D=D, kernels=[dict(name=n[:80], ms=t, calls=c) for n, t, c in rows])
    print(json.dumps(RES["profile"]), flush=True)
    save()


def bwd_checks():
    """Triton backward against autograd through the reference (fp32 and bf16, D 64 and 128, odd length, 14 / 2 heads):
    relative error of dq, dk, dv, and of the reference's own bf16-input gradients against its fp32-input ones."""
    for D in (64, 128):
        # inputs and centroids bf16-representable: every dtype below computes the same function of the same plan
        base = [t.float() for t in qkv(3001, D, torch.bfloat16, H=14, Hkv=2, seed=D + 1)]
        sc = D**-0.5
        cfg = dict(block_size=256, k_clusters=8, topk_blocks=2, peak_blocks=2, q_clusters=32)
        plan = make_tilt_plan(base[0].bfloat16(), base[1].bfloat16(), scale=sc, tiles=tuned(D), **cfg)
        do = torch.randn_like(base[0]).transpose(1, 2)

        def grads(fn, dtype):
            x = [t.detach().to(dtype).clone().requires_grad_(True) for t in base]
            fn(*x, dataclasses.replace(plan, centroids=plan.centroids.to(dtype))).backward(do.to(dtype))
            return [t.grad.float() for t in x]

        exact = grads(lambda *x: tilted_cells_reference(*x, scale=sc), torch.float64)
        for dtype in (torch.float32, torch.bfloat16):
            got = grads(lambda *x: tilted_cells_triton(*x, scale=sc, tiles=tuned(D, dtype)), dtype)
            ref = grads(lambda *x: tilted_cells_reference(*x, scale=sc), dtype)
            row = dict(dtype=str(dtype), D=D, S=3001, cfg=cfg)
            for name, a, r, e in zip(("dq", "dk", "dv"), got, ref, exact):
                row[f"{name}_vs_float64"] = rel(a, e)
                row[f"{name}_reference_vs_float64"] = rel(r, e)
            RES.setdefault("bwd_checks", []).append(row)
            print(json.dumps(row), flush=True)
    save()


def bwd_speed():
    """Forward + backward (plan included) against cuDNN's and the cells' in the same run, and the backward alone
    (retain_graph: the same graph each repetition)."""
    cells_cfg = {k: v for k, v in CFG.items() if k != "q_clusters"}
    for D in (64, 128):
        for S in SEQS:
            if time.time() - T0 > BUDGET:
                RES.setdefault("skipped", []).append(dict(D=D, S=S, part="bwd"))
                continue
            row = dict(D=D, S=S)
            try:
                q, k, v = (t.requires_grad_(True) for t in qkv(S, D, torch.bfloat16, seed=S + D))
                kx, vx = (t.detach().repeat_interleave(4, 1).requires_grad_(True) for t in (k, v))
                do = torch.randn_like(q)
                sc = D**-0.5
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    row["cudnn_fwdbwd_ms"] = bench(
                        lambda: F.scaled_dot_product_attention(q, kx, vx, is_causal=True, scale=sc).backward(do))
                kx = vx = None
                dot_ = do.transpose(1, 2)
                row["cells_fwdbwd_ms"] = bench(lambda: muse_attention(
                    q, k, v, scale=sc, options=MuseOptions(far_field="cells", **cells_cfg),
                    tiles=tuned(D)).backward(dot_))
                for qc in QCS:
                    kw = dict(cells_cfg, q_clusters=qc)
                    r = dict(q_clusters=qc)
                    r["fwdbwd_ms"] = bench(lambda: muse_attention(q, k, v, scale=sc, options=tc_options(kw),
                                                                  tiles=tuned(D)).backward(dot_))
                    o = muse_attention(q, k, v, scale=sc, options=tc_options(kw), tiles=tuned(D))
                    r["bwd_ms"] = bench(lambda: o.backward(dot_, retain_graph=True))
                    o = None
                    r["speedup_fwdbwd_vs_cudnn"] = row["cudnn_fwdbwd_ms"] / r["fwdbwd_ms"]
                    r["vs_cells"] = row["cells_fwdbwd_ms"] / r["fwdbwd_ms"]
                    row[f"tilted_q{qc}"] = r
                    torch.cuda.empty_cache()
            except Exception as e:  # noqa: BLE001
                row["error"] = repr(e)[:400]
                traceback.print_exc()
            q = k = v = None
            torch.cuda.empty_cache()
            RES.setdefault("bwd_speed", []).append(row)
            print(json.dumps(row), f"t={time.time() - T0:.0f}s", flush=True)
            save()


def bwd_profile(S=65536):
    """One backward at S by kernel (self CUDA time, ms), D 64 and 128; then the backward's launch tiles swept
    (TILT_BWD_SWEEP=1): each kernel's alternatives (MuseTiles.tilted_dq, tilted_dsumm, tilted_sbwd, passed to a
    forward whose backward runs with them), the backward timed alone."""
    for D in (64, 128):
        q, k, v = (t.requires_grad_(True) for t in qkv(S, D, torch.bfloat16, seed=2))
        do = torch.randn_like(q).transpose(1, 2)
        kw = dict(CFG, q_clusters=QCS[0])
        o = muse_attention(q, k, v, scale=D**-0.5, options=tc_options(kw), tiles=tuned(D))
        o.backward(do, retain_graph=True)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            o.backward(do, retain_graph=True)
            torch.cuda.synchronize()
        rows = sorted(((e.key, e.self_device_time_total / 1e3, e.count) for e in prof.key_averages()),
                      key=lambda r: -r[1])[:15]
        prof_row = dict(S=S, D=D, kernels=[dict(name=n[:80], ms=t, calls=c) for n, t, c in rows], sweep=[])
        if os.environ.get("TILT_BWD_SWEEP"):
            o = None  # each choice runs its own forward
            base = tuned(D) or MuseTiles()
            options = dict(dq=[(64, 64, 4), (64, 64, 8), (128, 64, 8), (64, 32, 4)],
                           dsumm=[(64, 64, 4), (64, 64, 8), (32, 64, 4), (128, 64, 8), (64, 32, 4)],
                           sbwd=[(32, 32, 4), (64, 32, 4), (64, 32, 8), (32, 64, 4), (16, 32, 4)])
            if os.environ.get("TILT_BWD_OPTIONS"):  # JSON {"dsumm": [[BM, BN, warps], ...], ...}
                options = {k_: [tuple(t) for t in v_] for k_, v_ in json.loads(os.environ["TILT_BWD_OPTIONS"]).items()}
            for part, alts in options.items():
                for alt in alts:
                    try:
                        o = muse_attention(q, k, v, scale=D**-0.5, options=tc_options(kw),
                                           tiles=base.replace(**{f"tilted_{part}": alt}))
                        ms = bench(lambda: o.backward(do, retain_graph=True), rep=20)
                    except Exception as e:  # noqa: BLE001
                        ms = repr(e)[:200]
                    o = None
                    prof_row["sweep"].append(dict(part=part, tiles=alt, bwd_ms=ms))
                    print(json.dumps(prof_row["sweep"][-1]), flush=True)
        RES.setdefault("bwd_profile", []).append(prof_row)
        print(json.dumps({k_: v_ for k_, v_ in prof_row.items() if k_ != "sweep"}), flush=True)
        o = q = k = v = None
        torch.cuda.empty_cache()
        save()


def main():
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    RES["device"] = device_description("cuda")
    for part in os.environ.get("TILT_PARTS", "checks,speed,profile").split(","):
        try:
            {"checks": checks, "far_tune": far_tune, "cluster_tune": cluster_tune, "speed": speed, "profile": profile,
             "bwd_checks": bwd_checks, "bwd_speed": bwd_speed, "bwd_profile": bwd_profile}[part]()
        except Exception:  # noqa: BLE001
            traceback.print_exc()
    save()


if __name__ == "__main__":
    main()
