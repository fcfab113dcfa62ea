"""The fused model ops (`patch(..., fused_ops=True)`: RMSNorm, rotary, SiLU * up as Triton kernels) on CUDA against
the model's own ops: a Llama-3.2-1B-shaped random model patched with each method, greedy `generate()` with decode
graphs on, fused ops off then on. Same tokens, the largest difference of any step's scores, the prefill logits'
largest difference, and the decode ms per step of both (one generate() each, CUDA events inside the call).

    python3 -m benchmarks.generate.check_fused_ops --methods exact,lolcats,lola --dtypes bfloat16,float32 --out F.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys

import torch

import longctx_patch as lp
from benchmarks.shared import llama_1b_shaped
from longctx_patch.provenance import device_description, git_commit
from longctx_patch.evals.speed_model import timed_generate


def _greedy(model, ids, new: int):
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                         do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.scores).float()


def _finite_max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest |a - b| where both are finite (generate's processors set some scores to -inf: min_new_tokens
    masks EOS); NaN if the two disagree on which scores are finite."""
    fa, fb = torch.isfinite(a), torch.isfinite(b)
    if not torch.equal(fa, fb):
        return float("nan")
    return float((a[fa] - b[fb]).abs().max()) if bool(fa.any()) else 0.0


def check(method: str, dtype: torch.dtype, prompt: int, new: int, batch: int) -> dict:
    model = llama_1b_shaped("cuda", dtype)
    ids = torch.randint(100, 128256, (batch, prompt), generator=torch.Generator().manual_seed(0)).cuda()
    row = {"method": method, "dtype": str(dtype).split(".")[-1], "prompt": prompt, "new_tokens": new, "batch": batch}
    res = {}
    for fused in (False, True):
        lp.patch(model, method, fused_ops=fused)
        with torch.no_grad():
            logits = model(input_ids=ids, logits_to_keep=1).logits.float()
            toks, scores = _greedy(model, ids, new)
            _, dec = timed_generate(model, ids, 81 + new, {}, 81)
        res[fused] = (logits, toks, scores, dec * 1e3 / new)
        lp.unpatch(model)
    (l0, t0, s0, ms0), (l1, t1, s1, ms1) = res[False], res[True]
    same = t0 == t1
    first = int((~same).any(0).nonzero()[0]) if not bool(same.all()) else None
    upto = first if first is not None else new
    row.update(prefill_logits_max_diff=float((l0 - l1).abs().max()), tokens_equal=bool(same.all()),
               first_different_step=first, scores_max_diff_before_it=_finite_max_diff(s0[:upto], s1[:upto]),
               decode_ms_per_step_unfused=ms0, decode_ms_per_step_fused=ms1,
               speedup=ms0 / ms1)
    print(json.dumps(row))
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default="exact,lolcats,lola")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--new", type=int, default=96)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    rows = [check(m, getattr(torch, d), args.prompt, args.new, args.batch)
            for d in args.dtypes.split(",") for m in args.methods.split(",")]
    rec = {"task": "decode-fused-ops",
           "device": device_description("cuda"), "date": datetime.date.today().isoformat(), "commit": git_commit(),
           "command": "python3 -m benchmarks.generate.check_fused_ops " + shlex.join(sys.argv[1:]), "rows": rows}
    with open(args.out, "w") as f:
        json.dump(rec, f, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
