"""`generate()` of every method on one GPU and, through transformers' tensor parallelism (`tp_plan="auto"`), on two:
the same greedy tokens, prefill / decode tokens/s and peak memory per GPU. A Llama-3.2-1B-shaped model with random
weights (benchmarks/shared.py), a 64k-token prefill (batch 1) and a batch of 16 x 32k decoding 32 tokens.

    python3 -m benchmarks.generate.bench_tensor_parallel --out one.json                           # one GPU (writes the reference)
    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 -m benchmarks.generate.bench_tensor_parallel --reference one.json --out two.json

Both runs load the model from --model-dir (written by the first run that finds it missing), so their weights are the
same. The two-GPU run compares its tokens with the reference file's, per method and cell (`same_tokens`, and the first
differing step of each row): in bf16 the ranks' partial o_proj sums reach the logits in another order than one GPU's
matmul, so near-tied logits of a random model can flip a token; --dtype float32 narrows that. Decode graphs are off
in both runs by default (a tensor-parallel model is patched with them off: docs/tensor-parallel.md).
Not run yet: written for a 2 x H200 machine (NVLink multicast off: NCCL_NVLS_ENABLE=0).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
from transformers import StoppingCriteria

import longctx_patch as lp
from benchmarks.shared import device_token, llama_1b_shaped, result_file
from longctx_patch.provenance import device_description, git_commit

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (before NCCL starts)

METHODS = {  # defaults, fresh method tensors (a random model has no trained weights)
    "exact": {}, "sliding-window": {}, "lolcats": {"checkpoint": "none"}, "lola": {"checkpoint": "none"},
    "ovq": {}, "muse": {}, "moba": {},
}
CELLS = {"prefill": (1, 65536, 8), "decode": (16, 32768, 32)}  # name: (batch, prompt tokens, new tokens)


class _Clock(StoppingCriteria):
    """A stopping criterion that never stops: the time (after a device sync) at each generated token."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores, **kwargs):
        torch.cuda.synchronize()
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _setup() -> tuple[int, int]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("nccl", timeout=timedelta(hours=2),
                                device_id=torch.device("cuda", torch.cuda.current_device()))
    return rank, world


def _barrier(world: int) -> None:
    if world > 1:
        import torch.distributed as dist

        dist.barrier()


def _load(model_dir: Path, dtype, rank: int, world: int):
    from transformers import AutoModelForCausalLM

    if not (model_dir / "config.json").exists() and rank == 0:
        llama_1b_shaped("cuda", torch.bfloat16).save_pretrained(model_dir)
        torch.cuda.empty_cache()
    _barrier(world)
    if world > 1:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, tp_plan="auto")
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).cuda()
    return model.eval()


def _peak_per_gpu(world: int) -> list[int]:
    peak = torch.cuda.max_memory_allocated()
    if world == 1:
        return [peak]
    import torch.distributed as dist

    out = [None] * world
    dist.all_gather_object(out, peak)
    return out


def _cell(model, batch: int, prompt: int, new: int, world: int) -> dict:
    ids = torch.randint(3, model.config.vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(prompt))
    ids = ids.cuda()
    clock = _Clock()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    with torch.no_grad():
        seq = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, pad_token_id=0, stopping_criteria=[clock])
    first, last = clock.times[0], clock.times[-1]
    return {"batch": batch, "prompt": prompt, "new_tokens": new,
            "prefill_s": first - t0, "prefill_tok_s": batch * prompt / (first - t0),
            "decode_tok_s": batch * (new - 1) / (last - first) if new > 1 else None,
            "peak_bytes_per_gpu": _peak_per_gpu(world), "tokens": seq[:, prompt:].tolist()}


def _compare(got: list[list[int]], want: list[list[int]]) -> dict:
    first = [next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), None) for g, w in zip(got, want)]
    return {"same_tokens": got == want, "first_diff_per_row": first}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--cells", default=",".join(CELLS), help="prefill (1 x 64k), decode (16 x 32k)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--decode-graphs", choices=("on", "off"), default="off")
    ap.add_argument("--model-dir", default="/tmp/llama-3.2-1b-shaped-random")
    ap.add_argument("--reference", default=None, help="the one-GPU run's JSON, whose tokens this run must equal")
    ap.add_argument("--out", default=None, help="JSON file (default benchmarks/results/tensor-parallel/...)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("needs CUDA devices (one, or two under torchrun)")
    rank, world = _setup()
    model = _load(Path(args.model_dir), getattr(torch, args.dtype), rank, world)
    ref = json.loads(Path(args.reference).read_text())["methods"] if args.reference else None
    rows = {}
    for method in args.methods.split(","):
        lp.patch(model, method, decode_graphs=args.decode_graphs == "on", **METHODS[method])
        rows[method] = {}
        for cell in args.cells.split(","):
            res = _cell(model, *CELLS[cell], world)
            if ref is not None and cell in ref.get(method, {}):
                res.update(_compare(res["tokens"], ref[method][cell]["tokens"]))
            rows[method][cell] = res
            if rank == 0:
                print(method, cell, {k: v for k, v in res.items() if k != "tokens"}, flush=True)
        lp.unpatch(model)
        torch.cuda.empty_cache()
    if rank == 0:
        launcher = f"torchrun --nproc-per-node {world} -m" if world > 1 else "python3 -m"
        out = {
            "task": "tensor-parallel",
            "device": device_description("cuda", world),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": git_commit(),
            "command": f"{launcher} benchmarks.generate.bench_tensor_parallel " + " ".join(sys.argv[1:] if argv is None else argv),
            "env": {"NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE")},
            "model": "llama-3.2-1b-shaped-random", "dtype": args.dtype, "decode_graphs": args.decode_graphs,
            "torch": torch.__version__, "transformers": __import__("transformers").__version__,
            "methods": rows,
        }
        dev = device_token() + (f"x{world}" if world > 1 else "")
        path = result_file("tensor-parallel", f"generate-llama-3.2-1b-shaped-{args.dtype}-{dev}.json", args.out)
        path.write_text(json.dumps(out, indent=1) + "\n")
        print("wrote", path)
    _barrier(world)
    if world > 1:
        import torch.distributed as dist

        dist.destroy_process_group()


if __name__ == "__main__":
    main()
