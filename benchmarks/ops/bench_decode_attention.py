"""Exact attention with few queries (a decode step, a prefill's last queries) on a CUDA GPU: the package's
`softmax_attention` against the ways it could be written, in the same run.

Variants, all through torch SDPA (which picks its backend from the arguments and the allowed set):
- `package`: `longctx_patch.kernels.softmax.softmax_attention` as it is;
- three layouts, each with a mask only where one is needed (padding, or more than one query): `repeat` (the cache
  repeated G times along the head axis), `stacked` (a kv head's G query heads stacked on the query axis, the mask
  repeated G times) and `gqa` (SDPA's own `enable_gqa=True`);
- each layout twice: `auto` (SDPA free to pick, cuDNN included) and `nocudnn` (cuDNN's attention excluded).
Every variant is checked against an fp32 dense reference; times are `triton.testing.do_bench` medians. The decode
step reads the whole cache once, so its floor is the cache's bytes over the HBM bandwidth (`--hbm-tbs`, H200:
4.8 TB/s); the JSON gives each time's fraction of that floor.

`do_bench` repeats one shape. Generation does not: the cache grows by one key per step, so every step is a new
shape, and a backend that builds a plan per shape pays for it at every step. The second table (`growing`) times
`--steps` calls of each variant over a cache that grows by one key per call, each variant on its own range of
lengths so that no variant finds plans another one built.

    python3 -m benchmarks.ops.bench_decode_attention --out $OUT/decode-attention-h200.json
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import shlex
import sys
import time

import torch
import torch.nn.functional as F

from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks.shared import device_token, result_file
from longctx_patch.provenance import device_description, git_commit
from longctx_patch.kernels.softmax import attention_mask, softmax_attention


def without_cudnn(device):
    """SDPA's backends except cuDNN's attention on CUDA (the set the package's `softmax_attention` allows when
    cuDNN would build a plan per new shape); nothing to change elsewhere."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def _reference(q, k, v, scale, key_mask):
    G = q.shape[1] // k.shape[1]
    Sq, Sk = q.shape[2], k.shape[2]
    kk = k.float().repeat_interleave(G, 1)
    vv = v.float().repeat_interleave(G, 1)
    s = q.float() @ kk.transpose(-1, -2) * scale
    s = s.masked_fill(~attention_mask(Sq, Sk, device=q.device, key_mask=key_mask), float("-inf"))
    return (s.softmax(-1) @ vv).transpose(1, 2)


def variants(q, k, v, scale, key_mask):
    """Each variant builds its own mask, as the package does: the mask is part of what a call costs."""
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    G = Hq // Hkv
    needs_mask = key_mask is not None or Sq > 1

    def mask():
        return attention_mask(Sq, Sk, device=q.device, key_mask=key_mask) if needs_mask else None

    def repeat():
        o = F.scaled_dot_product_attention(q, k.repeat_interleave(G, 1), v.repeat_interleave(G, 1), attn_mask=mask(),
                                           scale=scale)
        return o.transpose(1, 2)

    def stacked():
        m = mask()
        m = None if m is None else m.repeat(1, 1, G, 1)
        o = F.scaled_dot_product_attention(q.reshape(B, Hkv, G * Sq, D), k, v, attn_mask=m, scale=scale)
        return o.reshape(B, Hq, Sq, D).transpose(1, 2)

    def gqa():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask(), scale=scale, enable_gqa=True).transpose(1, 2)

    def nocudnn(fn):
        def run():
            with without_cudnn(q.device):
                return fn()
        return run

    out = {"package": lambda: softmax_attention(q, k, v, scale=scale, key_mask=key_mask)}
    for name, fn in (("repeat", repeat), ("stacked", stacked), ("gqa", gqa)):
        out[f"{name}_auto"] = fn
        out[f"{name}_nocudnn"] = nocudnn(fn)
    return out


NAMES = ("package", "repeat_auto", "repeat_nocudnn", "stacked_auto", "stacked_nocudnn", "gqa_auto", "gqa_nocudnn")


def growing(D, B, Sq, padded, S0, steps, Hq, Hkv):
    """Mean ms per call of `steps` calls over a cache that grows by one key per call, for every variant (each on
    its own range of lengths: plans one variant built are never found by another)."""
    g = torch.Generator(device="cuda").manual_seed(S0 + D)
    span = steps + 8
    Smax = S0 + span * len(NAMES)
    kb = torch.randn(B, Hkv, Smax, D, device="cuda", dtype=torch.bfloat16, generator=g)
    vb = torch.randn_like(kb)
    q = torch.randn(B, Hq, Sq, D, device="cuda", dtype=torch.bfloat16, generator=g)
    km = None
    if padded:
        km = torch.ones(B, Smax, dtype=torch.bool, device="cuda")
        for b in range(B):
            km[b, : b * S0 // (2 * B)] = False
    res = {}
    for i, name in enumerate(NAMES):
        base = S0 + i * span

        def call(n):
            return variants(q, kb[:, :, :n], vb[:, :, :n], D ** -0.5, None if km is None else km[:, :n])[name]()

        call(base)  # warm-up: the first call of a variant (module loading), at a length outside the timed ones
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for t in range(1, steps + 1):
            call(base + t)
        torch.cuda.synchronize()
        res[name] = (time.perf_counter() - t0) / steps * 1e3
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="4096,16384,65536,131072", help="cache lengths (keys)")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--queries", default="1,128", help="queries per call: 1 = a decode step, 128 = exact_tail")
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--heads", default="32,8", help="query heads, kv heads")
    ap.add_argument("--steps", type=int, default=24, help="decode steps of the growing-cache table")
    ap.add_argument("--hbm-tbs", type=float, default=4.8, help="HBM bandwidth for the floor, TB/s")
    ap.add_argument("--out", default=None, help="file (default benchmarks/results/decode/attention-<gpu>.json)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    import triton

    Hq, Hkv = (int(x) for x in args.heads.split(","))
    dt = torch.bfloat16
    rows = []
    for D in (int(x) for x in args.head_dims.split(",")):
        for B in (int(x) for x in args.batches.split(",")):
            for Sk in (int(x) for x in args.contexts.split(",")):
                for Sq in (int(x) for x in args.queries.split(",")):
                    for padded in (False, True) if B > 1 else (False,):
                        g = torch.Generator(device="cuda").manual_seed(Sk + D + B)
                        q = torch.randn(B, Hq, Sq, D, device="cuda", dtype=dt, generator=g)
                        k = torch.randn(B, Hkv, Sk, D, device="cuda", dtype=dt, generator=g)
                        v = torch.randn(B, Hkv, Sk, D, device="cuda", dtype=dt, generator=g)
                        key_mask = None
                        if padded:  # left padding: row b starts b * Sk / (2B) keys late
                            key_mask = torch.ones(B, Sk, dtype=torch.bool, device="cuda")
                            for b in range(B):
                                key_mask[b, : b * Sk // (2 * B)] = False
                        scale = D ** -0.5
                        ref = _reference(q, k, v, scale, key_mask)
                        floor_ms = 2 * B * Hkv * Sk * D * q.element_size() / (args.hbm_tbs * 1e12) * 1e3
                        row = {"D": D, "B": B, "Sk": Sk, "Sq": Sq, "padded": padded, "floor_ms": floor_ms}
                        for name, fn in variants(q, k, v, scale, key_mask).items():
                            try:
                                err = (fn().float() - ref).abs().max().item()
                                ms = triton.testing.do_bench(fn, warmup=25, rep=100)
                            except Exception as e:  # a backend refusing a shape is a result, not a crash
                                row[name] = {"error": f"{type(e).__name__}: {e}"[:200]}
                                continue
                            row[name] = {"ms": ms, "max_abs_err": err, "floor_fraction": floor_ms / ms}
                        best_other = min(row[n]["ms"] for n in NAMES[1:] if "ms" in row[n])
                        row["package_vs_best_other"] = best_other / row["package"]["ms"]
                        rows.append(row)
                        print(f"D{D} B{B} Sk{Sk} Sq{Sq} pad{int(padded)} floor {floor_ms:.4f} ms | " + " | ".join(
                            f"{n} {row[n]['ms']:.4f} ({row[n]['max_abs_err']:.1e})" if "ms" in row[n]
                            else f"{n} {row[n]['error'][:60]}" for n in NAMES), flush=True)
                        del q, k, v, ref
                        torch.cuda.empty_cache()
    grow = []
    for D in (int(x) for x in args.head_dims.split(",")):
        for B, Sq, padded in ((1, 1, False), (8, 1, True), (1, 128, False)):
            for S0 in (16384, 65536):
                ms = growing(D, B, Sq, padded, S0, args.steps, Hq, Hkv)
                grow.append({"D": D, "B": B, "Sq": Sq, "padded": padded, "S0": S0, "steps": args.steps,
                             "ms_per_call": ms})
                print(f"growing D{D} B{B} Sq{Sq} pad{int(padded)} S0 {S0}: "
                      + " | ".join(f"{n} {v:.3f}" for n, v in ms.items()), flush=True)
    out = {"task": "decode-attention", "device": device_description("cuda"), "date": datetime.date.today().isoformat(),
           "commit": git_commit(), "torch": torch.__version__,
           "command": "python3 -m benchmarks.ops.bench_decode_attention " + shlex.join(sys.argv[1:]),
           "dtype": "bfloat16", "heads": [Hq, Hkv], "hbm_tbs": args.hbm_tbs,
           "metric": "rows: do_bench median ms of one attention call (one shape); floor = K and V bytes / HBM "
                     "bandwidth; growing: mean ms per call over calls whose key length grows by one",
           "rows": rows, "growing": grow}
    path = result_file("decode", f"attention-{device_token()}.json", args.out)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
