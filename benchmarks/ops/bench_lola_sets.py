"""LoLA's training pass (`kernels/lola/training.lola_attention_sets`): the blocks linear in the length against the
masked pass over every earlier key (`dense=True`, their reference), forward + backward of one layer at the shapes
the Qwen2.5-Coder-0.5B tune runs (14 query / 2 kv heads, D 64, feature dim 64, window and sparse cache 1024, chunks
of 64, blocks of 1024; recipes/linearize-qwen-lola.yaml), bf16 inputs as autocast hands them.

Per length: the sparse sets chosen once (`sparse_positions`, timed on its own: the eviction kernels where they run,
and the PyTorch loop, checked to choose the same sets), then both passes' outputs and
gradients compared (relative error of each whole tensor against the dense pass) and each timed
(`triton.testing.do_bench` on CUDA, wall time on a CPU) with its peak memory.

    python3 -m benchmarks.ops.bench_lola_sets --out benchmarks/results/lola/train-sets-linear-qwen-h100.json
    python3 -m benchmarks.ops.bench_lola_sets --device cpu --lengths 512 --window 64 --sparse-cache 64 --block 128
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.shared import qwen_layer_arguments, timed_ms, write_bench_result
from longctx_patch.kernels.lola import reference as ref
from longctx_patch.kernels.lola.training import (PrefillSets, SetsSpec, evictions_kernels_run, lola_attention_sets,
                                                sparse_positions)


def inputs(S: int, a, dev: torch.device, seed: int = 0):
    g = torch.Generator(device=dev).manual_seed(seed)
    r = lambda *s: torch.randn(*s, device=dev, generator=g)  # noqa: E731
    dt = getattr(torch, a.dtype)
    q, k, v = r(1, a.heads, S, a.head_dim), r(1, a.kv_heads, S, a.head_dim), r(1, a.kv_heads, S, a.head_dim)
    wq, wk = r(a.heads, a.head_dim, a.feature_dim) * 0.3, r(a.heads, a.head_dim, a.feature_dim) * 0.3
    leaves = [t.to(dt).requires_grad_(True) for t in (q, k, v)] + [wq.requires_grad_(True), wk.requires_grad_(True)]
    gate = torch.sigmoid(r(a.heads))
    return leaves, gate


def step(leaves, gate, sets, a, dense: bool):
    """One forward + backward; returns the output and the leaves' gradients (fp32)."""
    q, k, v, wq, wk = leaves
    for t in leaves:
        t.grad = None
    fq = ref.hedgehog_feature_map(q.float(), wq)
    fk = ref.hedgehog_feature_map(ref.expand_kv(k.float(), a.heads), wk)
    spec = SetsSpec(window=a.window, chunk=a.chunk, scale=a.head_dim ** -0.5, combine=a.combine, block=a.block,
                    dense=dense)
    o = lola_attention_sets(q, k, v, fq, fk, gate, 1 - gate, PrefillSets(sets), spec)
    o.float().square().mean().backward()
    return o.detach().float(), [t.grad.detach().float() for t in leaves]


def rel(a, b) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def measure(S: int, a, dev: torch.device) -> dict:
    leaves, gate = inputs(S, a, dev)
    with torch.no_grad():
        fk = ref.hedgehog_feature_map(ref.expand_kv(leaves[1].float(), a.heads), leaves[4])
    choose = lambda kernels=None: sparse_positions(fk, leaves[2].float(), None, window=a.window,  # noqa: E731
                                                   chunk=a.chunk, lam=a.sparse_cache, sparse_heads=a.kv_heads,
                                                   kernels=kernels)
    sets = choose()
    loop = choose(False)
    row = {"seq_len": S, "sparse_positions_kernels": evictions_kernels_run(fk, leaves[2], window=a.window,
                                                                            chunk=a.chunk, lam=a.sparse_cache),
           "sparse_positions_ms": timed_ms(choose, dev, warmup=1, rep=1),
           "sparse_positions_loop_ms": timed_ms(lambda: choose(False), dev, warmup=1, rep=1),
           "sets_equal_loop": bool(torch.equal(sets.sort(-1).values, loop.sort(-1).values))}
    want, gwant = step(leaves, gate, sets, a, dense=True)
    got, ggot = step(leaves, gate, sets, a, dense=False)
    row["rel_err_vs_dense"] = {"out": rel(got, want), **{n: rel(x, y) for n, x, y in
                                                         zip(("q", "k", "v", "wq", "wk"), ggot, gwant)}}
    for name, dense in (("dense", True), ("linear", False)):
        if dev.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        row[f"{name}_fwd_bwd_ms"] = timed_ms(lambda: step(leaves, gate, sets, a, dense), dev, warmup=1, rep=1)
        if dev.type == "cuda":
            row[f"{name}_peak_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
    row["speedup"] = row["dense_fwd_bwd_ms"] / row["linear_fwd_bwd_ms"]
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    qwen_layer_arguments(p, "4096,16384,32768")
    p.add_argument("--feature-dim", type=int, default=64)
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--sparse-cache", type=int, default=1024)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--block", type=int, default=1024)
    p.add_argument("--combine", default="unshifted", choices=("shifted", "unshifted"))
    a = p.parse_args(argv)
    dev = torch.device(a.device)
    rows = []
    for S in (int(x) for x in a.lengths.split(",")):
        row = measure(S, a, dev)
        print(json.dumps(row), flush=True)
        rows.append(row)
    write_bench_result("lola", f"train-sets-linear-{a.device}.json", a.out, task="lola-train-sets",
                       module="benchmarks.ops.bench_lola_sets", argv=argv, device=a.device,
                       settings={k: v for k, v in vars(a).items() if k not in ("out", "lengths")}, rows=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
