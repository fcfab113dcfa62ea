"""Where a generate() call's time to its first token goes, against the model's own prefill forward: a
Llama-3.2-1B-shaped model (random weights, bf16) patched with each of `--methods`, one process per method.

bench_generate's cells time the prefill forward (`model(ids, use_cache=True)`) and, inside a generate() call, the
span from the call to its first token; for `lola` at batch 1 x 32k the second took 0.6-1.4 s against the forward's
0.17-0.40 s (H100, 0ee7a6e: benchmarks/results/speed/llama-3.2-1b-shaped-generate-lola-chunk*-h100.json). Here,
in order and each synchronised: the forward twice, then generate() of 2 new tokens three times with decode graphs
on, once with them off, and one more with them on under `torch.profiler` (the ops with the most host time and the
most device time), so that what generate() adds (the cache's set-up, the decode graphs captured at the prefill's
end: decode_graphs.PrefillThenCapture, a first compile) is named by measurement.

    python3 -m benchmarks.generate.bench_first_call --methods lola,exact --batch 1 --context 32k --out $OUT/first.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import longctx_patch as lp
from benchmarks.shared import device_token, llama_1b_shaped, write_bench_result
from longctx_patch.evals.common import parse_sizes


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _wall(fn, dev) -> float:
    _sync(dev)
    t = time.perf_counter()
    fn()
    _sync(dev)
    return round(time.perf_counter() - t, 4)


def _top(prof, key: str, n: int) -> list[dict]:
    rows = sorted(prof.key_averages(), key=lambda e: getattr(e, key, 0), reverse=True)[:n]
    return [{"op": e.key[:90], "calls": e.count, "cpu_total_ms": round(e.cpu_time_total / 1e3, 3),
             "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 3),
             "self_device_ms": round(getattr(e, "self_device_time_total", 0) / 1e3, 3)} for e in rows]


def measure(method: str, config: dict, batch: int, context: int, dev: torch.device, top: int) -> dict:
    model = llama_1b_shaped(str(dev), torch.bfloat16)
    if method != "none":
        lp.patch(model, method, **config)
    gen = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(100, model.config.vocab_size, (batch, context), generator=gen).to(dev)
    kw = dict(max_new_tokens=2, min_new_tokens=2, do_sample=False, attention_mask=torch.ones_like(ids), pad_token_id=0)
    row: dict = {"method": method, "config": config, "batch": batch, "context": context}
    with torch.no_grad():
        row["forward_s"] = [_wall(lambda: model(input_ids=ids, use_cache=True, logits_to_keep=1), dev) for _ in range(2)]
        row["generate2_graphs_s"] = [_wall(lambda: model.generate(ids, **kw), dev) for _ in range(3)]
        if method != "none":
            lp.set_decode_graphs(model, False)
            row["generate2_eager_s"] = _wall(lambda: model.generate(ids, **kw), dev)
            lp.set_decode_graphs(model, True)
        acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if dev.type == "cuda"
                                                        else [])
        with torch.profiler.profile(activities=acts) as prof:
            model.generate(ids, **kw)
            _sync(dev)
    row["profile_by_cpu_total"] = _top(prof, "cpu_time_total", top)
    row["profile_by_self_cpu"] = _top(prof, "self_cpu_time_total", top)
    row["profile_by_self_device"] = _top(prof, "self_device_time_total", top)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default="lola,exact")
    ap.add_argument("--config", default="{}", help="JSON: {method: {option: value}}")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", default="32k")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run (small --context)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    configs = json.loads(a.config)
    context = parse_sizes(a.context)[0]
    rows = []
    for m in a.methods.split(","):
        row = measure(m, configs.get(m, {}), a.batch, context, dev, a.top)
        print(json.dumps({k: v for k, v in row.items() if not k.startswith("profile")}), flush=True)
        for e in row["profile_by_cpu_total"][:12]:
            print(f"   {e['cpu_total_ms']:10.1f} ms  {e['calls']:6d}x  {e['op']}")
        rows.append(row)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    write_bench_result("speed", f"first-call-{device_token(a.device)}.json", a.out, task="first-call",
                       module="benchmarks.generate.bench_first_call", argv=argv, device=a.device, rows=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
