"""LoLCATs / LoLA kernels on a CUDA GPU: correctness against the PyTorch references, prefill and decode speed.

    python3 -m benchmarks.ops.bench_lola            # writes $OUT/speed-<gpu>.json (or benchmarks/results/lola/)

Sections (each guarded by a time budget, the JSON is rewritten after each one):
  check    Triton vs PyTorch reference (fp32 and bf16): ||out - ref|| / ||ref||
  prefill  32k tokens, 32 query heads (8 kv heads), D = 64 / 128, feature_dim 64:
           lolcats (lambda = 0, one parallel pass), lola (eta = lambda = 256: the two-pass prefill with its
           evictions replayed from a CUDA graph or eager, the chunk loop it replaces, pass 1 alone; sparse cache
           per kv head, and per query head for comparison), SDPA cuDNN / flash full causal attention, flex-attention sliding window, fla chunk_linear_attn
  profile  GPU time per kernel of one 32k two-pass lola prefill (evictions eager, 32/8 heads, D = 64, chunk 256/1024)
  tune     pass 1 of the two-pass lola prefill (the evictions) with tiles, warps, SRE precision varied
  decode   batch 64, 32k context, D = 128: one LoLA decode step (+ the amortised eviction) vs SDPA over a full
           KV cache; cache bytes; peak memory of decoding after 4k / 32k / 128k-token prefills (batch 1)
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
import traceback

import torch

from benchmarks.shared import device_token, results_dir
from longctx_patch.provenance import device_description, git_commit

SMOKE = os.environ.get("BENCH_SMOKE") == "1"  # tiny shapes on the CPU (TRITON_INTERPRET=1): checks the script only
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")
T0 = time.time()
BUDGET = float(os.environ.get("BENCH_BUDGET_S", "215"))
OUT = os.environ.get("OUT") or ("/tmp/bench_lola_smoke" if SMOKE else None)  # None: the results' lola/ folder
RES: dict = {
    "task": "lola-speed",
    "device": device_description(),
    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    "command": " ".join(f"{k}={os.environ[k]}" for k in ("BENCH_ONLY", "BENCH_BUDGET_S") if os.environ.get(k))
               + " python3 -m benchmarks.ops.bench_lola",
    "torch": torch.__version__,
}
RES["commit"] = git_commit()  # $LONGCTX_COMMIT on a copy of the tree, else git
ROWS: list[tuple[str, str]] = []


def left() -> float:
    return BUDGET - (time.time() - T0)


def save() -> None:
    RES["elapsed_s"] = round(time.time() - T0, 1)
    with open(results_dir("lola", OUT) / f"speed-{device_token()}.json", "w") as f:
        json.dump(RES, f, indent=2)


def row(name: str, value: str) -> None:
    ROWS.append((name, value))
    print(f"{name:<58} {value}", flush=True)


def section(name: str, need_s: float):
    def deco(fn):
        def run():
            only = os.environ.get("BENCH_ONLY")
            if only and name not in only.split(","):
                return
            if left() < need_s:
                RES.setdefault("skipped", []).append(f"{name} (time budget)")
                print(f"skip {name}: {left():.0f}s left", flush=True)
                return
            t = time.time()
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - record and go on with the other sections
                RES.setdefault("errors", {})[name] = f"{type(e).__name__}: {e}"
                traceback.print_exc()
            RES.setdefault("section_s", {})[name] = round(time.time() - t, 1)
            save()
        return run
    return deco


def bench(fn, rep=200):
    from triton.testing import do_bench

    if SMOKE:
        t = time.time()
        fn()
        return (time.time() - t) * 1e3
    return do_bench(fn, warmup=20, rep=rep, return_mode="median")


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# ----------------------------------------------------------------------------------------------------------------
from longctx_patch.kernels.lola import reference as ref  # noqa: E402
from longctx_patch.kernels.lola import triton_kernels as tk  # noqa: E402
from longctx_patch.kernels.lola import (HybridSpec, LolaRun, LolaState, StateSizes, hybrid_attention,  # noqa: E402
                                        lola_evict, lola_process)
from longctx_patch.kernels.lola.tuning import DEFAULT_TUNING, LolaTuning  # noqa: E402

DEV = "cpu" if SMOKE else "cuda"


def sz(n: int, small: int) -> int:
    return small if SMOKE else n


def make(B, Hq, Hkv, S, D, F, dtype, seed=0, N=None):
    g = torch.Generator(device=DEV).manual_seed(seed)
    N = S if N is None else N
    q = torch.randn(B, Hq, S, D, device=DEV, generator=g).to(dtype)
    k = torch.randn(B, Hkv, N, D, device=DEV, generator=g).to(dtype)
    v = torch.randn(B, Hkv, N, D, device=DEV, generator=g).to(dtype)
    Wq = torch.randn(Hq, D, F, device=DEV, generator=g) * D ** -0.25
    Wk = torch.randn(Hq, D, F, device=DEV, generator=g) * D ** -0.25
    fq = ref.hedgehog_feature_map(q, Wq, out_dtype=dtype)
    fk = ref.hedgehog_feature_map(k, Wk, out_dtype=dtype)
    gw = torch.sigmoid(torch.randn(Hq, device=DEV, generator=g))
    return q, k, v, fq, fk, gw, torch.ones(Hq, device=DEV), Wq, Wk


@section("check", 30)
def check():
    out = {}
    for dtype, D in ((torch.float32, 64), (torch.bfloat16, 64), (torch.bfloat16, 128)):
        dn = str(dtype).split(".")[-1]
        if True:
            S0 = sz(777, 77)
            q, k, v, fq, fk, g, lf, _, Wk = make(2, 8, 2, S0, D, 32, dtype, seed=D)
            km = torch.ones(2, S0, dtype=torch.bool, device=DEV)
            km[1, :50] = False
            want = ref.hybrid_attention_quadratic(q, k, v, fq, fk, g, lf, HybridSpec(window=64), key_mask=km)
            want = want.transpose(1, 2)
            got = hybrid_attention(q, k, v, fq, fk, g, lf, HybridSpec(window=64, scale=D ** -0.5, backend="triton"),
                                   key_mask=km)
            real = km[:, :, None, None].expand_as(got)
            if SMOKE and D == 128:
                continue
            out[f"lolcats_prefill_{dn}_D{D}"] = rel(got[real], want[real])
            Wt = (torch.randn(8, D, 32, device=DEV) * 0.3).to(dtype)
            out[f"feature_map_{dn}_D{D}"] = rel(tk.feature_map(q, Wt, out_dtype=torch.float32),
                                                ref.hedgehog_feature_map(q, Wt, out_dtype=torch.float32))
            # LoLA manager: triton vs torch, prefill that ends mid-chunk, then decode steps
            res = {}
            phi_k = lambda x: ref.hedgehog_feature_map(x, Wk, out_dtype=dtype)  # noqa: E731
            for backend in ("torch", "triton"):
                st = LolaState.empty(StateSizes(2, 8, 2, D, 64, 16), dtype, DEV)
                run = LolaRun(phi_k=phi_k, window=32, chunk=64, lam=16, scale=D ** -0.5, backend=backend)
                o1 = lola_process(st, q, k, v, fq, g, lf, run, key_mask_new=km)
                n2 = sz(60, 5)
                q2, k2, v2, fq2, fk2, *_ = make(2, 8, 2, n2, D, 32, dtype, seed=D + 1)
                steps = [lola_process(st, q2[:, :, i:i + 1], k2[:, :, i:i + 1], v2[:, :, i:i + 1],
                                      fq2[:, :, i:i + 1], g, lf, run) for i in range(n2)]
                res[backend] = (o1, torch.cat(steps, 1), st)
            out[f"lola_prefill_{dn}_D{D}"] = rel(res["triton"][0][real], res["torch"][0][real])
            out[f"lola_decode_{dn}_D{D}"] = rel(res["triton"][1], res["torch"][1])
            out[f"lola_state_H_{dn}_D{D}"] = rel(res["triton"][2].H, res["torch"][2].H)
            out[f"lola_sparse_same_{dn}_D{D}"] = float(
                (res["triton"][2].sp_k == res["torch"][2].sp_k).all(-1).float().mean())
    RES["check_rel_err"] = out
    for kk, vv in out.items():
        row(f"check {kk}", f"{vv:.2e}")
    # CUDA-graph prefill == eager chunks (same kernels): 4096 tokens, chunk 256
    q, k, v, fq, fk, g, lf, _, Wk = make(1, 32, 8, sz(4096, 300), 128, 64, torch.bfloat16, seed=11)
    Wk16 = Wk.to(torch.bfloat16)
    for par in (True, False):  # the two-pass prefill's eviction graph, and the chunk loop's per-chunk graph
        res = []
        for graph in (False, True):
            st = LolaState.empty(StateSizes(1, 32, 8, 128, 128, 256), torch.bfloat16, DEV)
            run = LolaRun(phi_k=lambda x: tk.feature_map(x, Wk16), window=256, chunk=256, lam=256,
                          scale=128 ** -0.5, backend="triton",
                          tuning=LolaTuning(parallel_prefill=par, graph_prefill=graph))
            res.append((lola_process(st, q, k, v, fq, g, lf, run), st))
        tag = "" if par else "_chunk_loop"
        out[f"graph_vs_eager{tag}_out"] = rel(res[1][0], res[0][0])
        out[f"graph_vs_eager{tag}_H"] = rel(res[1][1].H, res[0][1].H)
        row(f"check graph_vs_eager{tag}_out", f"{out[f'graph_vs_eager{tag}_out']:.2e}")
        row(f"check graph_vs_eager{tag}_H", f"{out[f'graph_vs_eager{tag}_H']:.2e}")


def _prefill(D, label):
    B, Hq, Hkv, S, F = 1, sz(32, 4), sz(8, 2), sz(32768, 300), sz(64, 8)
    q, k, v, fq, fk, g, lf, Wq, Wk = make(B, Hq, Hkv, S, D, F, torch.bfloat16, seed=7)
    r = {}
    scale = D ** -0.5
    r["feature_maps_torch_ms"] = bench(lambda: (ref.hedgehog_feature_map(q, Wq, out_dtype=q.dtype),
                                                ref.hedgehog_feature_map(k, Wk, out_dtype=q.dtype)))
    Wq16, Wk16 = Wq.to(q.dtype), Wk.to(q.dtype)
    r["feature_maps_triton_ms"] = bench(lambda: (tk.feature_map(q, Wq16), tk.feature_map(k, Wk16)))
    for w, cs, nw in ((64, 64, None), (64, 256, None), (64, 256, 8), (256, 256, None), (256, 256, 8), (256, 512, 8)):
        r[f"lolcats_w{w}_cs{cs}_nw{nw or 'def'}_ms"] = bench(
            lambda: hybrid_attention(q, k, v, fq, fk, g, lf, HybridSpec(window=w, scale=scale, backend="triton",
                                                                        state_chunk=cs,
                                                                        tuning=LolaTuning(hybrid_num_warps=nw))))
    st_ = tk.chunk_states(fk, v, 256)
    r["chunk_states_cs256_ms"] = bench(lambda: tk.chunk_states(fk, v, 256))
    keys = ref.HybridKeys(k, v, fk, st_[0], st_[1], q_offset=0, state_chunk=256)
    r["hybrid_fwd_only_w256_cs256_ms"] = bench(lambda: tk.hybrid_fwd(q, fq, keys, ref.HybridRule(256, g, lf, scale)))
    del st_, keys

    # two-pass prefill (all evictions, then all chunks at once; evictions replayed from a CUDA graph or eager)
    # and the chunk loop it replaces (CUDA graph per chunk)
    for chunk in (256, 1024):
        def lola_once(chunk=chunk, tuning=DEFAULT_TUNING):
            st = LolaState.empty(StateSizes(B, Hq, Hkv, D, 2 * F, 256), q.dtype, DEV)
            run = LolaRun(phi_k=lambda x: tk.feature_map(x, Wk16), window=256, chunk=chunk, lam=256, scale=scale,
                          backend="triton", tuning=tuning)
            return lola_process(st, q, k, v, fq, g, lf, run)

        for mode in ("parallel", "parallel_eager", "loop_graph"):
            tuning = LolaTuning(parallel_prefill=mode.startswith("parallel"), graph_prefill=mode != "parallel_eager")
            r[f"lola_eta256_lam256_chunk{chunk}_{mode}_ms"] = bench(lambda: lola_once(chunk, tuning), rep=300)
        # pass 1 alone: the evictions
        fk_all = tk.feature_map(k, Wk16)

        def pass1(chunk=chunk):
            ev = tk.PrefillEvictions(fk_all, v, None, tk.EvictionPlan(window=256, chunk=chunk, lam=256,
                                                                      sparse_heads=Hkv, n_ev=S // chunk))
            ev.run()
            return ev
        r[f"lola_chunk{chunk}_pass1_evictions_ms"] = bench(pass1, rep=100)
        # its parts: the buffers and the range sums alone; the graph replays alone (counter reset, so the
        # replays redo evictions 0 .. n_ev - 2 on stale slots: the timing, not the values, is what counts)
        r[f"lola_chunk{chunk}_pass1_construct_ms"] = bench(
            lambda: tk.PrefillEvictions(fk_all, v, None, tk.EvictionPlan(window=256, chunk=chunk, lam=256,
                                                                         sparse_heads=Hkv, n_ev=S // chunk)),
            rep=100)
        ev1 = pass1()
        if getattr(ev1, "graph", None) is not None:
            def replays(ev1=ev1):
                ev1.cnt.zero_()
                for _ in range(ev1.n_ev - 1):
                    ev1.graph.replay()
            r[f"lola_chunk{chunk}_pass1_replays_only_ms"] = bench(replays, rep=100)
        del ev1
        # host syncs inside a prefill (each one idles the GPU until the host catches up)
        if not SMOKE:
            import warnings
            torch.cuda.set_sync_debug_mode(1)
            try:
                with warnings.catch_warnings(record=True) as wl:
                    warnings.simplefilter("always")
                    lola_once(chunk)
                    torch.cuda.synchronize()
            finally:
                torch.cuda.set_sync_debug_mode(0)
            r[f"lola_chunk{chunk}_host_syncs"] = [str(w.message)[:160] for w in wl][:8]
        del fk_all

    def lola_query_heads():  # the per-query-head sparse cache (sparse_heads=query), for comparison
        st = LolaState.empty(StateSizes(B, Hq, Hkv, D, 2 * F, 256, sparse_heads=Hq), q.dtype, DEV)
        run = LolaRun(phi_k=lambda x: tk.feature_map(x, Wk16), window=256, chunk=256, lam=256, scale=scale,
                      backend="triton")
        return lola_process(st, q, k, v, fq, g, lf, run)
    r["lola_eta256_lam256_chunk256_graph_query_heads_ms"] = bench(lola_query_heads, rep=300)
    # exact baselines: full causal attention (kv heads expanded for the backends without GQA)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as Fn

    kx, vx = k.repeat_interleave(Hq // Hkv, 1), v.repeat_interleave(Hq // Hkv, 1)
    for name, be in (("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_flash", SDPBackend.FLASH_ATTENTION)):
        try:
            def f(be=be):
                with sdpa_kernel(be):
                    return Fn.scaled_dot_product_attention(q, kx, vx, is_causal=True, scale=scale)
            r[f"{name}_full_ms"] = bench(f)
        except Exception as e:  # noqa: BLE001
            r[f"{name}_error"] = f"{type(e).__name__}: {e}"
    RES[f"prefill_32k_{label}"] = r
    save()
    # flex attention sliding window 256 and fla chunk_linear_attn (the parts of a hybrid done by two libraries)
    if left() > 45 and not SMOKE:
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            def sw(b, h, qi, ki):
                return (qi >= ki) & (qi - ki < 256)

            bm = create_block_mask(sw, None, None, S, S, device=DEV)
            flex = torch.compile(flex_attention)
            r["flex_sliding256_ms"] = bench(lambda: flex(q, kx, vx, block_mask=bm, scale=scale))
        except Exception as e:  # noqa: BLE001
            r["flex_error"] = f"{type(e).__name__}: {e}"
    if left() > 40:
        try:
            from fla.ops.linear_attn import chunk_linear_attn

            qf, kf, vf = fq.transpose(1, 2).contiguous(), fk.transpose(1, 2).contiguous(), vx.transpose(1, 2).contiguous()
            r["fla_chunk_linear_attn_ms"] = bench(lambda: chunk_linear_attn(qf, kf, vf, scale=1.0, normalize=True))
        except Exception as e:  # noqa: BLE001
            r["fla_error"] = f"{type(e).__name__}: {e}"
    RES[f"prefill_32k_{label}"] = r
    for kk, vv in r.items():
        row(f"prefill32k {label} {kk}", f"{vv:.3f}" if isinstance(vv, float) else str(vv)[:60])


@section("prefill_D128", 60)
def prefill128():
    _prefill(128, "D128")


@section("prefill_D64", 50)
def prefill64():
    _prefill(64, "D64")


@section("decode", 30)
def decode():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as Fn

    B, Hq, Hkv, D, F, N = sz(64, 2), sz(32, 4), sz(8, 2), sz(128, 16), sz(64, 8), sz(32768, 512)
    eta = lam = chunk = sz(256, 16)
    G = Hq // Hkv
    dt = torch.bfloat16
    r = {}
    # full KV cache decode: G query rows per kv head (exact GQA, no mask needed for the newest token)
    K = torch.randn(B, Hkv, N, D, device=DEV, dtype=dt)
    V = torch.randn(B, Hkv, N, D, device=DEV, dtype=dt)
    qd = torch.randn(B, Hkv, G, D, device=DEV, dtype=dt)
    best = None
    for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                     ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        try:
            def f(be=be):
                with sdpa_kernel(be):
                    return Fn.scaled_dot_product_attention(qd, K, V)
            t = bench(f)
            r[f"full_kv_sdpa_{name}_ms"] = t
            best = t if best is None else min(best, t)
        except Exception as e:  # noqa: BLE001
            r[f"full_kv_sdpa_{name}_error"] = f"{type(e).__name__}: {e}"
    full_bytes = 2 * B * Hkv * N * D * 2
    del K, V
    torch.cuda.empty_cache()
    # LoLA state in steady state: sparse cache full, window buffer holding eta + chunk/2 tokens
    st = LolaState.empty(StateSizes(B, Hq, Hkv, D, 2 * F, lam), dt, DEV, capacity=eta + chunk)
    st.win_k.normal_()
    st.win_v.normal_()
    st.sp_k.normal_()
    st.sp_v.normal_()
    st.sp_score = torch.rand(B, Hkv, lam, device=DEV)
    st.H = torch.rand(B, Hq, 2 * F, D, device=DEV) * 100
    st.s = torch.rand(B, Hq, 2 * F, device=DEV) * 100
    st.nb = eta + chunk // 2
    st.pos = N + chunk // 2
    g = torch.sigmoid(torch.randn(Hq, device=DEV))
    lf = torch.ones(Hq, device=DEV)
    q1 = torch.randn(B, Hq, 1, D, device=DEV, dtype=dt)
    k1 = torch.randn(B, Hkv, 1, D, device=DEV, dtype=dt)
    v1 = torch.randn(B, Hkv, 1, D, device=DEV, dtype=dt)
    fq1 = torch.softmax(torch.randn(B, Hq, 1, 2 * F, device=DEV), -1).to(dt)
    Wk = (torch.randn(Hq, D, F, device=DEV) * D ** -0.25).to(dt)
    phi_k = lambda x: tk.feature_map(x, Wk)  # noqa: E731
    run = LolaRun(phi_k=phi_k, window=eta, chunk=chunk, lam=lam, scale=D ** -0.5, backend="triton")
    state_bytes = st.nbytes()

    def step():
        st.nb = eta + chunk // 2  # stay mid-chunk: no eviction in this timing
        st.pos = N + chunk // 2
        return lola_process(st, q1, k1, v1, fq1, g, lf, run)

    r["lola_step_ms"] = bench(step)
    st.nb = eta + chunk // 2
    fk_lin = phi_k(st.win_k[:, :, : chunk // 2])  # the buffered keys older than the window
    keys = ref.HybridKeys(st.wk, st.wv, fk_lin, st.H, st.s, sparse=ref.SparseSet(st.sp_k, st.sp_v, st.sp_valid))
    r["lola_decode_kernel_ms"] = bench(lambda: tk.decode_step(q1, fq1, keys, ref.HybridRule(eta, g, lf, D ** -0.5)))
    H0, s0, spk, spv, sps = st.H.clone(), st.s.clone(), st.sp_k.clone(), st.sp_v.clone(), st.sp_score.clone()

    def evict():
        st.nb = eta + chunk
        st.H, st.s, st.sp_k, st.sp_v, st.sp_score = H0.clone(), s0.clone(), spk, spv, sps
        lola_evict(st, window=eta, lam=lam, phi_k=phi_k, backend="triton")

    r["lola_evict_ms"] = bench(evict)
    r["lola_per_token_ms"] = r["lola_step_ms"] + r["lola_evict_ms"] / chunk
    r["full_kv_best_ms"] = best
    r["tokens_per_s_lola_attention_layer"] = B / (r["lola_per_token_ms"] * 1e-3)
    if best:
        r["tokens_per_s_full_kv_attention_layer"] = B / (best * 1e-3)
        r["speedup_vs_full_kv"] = best / r["lola_per_token_ms"]
    r["cache_bytes_lola_per_layer"] = state_bytes
    r["cache_bytes_full_kv_per_layer"] = full_bytes
    r["cache_ratio_full_over_lola"] = full_bytes / state_bytes
    RES["decode_b64_32k_D128"] = r
    save()
    # peak memory of decoding after real prefills of 4k / 32k / 128k tokens (batch 1, one layer)
    mem = {}
    for ctx in ((4096, 32768, 131072) if not SMOKE else ()):
        if left() < 20:
            break
        q, k, v, fq, fk, g1, lf1, _, _ = make(1, Hq, Hkv, ctx, D, F, dt, seed=ctx)
        st = LolaState.empty(StateSizes(1, Hq, Hkv, D, 2 * F, lam), dt, DEV)
        t = time.time()
        lola_process(st, q, k, v, fq, g1, lf1, run)
        torch.cuda.synchronize()
        pre_s = time.time() - t
        del q, k, v, fq, fk
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        qs, ks, vs, fqs, fks, *_ = make(1, Hq, Hkv, 2 * chunk, D, F, dt, seed=1)
        for i in range(2 * chunk):  # crosses at least one eviction
            lola_process(st, qs[:, :, i:i + 1], ks[:, :, i:i + 1], vs[:, :, i:i + 1], fqs[:, :, i:i + 1],
                         g1, lf1, run)
        torch.cuda.synchronize()
        mem[str(ctx)] = {"state_bytes": st.nbytes(), "decode_peak_extra_bytes": torch.cuda.max_memory_allocated() - base,
                         "prefill_s_eager": round(pre_s, 3)}
        del st
    r["peak_memory_decode_batch1"] = mem
    RES["decode_b64_32k_D128"] = r
    for kk, vv in r.items():
        row(f"decode {kk}", f"{vv:.4g}" if isinstance(vv, float) else str(vv)[:90])


@section("profile", 20)
def profile():
    """GPU time per kernel of one 32k-token two-pass lola prefill (evictions eager, so every kernel is
    visible): where the prefill goes. D = 64, 32/8 heads, eta = lambda = 256, chunk 256 and 1024."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    B, Hq, Hkv, D, F, S = 1, sz(32, 4), sz(8, 2), 64, sz(64, 8), sz(32768, 640)
    q, k, v, fq, fk, g, lf, Wq, Wk = make(B, Hq, Hkv, S, D, F, torch.bfloat16, seed=3)
    Wk16 = Wk.to(q.dtype)
    for chunk in (sz(256, 32), sz(1024, 64)):
        run = LolaRun(phi_k=lambda x: tk.feature_map(x, Wk16), window=sz(256, 32), chunk=chunk, lam=sz(256, 32),
                      scale=D ** -0.5, backend="triton", tuning=LolaTuning(graph_prefill=False))  # evictions eager
        sizes = StateSizes(B, Hq, Hkv, D, 2 * F, run.lam)
        lola_process(LolaState.empty(sizes, q.dtype, DEV), q, k, v, fq, g, lf, run)
        torch.cuda.synchronize() if not SMOKE else None
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if not SMOKE else [])
        with tprofile(activities=acts) as prof:
            lola_process(LolaState.empty(sizes, q.dtype, DEV), q, k, v, fq, g, lf, run)
            torch.cuda.synchronize() if not SMOKE else None
        rows = []
        for e in prof.key_averages():
            dev_us = getattr(e, "device_time_total", None)
            if dev_us is None:
                dev_us = getattr(e, "cuda_time_total", 0)
            if dev_us and e.key and not e.key.startswith("aten::") and not e.key.startswith("cuda"):
                rows.append((e.key[:80], round(dev_us, 1), e.count))
        rows.sort(key=lambda r: -r[1])
        name = f"profile_lola_prefill32k_chunk{chunk}_D64"
        RES[name] = {
            "shape": f"B=1, {Hq}/{Hkv} heads, D=64, F2={2 * F}, S={S}, eta = lambda = 256, chunk {chunk}, "
                     "two-pass prefill, evictions eager",
            "kernels": sum(r[2] for r in rows),
            "gpu_us": round(sum(r[1] for r in rows), 1),
            "top": [{"kernel": n, "us": t, "launches": c} for n, t, c in rows[:25]],
        }
        row(f"profile chunk{chunk} kernels / GPU us", f"{RES[name]['kernels']} / {RES[name]['gpu_us']}")
        for n, t, c in rows[:10]:
            row(f"profile chunk{chunk} {n[:44]}", f"{t} us x{c}")


@section("tune", 40)
def tune():
    """Pass 1 of the two-pass lola prefill (the evictions, CUDA graph) at 32k, D = 64, 32/8 heads, with the
    tiles, warps and the SRE precision varied one at a time from the defaults; the sparse slots and the
    final state are compared with the defaults'. The defaults are chosen from this table."""
    out = {}
    B, Hq, Hkv, S, F, D = 1, sz(32, 4), sz(8, 2), sz(32768, 600), sz(64, 8), 64
    q, k, v, fq, fk, g, lf, Wq, Wk = make(B, Hq, Hkv, S, D, F, torch.bfloat16, seed=7)
    fk_all = tk.feature_map(k, Wk.to(q.dtype))
    # defaults: fp32-accurate SRE as three bf16 dots ("bf16x3"), score tile 128, fold tile 32 x 32 over 128
    # sparse slots, select with 8-bit digits (tl.histogram), 8 warps above 1024 candidates (4 below): each
    # variant moves one knob away from them
    variants = [{}, {"score_prec": "ieee"}, {"ev_score_bn": 64}, {"ev_score_stages": 1}, {"ev_score_warps": 8},
                {"ev_fold_bn": 64}, {"ev_select_bits": 4}, {"ev_select_warps": 4}, {"ev_select_warps": 16}]
    for chunk in (sz(1024, 64), sz(256, 32)):
        base = None
        for var in variants:
            if left() < 15:
                break
            tuning = DEFAULT_TUNING.replace(**var)
            name = f"chunk{chunk}_" + ("_".join(f"{a}={b}" for a, b in var.items()) or "default")
            try:
                def once(chunk=chunk, tuning=tuning):
                    plan = tk.EvictionPlan(window=sz(256, 32), chunk=chunk, lam=sz(256, 16), sparse_heads=Hkv,
                                           n_ev=S // chunk)
                    ev = tk.PrefillEvictions(fk_all, v, None, plan, tuning=tuning)
                    ev.run()
                    return ev
                ev = once()
                base = ev if base is None else base
                same = float((ev.SPIDX[-1].sort(-1).values == base.SPIDX[-1].sort(-1).values).float().mean())
                out[name] = {"ms": bench(once, rep=100), "H_rel_vs_default": rel(ev.H_all[-1], base.H_all[-1]),
                             "same_final_slots_vs_default": same}
                row(f"tune {name}", f"{out[name]['ms']:.3f} ms, slots same {same:.3f}")
            except Exception as e:  # noqa: BLE001
                out[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
                row(f"tune {name}", out[name]["error"][:60])
    RES["tune_lola_evictions_32k"] = out


def main():
    if not torch.cuda.is_available() and not SMOKE:
        print("bench_lola needs a CUDA GPU", file=sys.stderr)
        sys.exit(2)
    print(f"device {RES['device']}, torch {torch.__version__}", flush=True)
    check()
    profile()
    tune()
    prefill128()
    decode()
    prefill64()
    save()
    print("\n==== summary ====")
    for name, value in ROWS:
        print(f"{name:<58} {value}")


if __name__ == "__main__":
    main()
