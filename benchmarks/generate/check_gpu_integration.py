"""GPU integration check: every method patched into a random-weight Llama on CUDA, Triton backend vs the
PyTorch reference backend, through the model (prefill logits, greedy generate, left-padded batch).

    python3 -m benchmarks.generate.check_gpu_integration [--out DIR]

Writes all-<gpu>.json, or <methods>-<gpu>.json for --methods (device, date, commit, command + one row per
method/dtype), under --out (default $OUT, else benchmarks/results/gpu-integration/).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch

import longctx_patch as lp
from benchmarks.shared import device_token, results_dir
from longctx_patch.provenance import device_description, git_commit

METHODS = {  # label: (method, config, backend key, fast backend, reference backend)
    "muse": ("muse", {"far_field": "tilted", "min_seq_len": 256, "block_size": 64}, "backend", "triton", "torch"),
    "muse-cells": ("muse", {"min_seq_len": 256, "far_field": "cells", "block_size": 128, "k_clusters": 8,
                            "topk_blocks": 1}, "backend", "triton", "torch"),
    "lolcats": ("lolcats", {"window": 64, "feature_dim": 32}, "backend", "triton", "torch"),
    "lola": ("lola", {"window": 64, "feature_dim": 32, "sparse_cache": 64, "chunk": 32}, "backend", "triton", "torch"),
    # exact (float32) assignment dots: with the default bf16 dots the Triton path picks other rows at near ties
    # (fp32 logits then differ by ~4e-3 instead of ~4e-7, CPU interpreter check); benchmarks/ops/bench_ovq_profile.py checks
    # the default path against the reference
    "ovq": ("ovq", {"chunk_size": 64, "max_centroids": 256, "exact_assign": True}, "backend", "triton", "torch"),
}


def tiny_llama(dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=8192)
    return LlamaForCausalLM(cfg).to(DEVICE, dtype).eval()


DEVICE = "cuda"


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def check(method, dtype, S=777):
    name, cfg, key, fast, ref = METHODS[method]
    g = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(3, 512, (2, S), generator=g).to(DEVICE)
    am = torch.ones_like(ids)
    am[1, : S // 8] = 0
    row = {"method": method, "dtype": str(dtype).replace("torch.", ""), "seq": S}
    outs = {}
    for backend in (ref, fast):
        model = tiny_llama(dtype)
        lp.patch(model, name, **cfg, **{key: backend})
        sync()
        t = time.perf_counter()
        with torch.no_grad():
            logits = model(ids, attention_mask=am, use_cache=False).logits
            sync()
            row[f"prefill_s_{backend}"] = round(time.perf_counter() - t, 4)
            P = min(300, S // 2)
            gen = model.generate(ids[:, :P], attention_mask=am[:, :P], max_new_tokens=24, do_sample=False,
                                 pad_token_id=0)
        outs[backend] = (logits, gen[:, P:])
        del model
    (l0, g0), (l1, g1) = outs[ref], outs[fast]
    m = am.bool()[:, :, None].expand_as(l0)
    row["logits_rel_err"] = rel(l1[m], l0[m])
    row["generate_token_agreement"] = (g0 == g1).float().mean().item()
    row["finite"] = bool(torch.isfinite(l1).all())
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT"), help="folder (default $OUT, else benchmarks/results/gpu-integration)")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu with TRITON_INTERPRET=1 for a slow smoke run")
    ap.add_argument("--seq", type=int, default=777)
    ap.add_argument("--methods", default=",".join(METHODS), help=f"comma list of rows (default all: {', '.join(METHODS)})")
    a = ap.parse_args()
    methods = a.methods.split(",")
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        sys.exit(f"unknown --methods {unknown}; choose from {', '.join(METHODS)}")
    global DEVICE
    DEVICE = a.device
    rows = []
    for method in methods:
        for dtype in (torch.float32, torch.bfloat16):
            try:
                r = check(method, dtype, a.seq)
            except Exception as e:  # report every method, then fail at the end
                r = {"method": method, "dtype": str(dtype), "error": f"{type(e).__name__}: {e}",
                     "traceback": traceback.format_exc()[-2000:]}
            rows.append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "traceback"}), flush=True)
    commit = git_commit()  # $LONGCTX_COMMIT on a copy of the tree, else git
    rec = {"task": "gpu-integration",
           "device": device_description(DEVICE), "date": time.strftime("%Y-%m-%d"), "commit": commit or "unknown",
           "command": "python3 -m benchmarks.generate.check_gpu_integration" + ("" if methods == list(METHODS) else f" --methods {a.methods}"), "torch": torch.__version__,
           "transformers": __import__("transformers").__version__, "rows": rows}
    what = "all" if methods == list(METHODS) else "+".join(methods)
    dev = device_token() if DEVICE == "cuda" else "cpu"
    with open(results_dir("gpu-integration", a.out) / f"{what}-{dev}.json", "w") as f:
        json.dump(rec, f, indent=2)
    print(f"{'method':8} {'dtype':9} {'rel err':>9} {'gen agree':>9} {'ref s':>7} {'triton s':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['method']:8} {r['dtype']:9} ERROR {r['error'][:80]}")
        else:
            ks = [k for k in r if k.startswith("prefill_s_")]
            print(f"{r['method']:8} {r['dtype']:9} {r['logits_rel_err']:9.2e} {r['generate_token_agreement']:9.2f} "
                  f"{r[ks[0]]:7.3f} {r[ks[1]]:8.3f}")
    sys.exit(1 if any("error" in r for r in rows) else 0)


if __name__ == "__main__":
    main()
