"""Decode graphs on a CUDA GPU (longctx_patch/decode_graphs.py): greedy `generate()` with the decode steps replayed
from CUDA graphs against the same with every step eager, per method and dtype, on a Llama-3.2-1B-shaped random
model: the same tokens, the largest score difference, how many steps were captured / replayed, and the wall time
of each whole generate() call.

    python3 -m benchmarks.generate.check_decode_graphs [--methods lola,lolcats,ovq,exact,sliding-window] [--prompt 2048]
        [--new 160] [--out DIR]

exact and sliding-window (its default window of 256 tokens: a ring below the 2048-token prompt) decode from a
preallocated KV buffer (longctx_patch/methods/kv_layer.py); ovq from its open-chunk buffer (a prompt of 2000
tokens puts an absorbing step among the new ones).

Writes decode-graphs-<gpu>.json (device, date, commit, command, one row per method x dtype) under --out
(default $OUT, else benchmarks/results/speed/).
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
from benchmarks.shared import device_token, llama_1b_shaped, results_dir
from longctx_patch import decode_graphs as dg
from longctx_patch.evals.common import write_result

CONFIGS = {"lola": {"checkpoint": "none"}, "lolcats": {"checkpoint": "none"}}


def _gen(model, ids, new):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                         do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def check(method: str, dtype, prompt: int, new: int, batch: int) -> dict:
    model = llama_1b_shaped("cuda", dtype)
    lp.patch(model, method, **CONFIGS.get(method, {}))
    ids = torch.randint(100, 128000, (batch, prompt), generator=torch.Generator().manual_seed(0)).cuda()
    row = {"method": method, "dtype": str(dtype).replace("torch.", ""), "batch": batch, "prompt": prompt, "new": new}
    lp.set_decode_graphs(model, False)
    _gen(model, ids, 4)  # compiles the kernels
    eager, t_e = _gen(model, ids, new)
    lp.set_decode_graphs(model, True)
    graphs, t_g = _gen(model, ids, new)
    again, t_g2 = _gen(model, ids, new)
    se, sg = torch.stack(eager.scores, 1), torch.stack(graphs.scores, 1)
    fin = se.isfinite()
    row.update(
        same_tokens=bool(torch.equal(eager.sequences, graphs.sequences)),
        same_tokens_again=bool(torch.equal(eager.sequences, again.sequences)),
        max_score_diff=float((se - sg)[fin].abs().max()),
        stats=dg.stats(graphs.past_key_values), eager_s=round(t_e, 4), graphs_s=round(t_g, 4),
        graphs_again_s=round(t_g2, 4),
    )
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default="lola,lolcats,ovq,exact,sliding-window")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--new", type=int, default=160)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    rows = []
    for m in args.methods.split(","):
        for d in args.dtypes.split(","):
            try:
                row = check(m, getattr(torch, d), args.prompt, args.new, args.batch)
            except Exception as e:  # noqa: BLE001 - report and go on with the next case
                row = {"method": m, "dtype": d, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
            print(json.dumps(row), flush=True)
            rows.append(row)
            torch.cuda.empty_cache()
    out = results_dir("speed", args.out)
    path = write_result(out / f"decode-graphs-{device_token()}.json", task="decode-graphs",
                        model="llama-3.2-1b-shaped-random", runs=[], figures={"rows": rows},
                        command="python3 -m benchmarks.generate.check_decode_graphs " + " ".join(sys.argv[1:] if argv is None else argv))
    print("wrote", path)


if __name__ == "__main__":
    main()
