"""MuSe's linear-cost far field (`kernels/muse/reference_cells.py`) on a CUDA GPU: correctness of the Triton forward and
backward against the PyTorch reference, then forward and forward+backward time against torch SDPA (cuDNN) in the
same run. The plan is timed on both backends (the Triton clustering/scoring kernels of kernels/muse/triton_cluster.py,
and the PyTorch code), with how far the two plans agree; a profile of one 64k forward lists the kernels' times.

    python3 -m benchmarks.ops.bench_muse_cells            # writes $OUT/cells-speed-<gpu>.json (or in benchmarks/results/muse/)

Shapes: B = 1, 32 query / 8 kv heads, bf16, D = 64 and 128 (the issue's op-level setting). The MuSe time includes
the plan (Lloyd clustering of every block's keys, retrieval scoring) and the cell summaries.
Env: CELLS_SEQS (default 65536,131072,16384,32768); CELLS_CFGS (JSON list of plan configs; default the package's
cells defaults and the previous defaults; one with "far_field": "tilted" goes to `muse_attention` and is timed
forward only); CELLS_BUDGET_S; CELLS_PARTS (default checks,profile,peaks,tune,speed; also fp32: the fp32 forward against
SDPA's memory-efficient backend; dkdv: the dK/dV kernel's tiles timed at 64k; fwd: forward only, every configuration at every length (the per-length sweep); `peaks` times the peak-score kernel's tiles and `tune` the forward kernel's at
64k: `tune` keeps the fastest for the speed rows, `peaks` records it); CELLS_PROFILE_D (default 64); CELLS_TILES (JSON {"64":
[[BM, BN, warps, stages], ...]}: the choices `tune` times); CELLS_PEAKS (JSON [[keys, warps, stages], ...]).
"""

from __future__ import annotations

import datetime
import inspect
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

from benchmarks.shared import device_token, results_dir
from longctx_patch.kernels.muse.plan import block_view
from longctx_patch.provenance import device_description, git_commit
from longctx_patch.kernels.muse import MuseOptions, MuseTiles, muse_attention
from longctx_patch.kernels.muse.reference_cells import cells_reference, make_cells_plan
from longctx_patch.kernels.muse.ops import cells_triton
from longctx_patch.methods.muse import FAR_FIELD_DEFAULTS

OUT = os.environ.get("OUT")  # None: the results' muse/ folder
T0 = time.time()
BUDGET = float(os.environ.get("CELLS_BUDGET_S", "500"))
SEQS = [int(x) for x in os.environ.get("CELLS_SEQS", "65536,131072,16384,32768").split(",")]
# default: the package's cells defaults, then the previous defaults (Ck 16, 16 blocks)
CFGS = json.loads(os.environ["CELLS_CFGS"]) if os.environ.get("CELLS_CFGS") else [
    dict(FAR_FIELD_DEFAULTS["cells"]), {"block_size": 256, "k_clusters": 16, "topk_blocks": 16}]
for _c in CFGS:  # record the sink and peak blocks each cells configuration runs with (the plan's default if not given)
    if _c.get("far_field") != "tilted":
        for _k in ("sink_blocks", "peak_blocks"):
            _c.setdefault(_k, inspect.signature(make_cells_plan).parameters[_k].default)
RES: dict = dict(task="muse-cells-speed", device=None, date=datetime.date.today().isoformat(), commit=git_commit(),
                 command=" ".join([f"{k}={shlex.quote(v)}" for k, v in sorted(os.environ.items()) if k.startswith("CELLS_")]
                                  + ["python3 -m benchmarks.ops.bench_muse_cells"]), torch=torch.__version__,
                 triton=triton.__version__, checks=[], speed=[])


# head_dim -> the kernels' tiles the sweeps kept (`tune`, `dkdv`), passed as `tiles=` to the later parts' bf16 calls
TUNED: dict[int, MuseTiles] = {}


def tuned(D: int, dtype=torch.bfloat16) -> MuseTiles | None:
    """The tiles the sweeps kept for head_dim D (for bf16 inputs: the sweeps' dtype), else None (the defaults)."""
    return TUNED.get(D) if dtype == torch.bfloat16 else None


def save():
    with open(results_dir("muse", OUT) / f"cells-speed-{device_token()}.json", "w") as f:
        json.dump(RES, f, indent=1)


def bench(fn, rep=50):
    return triton.testing.do_bench(fn, warmup=5, rep=rep, return_mode="median")


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def qkv(S, D, dtype, H=32, Hkv=8, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda h: torch.randn(1, h, S, D, device="cuda", dtype=torch.float32, generator=g).to(dtype)  # noqa: E731
    return mk(H), mk(Hkv), mk(Hkv)


def checks():
    """Triton forward and backward against the reference, per dtype and head size; `first_call_s` is the first
    forward + backward of a new kernel configuration (compile included)."""
    for dtype in (torch.float32, torch.bfloat16):
        for D, S, cfg in ((64, 3001, dict(block_size=256, k_clusters=32, topk_blocks=3)),
                          (64, 2049, dict(block_size=128, k_clusters=16, topk_blocks=2)),
                          (128, 3001, dict(block_size=256, k_clusters=32, topk_blocks=3))):
            q, k, v = qkv(S, D, dtype, H=8, Hkv=2, seed=S)
            km = torch.ones(1, S, dtype=torch.bool, device="cuda")
            sc = D**-0.5
            plan = make_cells_plan(q, k, scale=sc, key_mask=km, **cfg)
            tplan = make_cells_plan(q, k, scale=sc, key_mask=km, backend="torch", **cfg)
            agree = dict(plan_assign_agreement=float((tplan.k_assign == plan.k_assign).float().mean()),
                         plan_retrieved_agreement=float((tplan.retrieved == plan.retrieved).float().mean()))
            q, k, v = (t.requires_grad_(True) for t in (q, k, v))
            t0 = time.time()
            o = cells_triton(q, k, v, plan, scale=sc)
            do = torch.randn_like(o)
            g = torch.autograd.grad(o, (q, k, v), do)
            torch.cuda.synchronize()
            first = time.time() - t0
            qr, kr, vr = (t.detach().float().requires_grad_(True) for t in (q, k, v))
            r = cells_reference(qr, kr, vr, plan, scale=sc)
            gr = torch.autograd.grad(r, (qr, kr, vr), do.float())
            q, k, v, r = q.detach(), k.detach(), v.detach(), r.detach()
            ex = F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(4, 1),
                                                v.float().repeat_interleave(4, 1), is_causal=True, scale=sc)
            row = dict(dtype=str(dtype), D=D, S=S, cfg=cfg, first_call_s=first, fwd_vs_reference=rel(o, r),
                       dq=rel(g[0], gr[0]),
                       dk=rel(g[1], gr[1]), dv=rel(g[2], gr[2]),
                       approx_err_vs_exact_random=rel(r, ex.transpose(1, 2)), **agree)
            RES["checks"].append(row)
            print(json.dumps(row), flush=True)
    save()


def speed():
    for cfg in CFGS:
        for D in (64, 128):
            for S in SEQS:
                if time.time() - T0 > BUDGET:
                    RES.setdefault("skipped", []).append(dict(cfg=cfg, D=D, S=S))
                    continue
                row = dict(cfg=cfg, D=D, S=S)
                try:
                    q, k, v = qkv(S, D, torch.bfloat16, seed=S + D)
                    sc = D**-0.5
                    kx, vx = k.repeat_interleave(4, 1), v.repeat_interleave(4, 1)
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION), torch.no_grad():
                        row["cudnn_fwd_ms"] = bench(lambda: F.scaled_dot_product_attention(q, kx, vx, is_causal=True))
                    if cfg.get("far_field") == "tilted":  # the per-block design, for comparison: forward only
                        with torch.no_grad():
                            row["muse_fwd_ms"] = bench(lambda: muse_attention(q, k, v, scale=sc,
                                                                               options=MuseOptions(**cfg)), rep=20)
                        row["speedup_fwd_vs_cudnn"] = row["cudnn_fwd_ms"] / row["muse_fwd_ms"]
                        RES["speed"].append(row)
                        print(json.dumps(row), f"t={time.time() - T0:.0f}s", flush=True)
                        save()
                        continue
                    with torch.no_grad():
                        row["cells_fwd_ms"] = bench(lambda: cells_triton(q, k, v, make_cells_plan(q, k, scale=sc, **cfg),
                                                                         scale=sc, tiles=tuned(D)))
                        plan = make_cells_plan(q, k, scale=sc, **cfg)
                        row["cells_plan_ms"] = bench(lambda: make_cells_plan(q, k, scale=sc, **cfg))
                        row["cells_plan_torch_ms"] = bench(lambda: make_cells_plan(q, k, scale=sc, backend="torch",
                                                                                   **cfg), rep=20)
                        tplan = make_cells_plan(q, k, scale=sc, backend="torch", **cfg)
                        row["plan_assign_agreement"] = float((tplan.k_assign == plan.k_assign).float().mean())
                        row["plan_retrieved_agreement"] = float((tplan.retrieved == plan.retrieved).float().mean())
                        del tplan
                        row["cells_attn_ms"] = bench(lambda: cells_triton(q, k, v, plan, scale=sc, tiles=tuned(D)))
                        row["exact_keys_frac"] = float(plan.retrieved.float().sum(-1).mean() * cfg["block_size"] / (S / 2))
                    row["speedup_fwd_vs_cudnn"] = row["cudnn_fwd_ms"] / row["cells_fwd_ms"]
                    save()
                    qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))
                    kxg, vxg = (t.detach().repeat_interleave(4, 1).requires_grad_(True) for t in (k, v))
                    do = torch.randn_like(q)
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        row["cudnn_fwdbwd_ms"] = bench(
                            lambda: F.scaled_dot_product_attention(qg, kxg, vxg, is_causal=True).backward(do))
                    do2 = do.transpose(1, 2)

                    def fwdbwd():
                        p = make_cells_plan(qg, kg, scale=sc, **cfg)
                        cells_triton(qg, kg, vg, p, scale=sc, tiles=tuned(D)).backward(do2)

                    row["cells_fwdbwd_ms"] = bench(fwdbwd)
                    row["speedup_fwdbwd_vs_cudnn"] = row["cudnn_fwdbwd_ms"] / row["cells_fwdbwd_ms"]
                except Exception as e:  # noqa: BLE001
                    row["error"] = repr(e)[:400]
                    traceback.print_exc()
                torch.cuda.empty_cache()
                RES["speed"].append(row)
                print(json.dumps(row), f"t={time.time() - T0:.0f}s", flush=True)
                save()


def fwd():
    """Forward only, every configuration of CELLS_CFGS at every length and head size against one cuDNN timing: the
    sweep behind the per-length defaults (plan and attention timed apart)."""
    for D in (64, 128):
        for S in SEQS:
            if time.time() - T0 > BUDGET:
                RES.setdefault("skipped", []).append(dict(part="fwd", D=D, S=S))
                continue
            q, k, v = qkv(S, D, torch.bfloat16, seed=S + D)
            sc = D**-0.5
            kx, vx = k.repeat_interleave(4, 1), v.repeat_interleave(4, 1)
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION), torch.no_grad():
                cudnn = bench(lambda: F.scaled_dot_product_attention(q, kx, vx, is_causal=True))
            for cfg in CFGS:
                row = dict(part="fwd", cfg=cfg, D=D, S=S, cudnn_fwd_ms=cudnn)
                try:
                    with torch.no_grad():
                        row["cells_fwd_ms"] = bench(lambda: cells_triton(
                            q, k, v, make_cells_plan(q, k, scale=sc, **cfg), scale=sc, tiles=tuned(D)))
                        plan = make_cells_plan(q, k, scale=sc, **cfg)
                        row["cells_plan_ms"] = bench(lambda: make_cells_plan(q, k, scale=sc, **cfg))
                        row["cells_attn_ms"] = bench(lambda: cells_triton(q, k, v, plan, scale=sc, tiles=tuned(D)))
                        row["exact_keys_frac"] = float(plan.retrieved.float().sum(-1).mean() * cfg["block_size"] / (S / 2))
                    row["speedup_fwd_vs_cudnn"] = cudnn / row["cells_fwd_ms"]
                except Exception as e:  # noqa: BLE001
                    row["error"] = repr(e)[:400]
                    traceback.print_exc()
                RES["speed"].append(row)
                print(json.dumps(row), f"t={time.time() - T0:.0f}s", flush=True)
            del q, k, v, kx, vx
            torch.cuda.empty_cache()
            save()


def fp32():
    """fp32 forward (tf32x3 dots) of the first configuration against torch SDPA's best fp32 backend
    (memory-efficient attention; cuDNN and flash take no fp32), 16k and 64k."""
    cfg = CFGS[0]
    for D in (64, 128):
        for S in (16384, 65536):
            if time.time() - T0 > BUDGET:
                RES.setdefault("skipped", []).append(dict(part="fp32", D=D, S=S))
                continue
            q, k, v = qkv(S, D, torch.float32, seed=S + D)
            sc = D**-0.5
            kx, vx = k.repeat_interleave(4, 1), v.repeat_interleave(4, 1)
            row = dict(part="fp32", cfg=cfg, D=D, S=S)
            with torch.no_grad():
                with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
                    row["sdpa_efficient_fwd_ms"] = bench(
                        lambda: F.scaled_dot_product_attention(q, kx, vx, is_causal=True), rep=20)
                row["cells_fwd_ms"] = bench(lambda: cells_triton(q, k, v, make_cells_plan(q, k, scale=sc, **cfg),
                                                                 scale=sc), rep=20)
            row["speedup_fwd"] = row["sdpa_efficient_fwd_ms"] / row["cells_fwd_ms"]
            RES.setdefault("fp32", []).append(row)
            print(json.dumps(row), f"t={time.time() - T0:.0f}s", flush=True)
            torch.cuda.empty_cache()
    save()


def profile(S=65536):
    """Per-kernel CUDA time of one forward (plan included) at the first configuration, for each head size in
    CELLS_PROFILE_D."""
    for D in (int(d) for d in os.environ.get("CELLS_PROFILE_D", "64").split(",")):
        _profile(S, D)


def _profile(S, D):
    cfg = CFGS[0]
    q, k, v = qkv(S, D, torch.bfloat16, seed=1)
    run = lambda: cells_triton(q, k, v, make_cells_plan(q, k, scale=D**-0.5, **cfg), scale=D**-0.5)  # noqa: E731
    with torch.no_grad():
        run()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize()
    ev = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
    row = dict(S=S, D=D, cfg=cfg, total_ms=sum(e.device_time_total for e in ev) / 1e3,
               kernels=[dict(name=e.key[:90], ms=e.device_time_total / 1e3, calls=e.count) for e in ev[:20]])
    RES.setdefault("profiles", []).append(row)
    print(json.dumps(row), flush=True)
    save()


TILES = {64: [(128, 128, 4, 2), (128, 128, 4, 3), (128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 4, 3),
              (128, 64, 8, 3), (64, 64, 4, 3)],
         128: [(128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 8, 2), (128, 64, 8, 3), (64, 64, 4, 3)]}
if os.environ.get("CELLS_TILES"):  # JSON {"64": [[BM, BN, warps, stages], ...], "128": [...]}
    TILES = {int(d): [tuple(t) for t in ts] for d, ts in json.loads(os.environ["CELLS_TILES"]).items()}


def fastest(rows, D, S, choices, make_run, time_key, rep=50):
    """Time `make_run(choice)()` (its output: a tensor or a tuple of them; `make_run` passes the choice to the kernels
    as their `tiles`) for each tile choice, and return the fastest whose output is within 1e-2 of the first choice's;
    a row per choice appended to the list `rows`."""
    best, ref = None, None
    for t in choices:
        try:
            run = make_run(t)
            out = run()
            out = out if isinstance(out, tuple) else (out,)
            ref = out if ref is None else ref
            row = dict(D=D, S=S, tiles=t, diff_vs_first=max(rel(a, b) for a, b in zip(out, ref)))
            row[time_key] = bench(run, rep=rep)
            if row["diff_vs_first"] < 1e-2 and (best is None or row[time_key] < best[1]):
                best = (t, row[time_key])
        except Exception as e:  # noqa: BLE001
            row = dict(D=D, tiles=t, error=repr(e)[:200])
        rows.append(row)
        print(json.dumps(row), f"t={time.time() - T0:.0f}s", flush=True)
    return best[0]


def tune(S=65536):
    """Forward kernel time per tile choice (BM, BN, warps, stages) at the first configuration; the fastest is kept
    (TUNED, MuseTiles.cells_fwd) for the speed rows. Each choice's output is checked against the first one's."""
    cfg = CFGS[0]
    RES["tune"] = []
    for D, choices in TILES.items():
        q, k, v = qkv(S, D, torch.bfloat16, seed=2)
        with torch.no_grad():
            plan = make_cells_plan(q, k, scale=D**-0.5, **cfg)
            base = tuned(D) or MuseTiles()

            def make_run(t):
                return lambda: cells_triton(q, k, v, plan, scale=D**-0.5, tiles=base.replace(cells_fwd=t))

            best = fastest(RES["tune"], D, S, choices, make_run, "ms")
            TUNED[D] = base.replace(cells_fwd=best)
            RES.setdefault("tiles_used", {})[D] = best
        torch.cuda.empty_cache()
    save()


PEAKS = [(64, 4, 3), (64, 8, 2), (64, 8, 3), (128, 8, 2), (32, 4, 3), (32, 8, 3)]
if os.environ.get("CELLS_PEAKS"):  # JSON [[keys per tile, warps, stages], ...]
    PEAKS = [tuple(t) for t in json.loads(os.environ["CELLS_PEAKS"])]


def peaks():
    """The peak-score kernel (`peak_blocks`) per tile choice (keys per tile, warps, stages, passed as its `tiles`) at
    64k and 128k, checked against the PyTorch `block_peaks` on the same inputs; the fastest at each D is recorded
    (`peaks_tiles_fastest`: a candidate for support.peaks_tiles' defaults; the later parts run the defaults)."""
    from longctx_patch.kernels.muse import triton_cluster as cl
    from longctx_patch.kernels.muse.reference_cells import block_peaks

    L = CFGS[0]["block_size"]
    RES["peaks"] = []
    for D in (64, 128):
        times: dict = {}
        for S in (65536, 131072):
            q, k, _ = qkv(S, D, torch.bfloat16, seed=3)
            nb = S // L
            qbar = q.view(1, 32, nb, L, D).float().mean(3)
            kb = block_view(k, L, S)
            valid = torch.ones(1, S, dtype=torch.bool, device="cuda")
            ref = block_peaks(qbar, kb, valid, scale=D**-0.5, local_blocks=1)
            fin = torch.isfinite(ref)
            for t in PEAKS:
                row = dict(D=D, S=S, tiles=t)
                try:
                    got = cl.block_peaks_triton(qbar, kb, valid, scale=D**-0.5, local_blocks=1, tiles=t)
                    row["same_inf"] = bool(torch.equal(torch.isinf(got), ~fin))
                    row["max_abs_diff"] = float((got[fin] - ref[fin]).abs().max())
                    row["ms"] = bench(lambda: cl.block_peaks_triton(qbar, kb, valid, scale=D**-0.5, local_blocks=1,
                                                                    tiles=t))
                    if row["same_inf"] and row["max_abs_diff"] < 1e-3:
                        times.setdefault(t, []).append(row["ms"])
                except Exception as e:  # noqa: BLE001
                    row["error"] = repr(e)[:300]
                RES["peaks"].append(row)
                print(json.dumps(row), f"t={time.time() - T0:.0f}s", flush=True)
            torch.cuda.empty_cache()
        full = {t: sum(v) for t, v in times.items() if len(v) == 2}
        if full:
            RES.setdefault("peaks_tiles_fastest", {})[D] = min(full, key=full.get)
    save()


DKDV = [(64, 128, 8, 1), (64, 128, 8, 2), (64, 128, 4, 2), (128, 64, 8, 2), (128, 128, 8, 2), (64, 64, 4, 2),
        (64, 64, 4, 3), (128, 64, 8, 3)]


def dkdv(S=65536):
    """The backward alone (retain_graph, plan fixed) per tile choice of the dK/dV kernel (key tile, query tile, warps,
    stages), the first configuration, D 64 and 128; each choice's gradients checked against the first one's (a
    forward per choice, its backward timed: the backward runs with its forward's tiles). The fastest is kept (TUNED,
    MuseTiles.cells_dkdv) for later parts."""
    cfg = CFGS[0]
    RES["dkdv"] = []
    for D in (64, 128):
        q, k, v = (t.requires_grad_(True) for t in qkv(S, D, torch.bfloat16, seed=3))
        plan = make_cells_plan(q.detach(), k.detach(), scale=D**-0.5, **cfg)
        do = torch.randn_like(q.detach().transpose(1, 2).contiguous())  # o's shape [B, S, Hq, D]
        base = tuned(D) or MuseTiles()

        def make_run(t):
            o = cells_triton(q, k, v, plan, scale=D**-0.5, tiles=base.replace(cells_dkdv=t))
            return lambda: torch.autograd.grad(o, (k, v), do, retain_graph=True)

        best = fastest(RES["dkdv"], D, S, DKDV, make_run, "bwd_ms", rep=30)
        TUNED[D] = base.replace(cells_dkdv=best)
        RES.setdefault("dkdv_tiles_used", {})[D] = best
        q = k = v = None
        torch.cuda.empty_cache()
    save()


def main():
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    RES["device"] = device_description("cuda")
    parts = os.environ.get("CELLS_PARTS", "checks,profile,peaks,tune,speed").split(",")
    for part in (checks, fp32, profile, peaks, tune, dkdv, speed, fwd):
        if part.__name__ in parts:
            try:
                part()
            except Exception:  # noqa: BLE001
                traceback.print_exc()
    save()


if __name__ == "__main__":
    main()
