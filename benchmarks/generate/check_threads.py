"""One patched model shared by several threads on a GPU: every call gets the answer it gets alone.

tests/test_concurrency.py checks it on the CPU with the PyTorch references; here the model is on CUDA, where the
methods run their Triton kernels, generate() replays its decode steps from CUDA graphs, and LoLA's and OVQ's
prefills capture graphs of their own: `--threads` threads run, `--rounds` times each, padded and unpadded forwards and
generate() calls of different shapes on one model at once, and each result is compared with the same call run alone
(the same tokens; the largest logit difference, beside that of the call alone run twice).

    python3 -m benchmarks.generate.check_threads [--methods exact,sliding-window,muse,moba,lolcats,lola,ovq]
        [--threads 6] [--rounds 5] [--dtype bfloat16] [--device cuda] [--out DIR]

`--device cpu` runs the same on the CPU (the PyTorch references; slow). Writes threads-<gpu>.json (device, date,
commit, command, one row per method) under --out (default $OUT, else benchmarks/results/gpu-integration/).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import traceback

import torch

import longctx_patch as lp
from benchmarks.shared import device_token, results_dir
from longctx_patch.evals.common import write_result

# settings under which each method's own path (and its Triton kernels on CUDA) runs at 300-700 tokens
METHODS = {
    "exact": {},
    "sliding-window": {"window": 128},
    "muse": {"min_seq_len": 256, "far_field": "cells", "block_size": 128, "k_clusters": 8, "topk_blocks": 1},
    "moba": {"block_size": 128, "top_k": 2},
    "lolcats": {"window": 64, "chunk": 64, "feature_dim": 32, "checkpoint": "none"},
    "lola": {"window": 64, "chunk": 32, "feature_dim": 32, "sparse_cache": 64, "checkpoint": "none"},
    "ovq": {"chunk_size": 64, "max_centroids": 256, "exact_assign": True},
}
VOCAB = 512


def small_llama(device: str, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=8192,
                      pad_token_id=0, eos_token_id=None)
    return LlamaForCausalLM(cfg).to(device, dtype).eval()


def left_padded(lens, seed: int, device: str):
    g = torch.Generator().manual_seed(seed)
    L = max(lens)
    ids = torch.zeros(len(lens), L, dtype=torch.long)
    am = torch.zeros_like(ids)
    for r, n in enumerate(lens):
        ids[r, L - n:] = torch.randint(3, VOCAB, (n,), generator=g)
        am[r, L - n:] = 1
    return ids.to(device), am.to(device)


def jobs(device: str) -> list[tuple[str, str, dict]]:
    pad_ids, pad_am = left_padded([640, 431, 300], 1, device)
    gen_ids, gen_am = left_padded([520, 333], 2, device)
    one, _ = left_padded([467], 3, device)
    two, _ = left_padded([700, 700], 4, device)
    gen = dict(max_new_tokens=24, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    return [
        ("forward, left-padded", "forward", dict(input_ids=pad_ids, attention_mask=pad_am, use_cache=False)),
        ("forward, unpadded", "forward", dict(input_ids=two, attention_mask=torch.ones_like(two))),
        ("generate, left-padded", "generate", dict(input_ids=gen_ids, attention_mask=gen_am, **gen)),
        ("generate, unpadded", "generate", dict(input_ids=one, attention_mask=torch.ones_like(one), **gen)),
        ("generate, unpadded batch", "generate", dict(input_ids=two[:, :350], attention_mask=torch.ones_like(two[:, :350]),
                                                      **gen)),
        ("forward, one row", "forward", dict(input_ids=one)),
    ]


def run(model, kind: str, kw: dict):
    with torch.no_grad():
        if kind == "forward":
            return (None, model(**kw).logits.float())
        out = model.generate(**kw)
        return (out.sequences, torch.stack(out.logits, 1).float())


def gap(a, b) -> tuple[bool, float]:
    same = a[0] is None or torch.equal(a[0], b[0])
    d = (a[1] - b[1]).abs().max().item() if a[1].shape == b[1].shape else float("inf")
    return same, d


def check(method: str, device: str, dtype: torch.dtype, threads: int, rounds: int) -> dict:
    model = lp.patch(small_llama(device, dtype), method, **METHODS[method])
    work = jobs(device)[:threads]
    while len(work) < threads:  # more threads than jobs: the jobs again
        work += jobs(device)[:threads - len(work)]
    alone = [run(model, kind, kw) for _, kind, kw in work]
    again = [run(model, kind, kw) for _, kind, kw in work]
    base = max(gap(a, b)[1] for a, b in zip(again, alone))
    results: list[list] = [[] for _ in work]
    errors: list[str] = []
    start = threading.Barrier(len(work))

    def worker(j: int) -> None:
        _, kind, kw = work[j]
        try:
            start.wait()
            for _ in range(rounds):
                results[j].append(run(model, kind, kw))
        except BaseException as e:  # noqa: BLE001 - reported in the row
            errors.append(f"{work[j][0]}: {type(e).__name__}: {e}")

    t = time.perf_counter()
    ts = [threading.Thread(target=worker, args=(j,)) for j in range(len(work))]
    for th in ts:
        th.start()
    for th in ts:
        th.join()
    if device == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t
    differ, worst = [], 0.0
    for j, (name, _, _) in enumerate(work):
        for r, res in enumerate(results[j]):
            same, d = gap(res, alone[j])
            worst = max(worst, d)
            if not same or d > max(base, 0.0) * 2 + (1e-5 if dtype == torch.float32 else 2e-2):
                differ.append(f"{name} (round {r}): tokens {'same' if same else 'DIFFER'}, max |dlogit| {d:.3g}")
    return {"method": method, "dtype": str(dtype).replace("torch.", ""), "threads": len(work), "rounds": rounds,
            "calls": sum(len(r) for r in results), "errors": errors, "differ": differ,
            "max_dlogit_threads": worst, "max_dlogit_alone_twice": base, "wall_s": round(wall, 2),
            "ok": not errors and not differ}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--threads", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("needs a CUDA device (or --device cpu)")
    rows = []
    for m in args.methods.split(","):
        try:
            row = check(m, args.device, getattr(torch, args.dtype), args.threads, args.rounds)
        except Exception as e:  # noqa: BLE001 - report and go on with the next method
            row = {"method": m, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc(), "ok": False}
        print(json.dumps(row), flush=True)
        rows.append(row)
        if args.device == "cuda":
            torch.cuda.empty_cache()
    out = results_dir("gpu-integration", args.out)
    name = f"threads-{device_token(args.device)}.json"
    path = write_result(out / name, task="threads", model="llama-small-random", runs=[],
                        figures={"all_ok": all(r.get("ok") for r in rows), "rows": rows},
                        command="python3 -m benchmarks.generate.check_threads "
                                + " ".join(sys.argv[1:] if argv is None else argv))
    print("wrote", path)
    return 0 if all(r.get("ok") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
