"""benchmarks/ops/bench_hybrid_bwd.py's sweep without a GPU: every setting passed in turn (the others at their
defaults), its gradients checked against the defaults', the defaults left as they are, the fastest valid row picked.
The timer is replaced by one that reads the settings the kernels were given; the PyTorch path stands in for them."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")


def test_sweep_applies_each_setting_and_restores(monkeypatch):
    import triton.testing

    from benchmarks.ops import bench_hybrid_bwd as bench
    from longctx_patch.kernels.lola import reference as ref
    from longctx_patch.kernels.lola.tuning import DEFAULT_TUNING, LolaTuning

    given = []  # the tuning of each hybrid_attention call (its spec's)
    real = bench.ops.hybrid_attention
    monkeypatch.setattr(bench.ops, "hybrid_attention", lambda *a, **kw: given.append(a[7].tuning) or real(*a, **kw))
    seen = []
    keys = ("train_block_m", "train_block_n", "hybrid_num_warps", "hybrid_num_stages")

    def fake_bench(fn):  # "time" = a function of the settings passed, so the sweep's choice is known
        fn()
        t = given[-1]
        seen.append({k: getattr(t, k) for k in keys})
        return float(t.train_block_m + t.train_block_n + t.hybrid_num_warps - t.hybrid_num_stages)

    monkeypatch.setattr(triton.testing, "do_bench", fake_bench)
    g = torch.Generator().manual_seed(0)
    B, Hq, Hkv, S, D, F = 1, 2, 1, 24, 8, 4
    q, k, v = (torch.randn(B, h, S, D, generator=g) for h in (Hq, Hkv, Hkv))
    wq, wk = torch.randn(Hq, D, F, generator=g) * 0.3, torch.randn(Hq, D, F, generator=g) * 0.3
    fq, fk = ref.hedgehog_feature_map(q, wq), ref.hedgehog_feature_map(ref.expand_kv(k, Hq), wk)
    xs = [t.detach().requires_grad_(True) for t in (q, k, v, fq, fk, torch.rand(Hq, generator=g),
                                                     torch.rand(Hq, generator=g))]
    do = torch.randn(B, S, Hq, D, generator=g)
    rows, best = bench.sweep(xs, do, 8, D ** -0.5, bench.SWEEP_FWD, time_fwd=True)
    assert len(rows) == len(bench.SWEEP_FWD) == 16
    assert [{k: r[k] for k in s} for r, s in zip(rows, bench.SWEEP_FWD)] == bench.SWEEP_FWD
    assert all("fwd_ms" in r and r["max_rel_err_vs_default"] < 1e-6 for r in rows)
    assert seen[0] == bench.SWEEP_FWD[0] and len(seen) == 32  # forward alone, then forward + backward, per setting
    assert best == min(rows, key=lambda r: r["fwd_bwd_ms"])
    assert (best["train_block_m"], best["train_block_n"], best["hybrid_num_warps"], best["hybrid_num_stages"]) == (64, 32, 4, 2)
    assert given[0] == DEFAULT_TUNING == LolaTuning()  # the reference run: the defaults, which nothing changed
    rows, _ = bench.sweep(xs, do, 8, D ** -0.5)  # the backward's grid: no forward timing
    assert len(rows) == 36 and not any("fwd_ms" in r for r in rows) and DEFAULT_TUNING == LolaTuning()
