"""OVQ training path on the GPU: the chunk-parallel path against the chunk-by-chunk loop and torch SDPA (flash)
forward+backward, plus a profile of one training step of the synthetic-benchmark model with the ovq mixer.

    python3 -m benchmarks.ops.bench_ovq_train [--out DIR]

Writes train-speed-<gpu>.json (device, date, commit, command) under --out (default $OUT, else benchmarks/results/ovq/).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks.shared import device_token, results_dir
from longctx_patch.evals.approx import relative_error as rel
from longctx_patch.provenance import device_description, git_commit
from longctx_patch.kernels.ovq import ovq_attention


def bench(fn) -> float:
    import triton.testing as tt

    return float(tt.do_bench(fn, warmup=10, rep=100, return_mode="median"))


def op_rows(shapes):
    rows = []
    for B, Hq, H, S, D, C, N, growth, exact in shapes:
        g = torch.Generator(device="cuda").manual_seed(S)
        q = (F.normalize(torch.randn(B, Hq, S, D, device="cuda", generator=g), dim=-1) * 8).bfloat16().requires_grad_()
        k = F.normalize(torch.randn(B, H, S, D, device="cuda", generator=g), dim=-1).bfloat16().requires_grad_()
        v = torch.randn(B, H, S, D, device="cuda", generator=g).bfloat16().requires_grad_()
        do = torch.randn(B, Hq, S, D, device="cuda", generator=g).bfloat16()
        row = {"B": B, "Hq": Hq, "Hkv": H, "S": S, "D": D, "chunk_size": C, "max_centroids": N, "growth": growth,
               "exact_assign": exact}
        outs = {}
        for name, par in (("parallel", True), ("loop", False)):
            kw = {"chunk_size": C, "max_centroids": N, "growth": growth, "backend": "triton", "exact_assign": exact,
                  "parallel": par}

            def fb(kw=kw):
                o, *_ = ovq_attention(q, k, v, None, None, None, **kw)
                return o, torch.autograd.grad(o, (q, k, v), do)

            outs[name] = fb()
            row[f"{name}_fwd_bwd_ms"] = bench(fb)
            torch.cuda.reset_peak_memory_stats()
            fb()
            row[f"{name}_peak_mib"] = torch.cuda.max_memory_allocated() / 2 ** 20
        (o_p, g_p), (o_l, g_l) = outs["parallel"], outs["loop"]
        row["parallel_vs_loop_rel_err"] = {"o": rel(o_p, o_l), "dq": rel(g_p[0], g_l[0]), "dk": rel(g_p[1], g_l[1]),
                                           "dv": rel(g_p[2], g_l[2])}
        kr = k.detach().repeat_interleave(Hq // H, 1).requires_grad_()
        vr = v.detach().repeat_interleave(Hq // H, 1).requires_grad_()

        def fb_sdpa():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                o = F.scaled_dot_product_attention(q, kr, vr, is_causal=True)
            torch.autograd.grad(o, (q, kr, vr), do)

        row["sdpa_flash_fwd_bwd_ms"] = bench(fb_sdpa)
        row["parallel_speedup_vs_loop"] = row["loop_fwd_bwd_ms"] / row["parallel_fwd_bwd_ms"]
        row["parallel_vs_flash"] = row["sdpa_flash_fwd_bwd_ms"] / row["parallel_fwd_bwd_ms"]
        print({k_: (round(v_, 3) if isinstance(v_, float) else v_) for k_, v_ in row.items()}, flush=True)
        rows.append(row)
        torch.cuda.empty_cache()
    return rows


def mixer_profile(L=4096):
    """One training step of the synthetic model (2 layers, d_model 128, 2 heads) at length L, ovq and softmax."""
    from torch.profiler import ProfilerActivity, profile

    from longctx_patch.evals import synthetic as M
    from longctx_patch.evals.synthetic.icr import IcrConfig, IcrTask

    task = IcrTask(IcrConfig())
    out = {}
    for spec_text in ("softmax", "ovq(max_centroids=448)"):
        spec = M.parse_mixer(spec_text)
        torch.manual_seed(0)
        model = M.SyntheticLM(task.vocab_size, task.feat_dim, task.out_dim, spec, M.ModelConfig()).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        batch = {k_: v_.cuda() for k_, v_ in task.sample(L, max(1, 8192 // L), 0).items()}

        def step():
            loss = task.loss(model(**task.model_inputs(batch)), batch)
            loss.backward()
            opt.step()
            opt.zero_grad()

        ms = bench(step)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                step()
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=15)
        cpu_table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=12)
        print(f"== {spec_text}: {ms:.2f} ms/step\n{table}\n{cpu_table}", flush=True)
        out[spec_text] = {"ms_per_step": ms, "profile_cuda": table, "profile_cpu": cpu_table}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT"), help="folder (default $OUT, else benchmarks/results/ovq)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs CUDA")
    # exact_assign: float32 (IEEE) assignment dot products, or bf16 ones (the ovq method's default)
    shapes = [(1, 32, 8, 8192, 64, 256, 1024, 256.0, False), (1, 32, 8, 8192, 64, 64, 1024, 256.0, False),
              (1, 32, 8, 8192, 64, 64, 1024, 256.0, True), (8, 9, 3, 2048, 64, 64, 1024, 256.0, False),
              (2, 2, 2, 4096, 64, 64, 448, 256.0, False), (2, 2, 2, 4096, 64, 64, 448, 256.0, True)]
    res = {"task": "ovq-train-speed", "device": device_description(torch.device("cuda")),
           "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
           "commit": git_commit(), "command": shlex.join(["python3", "-m", "benchmarks.ops.bench_ovq_train", *sys.argv[1:]]),
           "dtype": "bf16 inputs, fp32 dictionaries", "op": op_rows(shapes)}
    res["mixer_step"] = mixer_profile()
    path = results_dir("ovq", args.out) / f"train-speed-{device_token()}.json"
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
