"""Where the OVQ no-grad prefill spends its time: eager vs CUDA-graph time, host time to issue the
launches, and GPU time per kernel (torch.profiler), at 64k tokens, beside SDPA-cuDNN in the same run.

    python3 -m benchmarks.ops.bench_ovq_profile [--out FILE] [--seq 65536]

Writes a JSON with `device`, `date`, `commit`, `command` and one entry per configuration.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from collections import defaultdict

import torch
import torch.nn.functional as F

from benchmarks.shared import device_token, result_file
from longctx_patch.provenance import device_description, git_commit


def _cudnn_ms(q, k, v) -> float:
    import triton.testing as tt
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return tt.do_bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), return_mode="median")


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _checks() -> dict:
    """The fused path (runs of chunks replayed from a CUDA graph, and launched one by one) against the PyTorch
    reference: 4173 tokens, 8 query / 4 kv heads, batch 2 with left padding, exact float32 assignment."""
    from longctx_patch.kernels.ovq import OvqKernelOptions, ovq_attention

    g = torch.Generator(device="cuda").manual_seed(1)
    B, Hq, H, S, D = 2, 8, 4, 4173, 64
    q = F.normalize(torch.randn(B, Hq, S, D, device="cuda", generator=g), dim=-1).mul(12.0)
    k = F.normalize(torch.randn(B, H, S, D, device="cuda", generator=g), dim=-1)
    v = torch.randn(B, H, S, D, device="cuda", generator=g)
    valid = torch.ones(B, S, dtype=torch.bool, device="cuda")
    valid[1, :301] = False
    kw = dict(chunk_size=256, max_centroids=512, growth=128.0)
    out = {}
    with torch.no_grad():
        o_ref, st_ref, _, _ = ovq_attention(q, k, v, None, None, valid, backend="torch", **kw)
        for graphs in (True, False):
            o, st, _, _ = ovq_attention(q, k, v, None, None, valid, backend="triton", exact_assign=True,
                                        options=OvqKernelOptions(graph_runs=graphs), **kw)
            m = valid[:, None, :, None].expand_as(o)
            out["graph" if graphs else "eager"] = {"o_rel": _rel(o[m], o_ref[m]),
                                                   "counts_equal": bool(torch.equal(st.counts, st_ref.counts)),
                                                   "key_sums_rel": _rel(st.key_sums, st_ref.key_sums)}
        qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
        o_b, st_b, _, _ = ovq_attention(qb, kb, vb, None, None, valid, backend="triton", **kw)
        out["bf16_default_assign_o_rel"] = _rel(o_b[m].float(), o_ref[m])
        # the same with the dictionary read in its sum form
        o_s, st_s, _, _ = ovq_attention(qb, kb, vb, None, None, valid, backend="triton",
                                        options=OvqKernelOptions(mean_form=False), **kw)
        out["bf16_mean_form_vs_sum_form"] = {"o_rel": _rel(o_b[m].float(), o_s[m].float()),
                                             "counts_equal": bool(torch.equal(st_b.counts, st_s.counts))}
    return out


def variant_options(settings: dict[str, str]):
    """A variant's KEY=VALUE settings as the kernels' options (`OvqKernelOptions`; a ValueError names a key that is
    not one, or a value it does not take)."""
    from longctx_patch.kernels.ovq import OvqKernelOptions

    flags = ("graph_runs", "mean_form")
    return OvqKernelOptions().replace(**{k: bool(int(v)) if k in flags else int(v) for k, v in settings.items()})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="file (default benchmarks/results/ovq/profile-<gpu>.json)")
    ap.add_argument("--seq", type=int, default=65536)
    ap.add_argument("--configs", default="32/8:1024:256:512,32/32:4096:1024:512,32/32:4096:256:512",
                    help="comma-separated Hq/Hkv:max_centroids:growth:chunk_size")
    ap.add_argument("--variants", default="default",
                    help="semicolon-separated NAME[:KEY=VALUE,...]; KEY an option of the kernels passed to "
                         "ovq_attention as its `options` (kernels/ovq/options.OvqKernelOptions: block_m, block_n, "
                         "split_rows: ints; graph_runs, mean_form: 0/1)")
    args = ap.parse_args()
    import triton
    import triton.testing as tt
    from benchmarks.ops.bench_ovq import graph_of
    from longctx_patch.kernels.ovq import ovq_attention

    dev = "cuda"
    res = {"task": "ovq-profile",
           "device": device_description("cuda"), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"), "commit": git_commit(), "command": "python3 -m benchmarks.ops.bench_ovq_profile "
           + " ".join(sys.argv[1:]), "torch": torch.__version__, "triton": triton.__version__, "rows": []}
    res["checks"] = _checks()
    print("checks", json.dumps(res["checks"]), flush=True)
    S, D = args.seq, 64

    variants = []
    for item in args.variants.split(";"):
        name, _, kv = item.partition(":")
        variants.append((name, dict(x.split("=", 1) for x in kv.split(",") if x)))
    for spec, (vname, vset) in [(c, v) for c in args.configs.split(",") for v in variants]:
        heads, n, growth, c = spec.split(":")
        hq, hk = (int(x) for x in heads.split("/"))
        n, growth, c = int(n), float(growth), int(c)
        g = torch.Generator(device=dev).manual_seed(0)
        q = F.normalize(torch.randn(1, hq, S, D, device=dev, generator=g), dim=-1).mul(12.0).bfloat16()
        k = F.normalize(torch.randn(1, hk, S, D, device=dev, generator=g), dim=-1).bfloat16()
        v = torch.randn(1, hk, S, D, device=dev, generator=g).bfloat16()
        cudnn = _cudnn_ms(q, k.repeat_interleave(hq // hk, 1), v.repeat_interleave(hq // hk, 1))
        kw = dict(chunk_size=c, max_centroids=n, growth=growth, backend="triton", exact_assign=False,
                  options=variant_options(vset))

        def run():
            with torch.no_grad():
                return ovq_attention(q, k, v, None, None, None, **kw)

        run()
        torch.cuda.synchronize()
        eager = tt.do_bench(run, warmup=5, rep=100, return_mode="median")
        # host time to issue one prefill (the GPU queue is drained first)
        host = []
        for _ in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            run()
            host.append((time.perf_counter() - t0) * 1e3)
            torch.cuda.synchronize()
        replay = graph_of(run)  # the op captures no graph of its own inside a caller's capture
        graphed = tt.do_bench(replay, warmup=5, rep=100, return_mode="median")
        del replay
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize()
        per = defaultdict(lambda: [0.0, 0])
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                per[e.name][0] += e.device_time / 1e3
                per[e.name][1] += 1
        kernels = sorted(({"kernel": k_[:60], "ms": round(v_[0], 3), "count": v_[1]} for k_, v_ in per.items()),
                         key=lambda r: -r["ms"])
        row = {"variant": vname, "settings": vset, "Hq": hq, "Hkv": hk, "S": S, "D": D, "max_centroids": n,
               "growth": growth, "chunk_size": c,
               "cudnn_ms": cudnn, "eager_ms": eager, "graph_ms": graphed, "host_issue_ms": min(host),
               "gpu_kernel_ms": sum(r["ms"] for r in kernels), "kernels": kernels[:12],
               "speedup_eager": cudnn / eager, "speedup_graph": cudnn / graphed}
        res["rows"].append(row)
        print(json.dumps({k_: v_ for k_, v_ in row.items() if k_ != "kernels"}), flush=True)
        for r in kernels[:8]:
            print("   ", r, flush=True)
        with open(result_file("ovq", f"profile-{device_token()}.json", args.out), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
