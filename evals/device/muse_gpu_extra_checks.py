"""MuSe GPU checks of two paths the cells benchmark does not cover: head_dim 96 (zero-padded to 128 for the
kernels) against the PyTorch reference, forward and gradients in fp32 and bf16, and its speed at 64k against cuDNN;
a bf16-autocast training step of a patched random Llama (fp32 weights, as the adaptation recipe runs).

    python3 -m evals.device.muse_gpu_extra_checks      # writes $OUT/d96-autocast-checks-<gpu>.json (or in evals/results/muse/)
"""

import json
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import LlamaConfig, LlamaForCausalLM

import longctx_patch as lp
from evals.shared import device_token, results_dir
from longctx_patch.evals.common import git_commit
from longctx_patch.kernels.muse import muse_attention
from longctx_patch.methods.muse import FAR_FIELD_DEFAULTS


def main():
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    out = dict(device=torch.cuda.get_device_name(0), commit=git_commit(), date=time.strftime("%Y-%m-%d"),
               command="python3 -m evals.device.muse_gpu_extra_checks")
    rel = lambda a, b: float((a.double() - b.double()).norm() / b.double().norm())
    g = torch.Generator(device="cuda").manual_seed(0)
    cfg = dict(FAR_FIELD_DEFAULTS["cells"], far_field="cells")
    for dt in (torch.float32, torch.bfloat16):
        q, k, v = (torch.randn(1, h, 3001, 96, device="cuda", generator=g).to(dt).requires_grad_(True) for h in (8, 2, 2))
        o = muse_attention(q, k, v, scale=96**-0.5, backend="triton", **cfg)
        r = muse_attention(*(t.detach().float().requires_grad_(True) for t in (q, k, v)), scale=96**-0.5, backend="torch", **cfg)
        do = torch.randn_like(r)
        gt = torch.autograd.grad(o, (q, k, v), do.to(dt))
        qr, kr, vr = (t.detach().float().requires_grad_(True) for t in (q, k, v))
        r = muse_attention(qr, kr, vr, scale=96**-0.5, backend="torch", **cfg)
        gr = torch.autograd.grad(r, (qr, kr, vr), do)
        out[f"d96_{dt}"] = dict(fwd=rel(o, r), dq=rel(gt[0], gr[0]), dk=rel(gt[1], gr[1]), dv=rel(gt[2], gr[2]))
        print(out[f"d96_{dt}"], flush=True)
    # a bf16-autocast training step through a patched Llama (fp32 weights), as the recipe runs it
    torch.manual_seed(0)
    m = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=8192)).cuda().train()
    lp.patch(m, "muse", min_seq_len=0)
    ids = torch.randint(0, 512, (1, 4096), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = m(ids, labels=ids, use_cache=False).loss
    loss.backward()
    gn = float(sum(p.grad.float().norm() ** 2 for p in m.parameters() if p.grad is not None) ** 0.5)
    out["autocast_step"] = dict(loss=float(loss), grad_norm=gn, finite=bool(torch.isfinite(torch.tensor(gn))))
    print(out["autocast_step"], flush=True)
    # D=96 speed at 64k, 32/8 heads, bf16
    q, k, v = (torch.randn(1, h, 65536, 96, device="cuda", dtype=torch.bfloat16, generator=g) for h in (32, 8, 8))
    kx, vx = k.repeat_interleave(4, 1), v.repeat_interleave(4, 1)
    b = lambda f: triton.testing.do_bench(f, warmup=5, rep=50, return_mode="median")
    with torch.no_grad():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            cud = b(lambda: F.scaled_dot_product_attention(q, kx, vx, is_causal=True))
        mu = b(lambda: muse_attention(q, k, v, scale=96**-0.5, **cfg))
    out["d96_64k"] = dict(cudnn_fwd_ms=cud, muse_fwd_ms=mu, speedup=cud / mu)
    print(out["d96_64k"], flush=True)
    with open(results_dir("muse", os.environ.get("OUT")) / f"d96-autocast-checks-{device_token()}.json", "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
