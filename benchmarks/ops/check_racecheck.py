"""Every Triton kernel family once, at small shapes, against its PyTorch reference: a light workload to run under
`compute-sanitizer --tool racecheck` (or memcheck / initcheck), which slows kernels by orders of magnitude, so a
model-level check (benchmarks/generate/check_gpu_integration.py) does not finish there. One JSON line per check: the relative error of
the Triton path against the reference (forward, and gradients where the path has a backward).

    compute-sanitizer --tool racecheck python3 -m benchmarks.ops.check_racecheck --only muse
    python3 -m benchmarks.ops.check_racecheck                       # all families, no sanitizer
    TRITON_INTERPRET=1 python3 -m benchmarks.ops.check_racecheck    # on the CPU (interpreter), slow

Families: lolcats (hybrid prefill), lola (prefill with evictions, then decode steps), muse (clustering plan,
forward, backward), ovq (chunk attention forward/backward, fused prefill, training path). A race shows as
sanitizer hazards and, often, as an error that changes from run to run (the LoLA eviction fold's race of
2026-11-30: docs/PERFORMANCE.md, LoLA).
"""
from __future__ import annotations

import argparse
import json
import os

import torch

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def emit(family: str, name: str, **vals) -> None:
    print(json.dumps({"family": family, "check": name, **{k: (f"{v:.3e}" if isinstance(v, float) else v)
                                                           for k, v in vals.items()}}), flush=True)


def randn(g, *shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, device=DEV, generator=g) * scale).to(dtype)


def lola_inputs(S, D, dtype, seed):
    """bench_lola's check inputs (B=2, 8/2 heads, feature dim 32) and a key mask with left padding in row 1."""
    from benchmarks.ops.bench_lola import make  # imported after main() set its CPU mode (BENCH_SMOKE)

    q, k, v, fq, fk, gw, lf, _, Wk = make(2, 8, 2, S, D, 32, dtype, seed=seed)
    km = torch.ones(2, S, dtype=torch.bool, device=DEV)
    km[1, : S // 6] = False
    return q, k, v, fq, fk, gw, lf, Wk, km


def check_lolcats(S: int) -> None:
    from longctx_patch.kernels.lola import reference as ref
    from longctx_patch.kernels.lola.ops import hybrid_attention

    for dtype in (torch.float32, torch.bfloat16):
        q, k, v, fq, fk, gw, lf, _, km = lola_inputs(S, 64, dtype, seed=1)
        want = ref.hybrid_attention_quadratic(q, k, v, fq, fk, gw, lf, ref.HybridSpec(window=64), key_mask=km)
        want = want.transpose(1, 2)
        spec = ref.HybridSpec(window=64, scale=64 ** -0.5, backend="triton")
        got = hybrid_attention(q, k, v, fq, fk, gw, lf, spec, key_mask=km)
        real = km[:, :, None, None].expand_as(got)
        emit("lolcats", f"prefill_{str(dtype)[6:]}", rel=rel(got[real], want[real]))


def check_lola(S: int, steps: int = 6) -> None:
    from longctx_patch.kernels.lola import reference as ref
    from longctx_patch.kernels.lola import LolaRun, LolaState, StateSizes, lola_process

    for dtype in (torch.float32, torch.bfloat16):
        q, k, v, fq, fk, gw, lf, Wk, km = lola_inputs(S + steps, 64, dtype, seed=2)
        phi_k = lambda x: ref.hedgehog_feature_map(x, Wk, out_dtype=dtype)  # noqa: E731
        res = {}
        for backend in ("torch", "triton"):
            run = LolaRun(phi_k=phi_k, window=32, chunk=64, lam=16, scale=64 ** -0.5, backend=backend)
            st = LolaState.empty(StateSizes(2, 8, 2, 64, 64, 16), dtype, DEV)
            pre = lola_process(st, q[:, :, :S], k[:, :, :S], v[:, :, :S], fq[:, :, :S], gw, lf, run,
                               key_mask_new=km[:, :S])
            dec = [lola_process(st, q[:, :, i:i + 1], k[:, :, i:i + 1], v[:, :, i:i + 1], fq[:, :, i:i + 1], gw, lf,
                                run) for i in range(S, S + steps)]
            res[backend] = (pre, torch.cat(dec, 1), st)
        real = km[:, :S, None, None].expand_as(res["torch"][0])
        emit("lola", f"prefill_{str(dtype)[6:]}", rel=rel(res["triton"][0][real], res["torch"][0][real]),
             state_H=rel(res["triton"][2].H, res["torch"][2].H), state_s=rel(res["triton"][2].s, res["torch"][2].s))
        emit("lola", f"decode_{str(dtype)[6:]}", rel=rel(res["triton"][1], res["torch"][1]))


def check_muse(S: int) -> None:
    from longctx_patch.kernels.muse import make_plan
    from longctx_patch.kernels.muse.reference import muse_reference_planned
    from longctx_patch.kernels.muse.ops import muse_triton_planned

    for dtype in (torch.float32, torch.bfloat16):
        g = torch.Generator(device=DEV).manual_seed(3)
        q, k, v = (randn(g, 1, h, S, 64, dtype=dtype).requires_grad_() for h in (8, 2, 2))
        kw = dict(scale=0.125, block_size=64, q_clusters=4, k_clusters=4, kmeans_iters=2, topk_blocks=1,
                  topk_clusters=2)
        km = torch.ones(1, S, dtype=torch.bool, device=DEV)
        km[0, :9] = False
        plan = make_plan(q.detach(), k.detach(), key_mask=km, **kw)
        o_t = muse_triton_planned(q, k, v, plan, scale=kw["scale"])
        o_r = muse_reference_planned(q, k, v, plan, scale=kw["scale"])
        do = torch.randn(o_t.shape, device=DEV, generator=g).to(dtype)
        gt = torch.autograd.grad(o_t, (q, k, v), do)
        gr = torch.autograd.grad(o_r, (q, k, v), do)
        emit("muse", f"fwd_bwd_{str(dtype)[6:]}", fwd=rel(o_t[:, 9:], o_r[:, 9:]), dq=rel(gt[0], gr[0]),
             dk=rel(gt[1], gr[1]), dv=rel(gt[2], gr[2]))


def check_ovq(S: int) -> None:
    from longctx_patch.kernels.ovq import ovq_attention
    from longctx_patch.kernels.ovq.reference import chunk_attention_ref
    from longctx_patch.kernels.ovq.ops import chunk_attention_triton

    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype)[6:]
        g = torch.Generator(device=DEV).manual_seed(4)
        nd, L, M, qo = 100, 57, 41, 16  # dictionary rows, chunk keys, queries, query offset
        q = randn(g, 2, 8, M, 64, dtype=dtype, scale=0.5).requires_grad_()
        k, v = (randn(g, 2, 2, nd + L, 64, dtype=dtype).requires_grad_() for _ in range(2))
        bias = randn(g, 2, 2, nd + L)
        bias[:, :, 7] = float("-inf")
        do = randn(g, 2, 8, M, 64, dtype=dtype)
        ref = chunk_attention_ref(q.double(), k.double(), v.double(), bias, nd, qo)
        gr = torch.autograd.grad(ref, (q, k, v), do.double())
        out = chunk_attention_triton(q, k, v, bias, nd, qo)
        go = torch.autograd.grad(out, (q, k, v), do)
        emit("ovq", f"chunk_attention_{name}", fwd=rel(out, ref), dq=rel(go[0], gr[0]), dk=rel(go[1], gr[1]),
             dv=rel(go[2], gr[2]))
        q, k, v = randn(g, 1, 8, S, 64, dtype=dtype), randn(g, 1, 2, S, 64, dtype=dtype), randn(g, 1, 2, S, 64, dtype=dtype)
        kw = dict(chunk_size=64, max_centroids=96, growth=32.0)
        with torch.no_grad():
            o_r, st_r, _, _ = ovq_attention(q, k, v, None, None, None, backend="torch", **kw)
            o_t, st_t, _, _ = ovq_attention(q, k, v, None, None, None, backend="triton", exact_assign=True, **kw)
        emit("ovq", f"fused_prefill_{name}", rel=rel(o_t, o_r), counts_equal=bool(torch.equal(st_t.counts, st_r.counts)))
    g = torch.Generator(device=DEV).manual_seed(5)
    q, k, v = (randn(g, 1, h, S, 64).requires_grad_() for h in (8, 2, 2))
    kw = dict(chunk_size=64, max_centroids=96, growth=32.0)
    o_t, *_ = ovq_attention(q, k, v, None, None, None, backend="triton", **kw)
    o_r, *_ = ovq_attention(q, k, v, None, None, None, backend="torch", **kw)
    do = torch.randn(o_r.shape, device=DEV, generator=g)
    gt = torch.autograd.grad(o_t, (q, k, v), do)
    gr = torch.autograd.grad(o_r, (q, k, v), do)
    emit("ovq", "train_path_float32", fwd=rel(o_t, o_r), dq=rel(gt[0], gr[0]), dk=rel(gt[1], gr[1]),
         dv=rel(gt[2], gr[2]))


FAMILIES = {"lolcats": check_lolcats, "lola": check_lola, "muse": check_muse, "ovq": check_ovq}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=",".join(FAMILIES), help="comma-separated families: " + ", ".join(FAMILIES))
    ap.add_argument("--seq", type=int, default=0, help="sequence length (default 300 on CUDA, 150 on the CPU)")
    args = ap.parse_args()
    if DEV == "cpu":  # before any kernel module is imported: bench_lola's CPU mode and the Triton interpreter
        os.environ.setdefault("BENCH_SMOKE", "1")
        os.environ.setdefault("TRITON_INTERPRET", "1")
    S = args.seq or (300 if DEV == "cuda" else 150)
    for fam in args.only.split(","):
        if fam not in FAMILIES:
            raise SystemExit(f"unknown family {fam!r}; choose from {', '.join(FAMILIES)}")
        FAMILIES[fam](S)


if __name__ == "__main__":
    main()
