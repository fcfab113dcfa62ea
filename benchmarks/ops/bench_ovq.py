"""OVQ on the GPU: kernel checks against the PyTorch reference, prefill speed at 64k against SDPA
(cuDNN and flash backends), decode state bytes and decode step time from 4k to 128k, training-path speed.

    python3 -m benchmarks.ops.bench_ovq [--out DIR] [--quick]

Prints a short table last and writes speed-<gpu>.json under --out (default $OUT, else benchmarks/results/ovq/).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

from benchmarks.shared import device_token, results_dir
from longctx_patch.provenance import device_description, git_commit


def rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def bench(fn, rep=300, warmup=50) -> float:
    import triton.testing as tt

    if DEV != "cuda":
        fn()
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3

    return float(tt.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def graph_of(fn):
    """Capture fn in a CUDA graph (after a warm-up on a side stream); returns a replay closure."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


DEV = "cuda"


def inputs(B, Hq, H, S, D, dtype, seed, beta=12.0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = F.normalize(torch.randn(B, Hq, S, D, device=DEV, generator=g), dim=-1).mul(beta).to(dtype)
    k = F.normalize(torch.randn(B, H, S, D, device=DEV, generator=g), dim=-1).to(dtype)
    v = torch.randn(B, H, S, D, device=DEV, generator=g).to(dtype)
    return q, k, v


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT"), help="folder (default $OUT, else benchmarks/results/ovq)")
    ap.add_argument("--quick", action="store_true", help="smaller sizes (smoke run)")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="tiny sizes on the CPU under TRITON_INTERPRET=1 (checks the script, times nothing useful)")
    args = ap.parse_args()
    global DEV
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        DEV = "cpu"
        args.quick = True
    from longctx_patch.kernels.ovq import OvqKernelOptions, exact_causal_attention, ovq_attention
    from longctx_patch.kernels.ovq.reference import chunk_attention_ref
    from longctx_patch.kernels.ovq.ops import chunk_attention_triton

    small = args.cpu_smoke
    res = {"task": "ovq-speed",
           "device": device_description(DEV), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "commit": git_commit(), "command": "python3 -m benchmarks.ops.bench_ovq " + " ".join(sys.argv[1:]),
           "torch": torch.__version__}
    import triton
    res["triton"] = triton.__version__
    rows = []
    t0 = time.time()
    bf = torch.bfloat16

    # ---------------------------------------------------------------- 1. checks vs the reference
    checks = {}
    for dt in (torch.float32, bf):
        B, Hq, H, D, nd, L, M, qo = (2, 8, 2, 64, 300, 97, 61, 36) if not small else (1, 2, 1, 16, 40, 21, 13, 8)
        g = torch.Generator(device=DEV).manual_seed(1)
        q = (torch.randn(B, Hq, M, D, device=DEV, generator=g) * 0.5).to(dt).requires_grad_()
        k = torch.randn(B, H, nd + L, D, device=DEV, generator=g).to(dt).requires_grad_()
        v = torch.randn(B, H, nd + L, D, device=DEV, generator=g).to(dt).requires_grad_()
        bias = torch.randn(B, H, nd + L, device=DEV, generator=g)
        bias[:, :, 7] = float("-inf")
        do = torch.randn(B, Hq, M, D, device=DEV, generator=g).to(dt)
        ref = chunk_attention_ref(q.double(), k.double(), v.double(), bias, nd, qo)
        gr = torch.autograd.grad(ref, (q, k, v), do.double())
        out = chunk_attention_triton(q, k, v, bias, nd, qo)
        go = torch.autograd.grad(out, (q, k, v), do)
        name = "fp32" if dt == torch.float32 else "bf16"
        checks[f"chunk_attn_{name}"] = {"o": rel(out, ref), "dq": rel(go[0], gr[0]), "dk": rel(go[1], gr[1]),
                                        "dv": rel(go[2], gr[2])}
    # fused no-grad path vs reference (exact assignment so that the dictionaries must agree);
    # 128 rows per program: several programs split the dictionary of every chunk
    split = OvqKernelOptions(split_rows=128 if not small else 16)
    for dt in (torch.float32, bf):
        B, Hq, H, S, D = (1, 8, 4, 4096 + 77, 64) if not small else (1, 2, 1, 150, 16)
        q, k, v = inputs(B, Hq, H, S, D, dt, seed=2)
        valid = torch.ones(B, S, dtype=torch.bool, device=DEV)
        kw = dict(chunk_size=256, max_centroids=512, growth=128.0) if not small else dict(
            chunk_size=32, max_centroids=40, growth=16.0)
        with torch.no_grad():
            o_ref, st_ref, _, _ = ovq_attention(q, k, v, None, None, valid, backend="torch", **kw)
            o_f, st_f, _, _ = ovq_attention(q, k, v, None, None, valid, backend="triton", exact_assign=True,
                                            options=split, **kw)
            o_fb, st_fb, _, _ = ovq_attention(q, k, v, None, None, valid, backend="triton", exact_assign=False,
                                              options=split, **kw)
        name = "fp32" if dt == torch.float32 else "bf16"
        checks[f"fused_{name}"] = {
            "o_rel": rel(o_f, o_ref), "counts_equal": bool(torch.equal(st_f.counts, st_ref.counts)),
            "key_sums_rel": rel(st_f.key_sums, st_ref.key_sums),
            "o_rel_bf16_assign": rel(o_fb, o_ref),
            "counts_agree_bf16_assign": float((st_fb.counts == st_ref.counts).float().mean()),
        }
    # degenerate config == exact attention, fused path, bf16
    q, k, v = inputs(1, 8, 8, 2048 + 13, 64, bf, seed=3) if not small else inputs(1, 2, 2, 70, 16, bf, seed=3)
    with torch.no_grad():
        o_f, *_ = ovq_attention(q, k, v, None, None, None, chunk_size=128 if not small else 16, max_centroids=4096,
                                growth=0.0, backend="triton", options=split)
    checks["degenerate_vs_exact_bf16"] = rel(o_f, exact_causal_attention(q, k, v))
    # training path (autograd, Triton chunk attention) vs reference, fp32
    q, k, v = inputs(1, 8, 4, 1024 + 29, 64, torch.float32, seed=4) if not small else inputs(
        1, 2, 1, 70, 16, torch.float32, seed=4)
    q, k, v = q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    kw = dict(chunk_size=128, max_centroids=256, growth=64.0) if not small else dict(
        chunk_size=16, max_centroids=24, growth=8.0)
    o_t, *_ = ovq_attention(q, k, v, None, None, None, backend="triton", **kw)
    o_r, *_ = ovq_attention(q, k, v, None, None, None, backend="torch", **kw)
    do = torch.randn_like(o_r)
    gt = torch.autograd.grad(o_t, (q, k, v), do)
    gr = torch.autograd.grad(o_r, (q, k, v), do)
    checks["train_path_fp32"] = {"o": rel(o_t, o_r), "dq": rel(gt[0], gr[0]), "dk": rel(gt[1], gr[1]),
                                 "dv": rel(gt[2], gr[2])}
    res["checks"] = checks
    path = results_dir("ovq", args.out) / f"speed-{device_token()}.json"

    def dump():
        with open(path, "w") as f:
            json.dump(res, f, indent=1)

    dump()
    print("checks", json.dumps(checks, indent=1), flush=True)
    print(f"[{time.time() - t0:.0f}s] checks done", flush=True)

    # ---------------------------------------------------------------- 2. prefill at 64k
    from torch.nn.attention import SDPBackend, sdpa_kernel

    S = 16384 if args.quick else 65536
    B, Hq, H, D, N = 1, 32, 32, 64, 4096
    if small:
        S, Hq, H, D, N = 512, 2, 2, 16, 64
    q, k, v = inputs(B, Hq, H, S, D, bf, seed=5)
    base = {}
    for name, be in (("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_flash", SDPBackend.FLASH_ATTENTION)):
        try:
            with sdpa_kernel(be):
                fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
                fn()
                base[name] = bench(fn)
        except Exception as e:  # a backend may be unavailable
            base[name] = None
            print(f"{name} failed: {type(e).__name__}: {e}", flush=True)
    if all(x is None for x in base.values()):
        base["sdpa_math"] = bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    best_exact = min(x for x in base.values() if x is not None)
    flops_exact = 4 * B * Hq * S * S * D / 2
    prefill = {"S": S, "B": B, "Hq": Hq, "Hkv": H, "D": D, "max_centroids": N, "dtype": "bf16",
               **{k_: v_ for k_, v_ in base.items()},
               "sdpa_tflops": {k_: (flops_exact / (v_ * 1e-3) / 1e12 if v_ else None) for k_, v_ in base.items()},
               "ovq": []}
    print(f"[{time.time() - t0:.0f}s] sdpa {base}", flush=True)
    # (chunk size, growth, query block, dictionary rows per program)
    configs = [(256, 1024.0, 128, 512), (512, 1024.0, 128, 512), (512, 1024.0, 128, 256),
               (1024, 1024.0, 128, 512), (512, 2048.0, 128, 512), (512, 256.0, 128, 512)]
    if small:
        configs = [(64, 32.0, 128, 16)]
    for C, growth, bm, rows in configs:
        kw = dict(chunk_size=C, max_centroids=N, growth=growth, backend="triton", exact_assign=False,
                  options=OvqKernelOptions(block_m=bm, split_rows=rows))

        def run():
            with torch.no_grad():
                return ovq_attention(q, k, v, None, None, None, **kw)

        o, st, _, _ = run()
        eager = bench(run, rep=200, warmup=20)
        graphed = None
        if DEV == "cuda":
            try:
                rep = graph_of(run)
                graphed = bench(rep, rep=200, warmup=20)
            except Exception as e:
                print(f"graph capture failed: {type(e).__name__}: {e}", flush=True)
        t_best = min(x for x in (eager, graphed) if x is not None)
        n_final = int(st.n_active[0])
        # mean number of dictionary rows the chunks attended to (drives the cost)
        from longctx_patch.kernels.ovq import target_int
        mean_rows = sum(target_int(s0, N, growth) for s0 in range(0, S, C)) / (S // C)
        ent = {"chunk_size": C, "growth": growth, "block_m": bm, "split_rows": rows, "eager_ms": eager, "graph_ms": graphed,
               "speedup_vs_best_exact": best_exact / t_best, "final_rows": n_final, "mean_rows": mean_rows}
        prefill["ovq"].append(ent)
        print(f"[{time.time() - t0:.0f}s] ovq {ent}", flush=True)
        res["prefill"] = prefill
        dump()
        if (C, growth, bm, rows) == ((512, 1024.0, 128, 512) if not small else (64, 32.0, 128, 16)):
            # one more chunk on the state left by the prefill (all rows in use): attention alone (C-1
            # tokens, nothing absorbed) and attention + statistics + absorb (C tokens)
            seen_b = S
            qx, kx, vx = q[:, :, :C], k[:, :, :C], v[:, :, :C]

            def one(n):
                with torch.no_grad():
                    return ovq_attention(qx[:, :, :n], kx[:, :, :n], vx[:, :, :n], st, None, None,
                                         seen_bound=seen_b, **kw)

            def timed(n):
                if DEV == "cuda":
                    return bench(graph_of(lambda: one(n)))
                return bench(lambda: one(n))

            prefill["chunk_breakdown"] = {"rows": int(st.n_active[0]), "attn_only_ms": timed(C - 1),
                                          "attn_stats_absorb_ms": timed(C)}
            print("breakdown", prefill["chunk_breakdown"], flush=True)
        del o, st
    res["prefill"] = prefill

    # ---------------------------------------------------------------- 3. decode state and step time
    C, growth = (512, 1024.0) if not small else (64, 32.0)
    kw = dict(chunk_size=C, max_centroids=N, growth=growth, backend="triton", exact_assign=False)
    dec = []
    lens = [4096, 16384] if args.quick else [4096, 16384, 65536, 131072]
    Hd = 32
    if small:
        lens, Hd = [128, 256], 2
    for Lc in lens:
        qd, kd, vd = inputs(1, Hd, Hd, Lc + 1, D, bf, seed=Lc)
        with torch.no_grad():
            _, st, op, sb = ovq_attention(qd[:, :, :Lc], kd[:, :, :Lc], vd[:, :, :Lc], None, None, None, **kw)
        state_bytes = st.nbytes() + (op.keys.numel() * op.keys.element_size() * 2 + op.valid.numel()
                                     if op is not None else 0)
        assert op is None  # Lc is a multiple of C: the timed token opens a chunk and absorbs nothing

        def step():
            with torch.no_grad():
                return ovq_attention(qd[:, :, Lc:], kd[:, :, Lc:], vd[:, :, Lc:], st, op, None, seen_bound=sb, **kw)

        step_ms = bench(step, rep=100, warmup=10)
        kv_bytes = 2 * Hd * Lc * D * 2
        ent = {"context": Lc, "state_bytes": state_bytes, "full_kv_bytes_bf16": kv_bytes, "rows": int(st.n_active[0]),
               "step_ms": step_ms}
        dec.append(ent)
        print(f"[{time.time() - t0:.0f}s] decode {ent}", flush=True)
        res["decode"] = {"points": dec}
        dump()
        del qd, kd, vd, st, op
    res["decode"] = {"Hkv": Hd, "D": D, "max_centroids": N, "chunk_size": C, "growth": growth, "points": dec}

    # ---------------------------------------------------------------- 4. training path fwd+bwd
    if not args.quick and DEV == "cuda":
        Bt, Hqt, Ht, St = 1, 32, 8, 8192
        q, k, v = inputs(Bt, Hqt, Ht, St, D, bf, seed=9)
        q, k, v = q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
        do = torch.randn(Bt, Hqt, St, D, device=DEV, dtype=bf)
        train = {"S": St, "Hq": Hqt, "Hkv": Ht, "D": D, "chunk_size": 256, "max_centroids": 1024, "growth": 256.0}
        for be in ("triton", "torch"):
            kw = dict(chunk_size=256, max_centroids=1024, growth=256.0, backend=be, exact_assign=False)

            def fb():
                o, *_ = ovq_attention(q, k, v, None, None, None, **kw)
                torch.autograd.grad(o, (q, k, v), do)

            train[f"ovq_{be}_fwd_bwd_ms"] = bench(fb, rep=300, warmup=30)
        kr, vr = k.repeat_interleave(4, 1).detach().requires_grad_(), v.repeat_interleave(4, 1).detach().requires_grad_()

        def fb_sdpa():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                o = F.scaled_dot_product_attention(q, kr, vr, is_causal=True)
            torch.autograd.grad(o, (q, kr, vr), do)

        train["sdpa_flash_fwd_bwd_ms"] = bench(fb_sdpa)
        res["train"] = train
        print(f"[{time.time() - t0:.0f}s] train {train}", flush=True)

    dump()
    # ---------------------------------------------------------------- table
    print("\n== OVQ prefill, S=%d, %d heads, D=%d, N=%d, bf16 ==" % (S, Hq, D, N))
    for k_, v_ in base.items():
        print(f"  {k_:<22} {v_ if v_ is None else round(v_, 3)} ms")
    for e in prefill["ovq"]:
        print(f"  ovq C={e['chunk_size']:<5} g={e['growth']:<7} BM={e['block_m']:<4} R={e['split_rows']:<4} eager {e['eager_ms']:.3f} ms  graph "
              f"{e['graph_ms'] if e['graph_ms'] is None else round(e['graph_ms'], 3)} ms  x{e['speedup_vs_best_exact']:.2f}"
              f"  rows {e['final_rows']} (mean {e['mean_rows']:.0f})")
    print("== decode state ==")
    for e in dec:
        print(f"  ctx {e['context']:>7}  state {e['state_bytes'] / 2**20:.2f} MiB  (full KV {e['full_kv_bytes_bf16'] / 2**20:.0f} MiB)"
              f"  step {e['step_ms']:.3f} ms")
    if "train" in res:
        print("== train fwd+bwd ==", {k_: (round(v_, 3) if isinstance(v_, float) else v_) for k_, v_ in res["train"].items()})
    print("wrote", path)


if __name__ == "__main__":
    main()
