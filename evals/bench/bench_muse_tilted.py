"""MuSe's tilted-cells far field (`kernels/muse/tilted_cells.py`) on a CUDA GPU: the Triton forward against the PyTorch
reference, then its forward time (plan included) against torch SDPA (cuDNN) and against the cells far field with the
same exact part, in the same run, with the time split into the plan, the summaries, the exact part and the far field.

    python3 -m evals.bench.bench_muse_tilted      # writes $OUT/tilted-cells-speed-<gpu>.json (else evals/results/muse/)

Shapes: B = 1, 32 query / 8 kv heads, bf16, D = 64 and 128 (the issue's op-level setting). Env: TILT_SEQS (default
16384,65536,131072,32768), TILT_QC (query clusters, default 256,64), TILT_CFG (the cells plan, JSON; default the
package's cells defaults), TILT_BUDGET_S (default 400).
"""

from __future__ import annotations

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

from evals.bench.bench_muse_cells import bench, qkv, rel
from evals.shared import device_token, results_dir
from longctx_patch.evals.common import git_commit
from longctx_patch.kernels.muse import muse_attention
from longctx_patch.kernels.muse.cells import make_cells_plan
from longctx_patch.kernels.muse.ops import cells_triton
from longctx_patch.kernels.muse.tilted_cells import make_tilt_plan, tilted_cells_reference
from longctx_patch.methods.muse import FAR_FIELD_DEFAULTS

OUT = os.environ.get("OUT")
T0 = time.time()
BUDGET = float(os.environ.get("TILT_BUDGET_S", "400"))
SEQS = [int(x) for x in os.environ.get("TILT_SEQS", "16384,65536,131072,32768").split(",")]
QCS = [int(x) for x in os.environ.get("TILT_QC", "256,64").split(",")]
CFG = json.loads(os.environ["TILT_CFG"]) if os.environ.get("TILT_CFG") else dict(FAR_FIELD_DEFAULTS["tilted-cells"],
                                                                                 sink_blocks=1)
RES: dict = dict(device=None, date=datetime.date.today().isoformat(), commit=git_commit(),
                 command=" ".join([f"{k}={shlex.quote(v)}" for k, v in sorted(os.environ.items()) if k.startswith("TILT_")]
                                  + ["python3 -m evals.bench.bench_muse_tilted"]), torch=torch.__version__,
                 triton=triton.__version__, cells_plan=CFG, checks=[], speed=[], profile=None)


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
            plan = make_tilt_plan(q, k, scale=sc, **cfg)
            from longctx_patch.kernels.muse.triton_tilted import tilted_cells_fwd

            o = tilted_cells_fwd(q, k, v, plan, sc)
            r = tilted_cells_reference(q, k, v, plan, scale=sc)
            ex = F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(7, 1),
                                                v.float().repeat_interleave(7, 1), is_causal=True, scale=sc)
            oc = cells_triton(q, k, v, plan.cells, scale=sc)
            row = dict(dtype=str(dtype), D=D, S=3001, cfg=cfg, fwd_vs_reference=rel(o, r),
                       err_vs_exact_random=rel(o, ex.transpose(1, 2)), cells_err_vs_exact_random=rel(oc, ex.transpose(1, 2)))
            RES["checks"].append(row)
            print(json.dumps(row), flush=True)
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
                with torch.no_grad():
                    row["cells_fwd_ms"] = bench(lambda: cells_triton(q, k, v, make_cells_plan(q, k, scale=sc, **cells_cfg),
                                                                     scale=sc))
                    for qc in QCS:
                        kw = dict(cells_cfg, q_clusters=qc)
                        r = dict(q_clusters=qc)
                        r["fwd_ms"] = bench(lambda: muse_attention(q, k, v, scale=sc, far_field="tilted-cells", **kw))
                        r["plan_ms"] = bench(lambda: make_tilt_plan(q, k, scale=sc, **kw))
                        plan = make_tilt_plan(q, k, scale=sc, **kw)
                        r["attn_ms"] = bench(lambda: tilted_cells_fwd(q, k, v, plan, sc))
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


def profile(S=65536, D=64):
    """One forward at S by kernel (self CUDA time, ms), the plan's PyTorch ops included."""
    q, k, v = qkv(S, D, torch.bfloat16, seed=1)
    kw = dict({k_: v_ for k_, v_ in CFG.items()}, q_clusters=QCS[0])
    with torch.no_grad():
        muse_attention(q, k, v, scale=D**-0.5, far_field="tilted-cells", **kw)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            muse_attention(q, k, v, scale=D**-0.5, far_field="tilted-cells", **kw)
            torch.cuda.synchronize()
    rows = sorted(((e.key, e.self_device_time_total / 1e3, e.count) for e in prof.key_averages()),
                  key=lambda r: -r[1])[:20]
    RES["profile"] = dict(S=S, D=D, kernels=[dict(name=n[:80], ms=t, calls=c) for n, t, c in rows])
    print(json.dumps(RES["profile"]), flush=True)
    save()


def main():
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    RES["device"] = torch.cuda.get_device_name(0)
    for part in os.environ.get("TILT_PARTS", "checks,speed,profile").split(","):
        try:
            {"checks": checks, "speed": speed, "profile": profile}[part]()
        except Exception:  # noqa: BLE001
            traceback.print_exc()
    save()


if __name__ == "__main__":
    main()
