"""Sliding-window prefill on a CUDA GPU: the package's banded kernel (kernels/window/) and its Triton forward
(kernels/window/triton_window.py, `window_attention_triton`; forward only: no fwd+bwd row) against flex attention
with a sliding-window block mask (compiled), SDPA under the dense mask (the path before the banded kernel) and
cuDNN's full causal attention (no window: the cost the window exists to avoid), in the same run.

Every variant's output is checked against the banded one (bf16; the banded kernel itself is checked against an
fp32 dense reference up to 16k). Times are `triton.testing.do_bench` medians, forward and forward + backward.

    python3 -m benchmarks.ops.bench_window --lengths 16k,64k,128k --window 256 --out $OUT/window-256-h200.json

`--tiles BR,BN,WARPS,STAGES` runs the Triton forward with other launch tiles (`kernels.window.WindowTiles`; an empty
entry keeps that default), e.g. `--tiles 64,64,4,3`.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import shlex
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks.shared import device_token, result_file
from longctx_patch.evals.common import parse_sizes
from longctx_patch.provenance import device_description, git_commit
from longctx_patch.kernels.softmax import attention_mask
from longctx_patch.kernels.window import WindowTiles, banded_bytes, banded_window_attention, window_attention_triton

FWD_ONLY = {"triton"}  # no backward: timed forward only


def _flex(W):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled = torch.compile(flex_attention, dynamic=False)

    def run(q, k, v, scale):
        S = q.shape[2]
        bm = create_block_mask(lambda b, h, qi, ki: (ki <= qi) & (ki > qi - W), None, None, S, S, device=q.device)
        return compiled(q, k, v, block_mask=bm, scale=scale, enable_gqa=True).transpose(1, 2)

    return run


def _dense(W):
    def run(q, k, v, scale):
        G = q.shape[1] // k.shape[1]
        m = attention_mask(q.shape[2], k.shape[2], device=q.device, window=W)
        return F.scaled_dot_product_attention(q, k.repeat_interleave(G, 1), v.repeat_interleave(G, 1), attn_mask=m,
                                              scale=scale).transpose(1, 2)
    return run


def _cudnn_full(q, k, v, scale):
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True).transpose(1, 2)


def parse_tiles(text: str | None) -> WindowTiles | None:
    """`--tiles BR,BN,WARPS,STAGES` (an empty entry: that default) -> WindowTiles; None or "" -> None."""
    if not text:
        return None
    parts = text.split(",")
    if len(parts) != 4:
        raise SystemExit(f"--tiles {text!r}: four entries BR,BN,WARPS,STAGES (an empty one keeps its default)")
    try:
        return WindowTiles(*(int(x) if x.strip() else None for x in parts))
    except ValueError as e:
        raise SystemExit(f"--tiles {text!r}: {e}") from None


def main(argv=None):
    from triton.testing import do_bench

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="16k,64k,128k")
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dense-max", default="32k", help="longest length for the dense-mask variant (S x S memory)")
    ap.add_argument("--variants", default="banded,triton,flex,dense-mask,cudnn-full-causal",
                    help="which to time (flex compiles first: leave it out for a short run)")
    ap.add_argument("--tiles", default=None, metavar="BR,BN,WARPS,STAGES",
                    help="the Triton forward's launch tiles (kernels.window.WindowTiles); default: its own")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    tiles = parse_tiles(args.tiles)
    dev, dt, W, D = torch.device("cuda"), torch.bfloat16, args.window, args.head_dim
    scale = D ** -0.5
    variants = {"banded": lambda q, k, v, s: banded_window_attention(q, k, v, scale=s, window=W),
                "triton": lambda q, k, v, s: window_attention_triton(q, k, v, scale=s, window=W, tiles=tiles),
                "flex": _flex(W), "dense-mask": _dense(W), "cudnn-full-causal": _cudnn_full}
    keep = [x.strip() for x in args.variants.split(",") if x.strip()]
    unknown = sorted(set(keep) - set(variants))
    if unknown:
        sys.exit(f"--variants: unknown {unknown}; choose from {sorted(variants)}")
    variants = {n: f for n, f in variants.items() if n in keep}
    rows = []
    for L in parse_sizes(args.lengths):
        g = torch.Generator(device=dev).manual_seed(0)
        q = torch.randn(1, args.heads, L, D, device=dev, dtype=dt, generator=g)
        k = torch.randn(1, args.kv_heads, L, D, device=dev, dtype=dt, generator=g)
        v = torch.randn(1, args.kv_heads, L, D, device=dev, dtype=dt, generator=g)
        row = {"L": L, "window": W, "banded_bytes": banded_bytes(1, args.heads, args.kv_heads, L, D, W, 2)}
        if L <= 16384:
            ref = _dense(W)(q.float(), k.float(), v.float(), scale)
            row["banded_max_err_vs_fp32"] = (banded_window_attention(q, k, v, scale=scale, window=W).float()
                                             - ref).abs().max().item()
            try:
                row["triton_max_err_vs_fp32"] = (window_attention_triton(q, k, v, scale=scale, window=W,
                                                                         tiles=tiles).float() - ref).abs().max().item()
            except Exception as e:  # noqa: BLE001 - reported; the variant loop records it again
                row["triton_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            del ref
        base = banded_window_attention(q, k, v, scale=scale, window=W).float()
        for name, fn in variants.items():
            if name == "dense-mask" and L > parse_sizes(args.dense_max)[0]:
                continue
            try:
                with torch.no_grad():
                    out = fn(q, k, v, scale)
                    if name != "cudnn-full-causal":
                        row[f"{name}_max_diff_vs_banded"] = (out.float() - base).abs().max().item()
                    row[f"{name}_fwd_ms"] = do_bench(lambda: fn(q, k, v, scale))
                if name in FWD_ONLY:
                    del out
                    continue
                qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
                gout = torch.randn_like(out)

                def step(fn=fn, qq=qq, kk=kk, vv=vv, gout=gout):
                    fn(qq, kk, vv, scale).backward(gout)
                    qq.grad = kk.grad = vv.grad = None

                row[f"{name}_fwdbwd_ms"] = do_bench(step)
                del out, qq, kk, vv, gout
            except Exception as e:  # noqa: BLE001 - one variant's failure is a result, the others go on
                row[f"{name}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            torch.cuda.empty_cache()
        for name in ("banded", "triton"):
            if "cudnn-full-causal_fwd_ms" in row and f"{name}_fwd_ms" in row:
                row[f"{name}_speedup_vs_cudnn_full"] = row["cudnn-full-causal_fwd_ms"] / row[f"{name}_fwd_ms"]
        print(json.dumps(row), flush=True)
        rows.append(row)
        del q, k, v, base
    out = {"task": "speed-op",
           "device": device_description("cuda"), "date": datetime.date.today().isoformat(), "commit": git_commit(),
           "torch": torch.__version__, "command": "python3 -m benchmarks.ops.bench_window " + shlex.join(sys.argv[1:]),
           "dtype": "bfloat16", "heads": [args.heads, args.kv_heads], "head_dim": D,
           **({"triton_tiles": dataclasses.asdict(tiles)} if tiles else {}), "rows": rows}
    path = result_file("speed-op", f"window-{W}-{device_token()}.json", args.out)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
