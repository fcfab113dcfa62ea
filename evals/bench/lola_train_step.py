"""Time one training step (forward + backward) of a SmolLM2-shaped random-weight model patched with `lolcats` and
with `lola` (the sparse cache in place during training), to size an attention transfer with LoLA.

    python3 -m evals.bench.lola_train_step [--seq 4096] [--batch 2] [--out FILE]
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import longctx_patch as lp
from evals.shared import device_token, result_file
from longctx_patch.evals.common import git_commit


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--out", default=None, help="file (default evals/results/lola/train-step-<device>.json)")
    ap.add_argument("--methods", default="lolcats,lola,lola-loop")
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--sparse-cache", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=64)
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=args.layers,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192)
    rows = []
    import longctx_patch.methods.lolcats as lolcats_method

    for meth in args.methods.split(","):
        # lola-loop: lola trained through its PyTorch chunk loop instead of its sparse sets
        lolcats_method.TRAIN_WITH_SETS = meth != "lola-loop"
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg).to(dev)
        kw = dict(window=args.window, chunk=args.chunk, checkpoint="none")
        if meth in ("lola", "lola-loop"):
            kw.update(sparse_cache=args.sparse_cache)
        lp.patch(model, meth.replace("-loop", ""), **kw)
        ids = torch.randint(3, 49000, (args.batch, args.seq), device=dev)
        times = []
        for _ in range(3):
            if dev == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda"):
                loss = model(ids, labels=ids, use_cache=False).loss
            loss.backward()
            if dev == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        peak = torch.cuda.max_memory_allocated() / 2**30 if dev == "cuda" else None
        rows.append({"method": meth, "config": kw, "step_s": min(times), "peak_gib": peak})
        print(rows[-1], flush=True)
        del model
        if dev == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    res = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "commit": git_commit(), "command": "python3 -m evals.bench.lola_train_step " + " ".join(sys.argv[1:]),
           "seq": args.seq, "batch": args.batch, "layers": args.layers, "rows": rows}
    with open(result_file("lola", f"train-step-{device_token() if dev == 'cuda' else 'cpu'}.json", args.out), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
