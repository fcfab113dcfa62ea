"""Where a replayed decode step's time goes between the GPU and the host, inside `model.generate()`.

A Llama-3.2-1B-shaped model (random weights, bf16) patched with `--method` prefills `--batch` x `--context`
random tokens, then decodes greedily with decode graphs on. For the same steady-state steps it measures:

- generate_ms: a step inside one generate() call (CUDA events from a logits processor, as the speed eval);
- loop_ms: a step of a bare loop `model(next_token, cache)` + argmax (this package's per-step host work, without
  generate()'s: logits processors, stopping criteria, input bookkeeping);
- replay_ms: the model's graphs replayed back to back in their cyclic order, no host work between them (the GPU
  time of a step when the host keeps up);
- kernels per step and the summed kernel time of a replayed step (`torch.profiler`);
- a cProfile of the host during generate() (the functions with the most own time).

generate_ms - replay_ms is what the host adds; replay_ms - kernel_ms what the graph's launch gaps add.

    python3 -m benchmarks.generate.bench_decode_step_anatomy --method lolcats --batch 16 --context 32k --out F.json
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import json
import pstats
import shlex
import sys

import torch

import longctx_patch as lp
from benchmarks.shared import device_token, kernel_kind, llama_1b_shaped, result_file
from longctx_patch.cache import cache_argument
from longctx_patch.evals.common import parse_sizes
from longctx_patch.provenance import device_description, git_commit
from longctx_patch.evals.speed_model import timed_generate


def _events_ms(fn, n: int) -> float:
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / n


def _loop(model, nxt, cache, steps: int):
    arg = cache_argument(model.forward)
    for _ in range(steps):
        out = model(input_ids=nxt, use_cache=True, **{arg: cache})
        nxt = out.logits[:, -1:].argmax(-1)
    return nxt


def _host_profile(model, ids, new_tokens: int, top: int = 25) -> list[dict]:
    prof = cProfile.Profile()
    prof.enable()
    timed_generate(model, ids, new_tokens, {})
    prof.disable()
    st = pstats.Stats(prof, stream=io.StringIO())
    rows = []
    for (fname, line, func), (cc, nc, tt, ct, _) in st.stats.items():
        rows.append({"function": f"{fname.split('site-packages/')[-1]}:{line}({func})", "calls": nc,
                     "own_ms": tt * 1e3, "cumulative_ms": ct * 1e3})
    rows.sort(key=lambda r: r["own_ms"], reverse=True)
    return rows[:top]


def measure(method: str, batch: int, context: int, steps: int, base: int, fused_ops: bool = False) -> dict:
    model = llama_1b_shaped("cuda", torch.bfloat16)
    if method != "none":
        lp.patch(model, method, fused_ops=fused_ops)
    ids = torch.randint(100, 128256, (batch, context), generator=torch.Generator().manual_seed(0)).cuda()
    row: dict = {"method": method, "batch": batch, "context": context, "steps": steps, "decode_base": base,
                 "fused_ops": fused_ops}
    with torch.no_grad():
        timed_generate(model, ids, base + 2, {}, base)  # kernels compiled, graphs captured
        _, dec = timed_generate(model, ids, base + steps, {}, base)
        row["generate_ms"] = dec * 1e3 / steps
        arg = cache_argument(model.forward)
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        cache = out.past_key_values
        nxt = _loop(model, out.logits[:, -1:].argmax(-1), cache, base)
        row["loop_ms"] = _events_ms(lambda: _loop(model, nxt, cache, steps), steps)
        store = getattr(cache, "_decode_graphs", None)
        # back-to-back replays need graphs that cycle (lola/lolcats: one per step of a chunk); a single graph (a
        # cache that grows, e.g. exact) replayed without the host's bookkeeping would write past its room
        if store is not None and len(store.graphs) > 1:
            graphs = [e.graph for e in store.graphs.values()]
            row["graphs"] = len(graphs)

            def replay_all():
                for _ in range(max(1, steps // len(graphs))):
                    for g in graphs:
                        g.replay()

            replay_all()
            n = max(1, steps // len(graphs)) * len(graphs)
            row["replay_ms"] = _events_ms(replay_all, n)
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for g in graphs[: min(8, len(graphs))]:
                    g.replay()
                torch.cuda.synchronize()
            k = min(8, len(graphs))
            evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            row["kernels_per_step"] = len(evs) / k
            row["kernel_ms"] = sum(e.device_time_total for e in evs) / 1e3 / k
            kinds: dict[str, list[float]] = {}  # kind -> [count, ms] per step
            for e in evs:
                c = kinds.setdefault(kernel_kind(e.name), [0.0, 0.0])
                c[0] += 1 / k
                c[1] += e.device_time_total / 1e3 / k
            row["kernels_by_kind"] = {n: {"per_step": round(c, 1), "ms": round(t, 4)}
                                      for n, (c, t) in sorted(kinds.items(), key=lambda kv: -kv[1][1])}
        else:
            row["graphs"] = len(store.graphs) if store is not None else 0
        del cache, out
        row["host_profile"] = _host_profile(model, ids, base + steps)
    print(json.dumps({k: v for k, v in row.items() if k != "host_profile"}))
    for r in row["host_profile"][:12]:
        print(f"  {r['own_ms']:8.1f} ms own {r['cumulative_ms']:8.1f} cum x{r['calls']:6d} {r['function'][:90]}")
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", default="lolcats", help="a method name, or none (unpatched)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", default="32k")
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--decode-base", type=int, default=81, help="steps before the measured ones (captures)")
    ap.add_argument("--fused-ops", action="store_true", help="patch with fused_ops=True (the model's RMSNorm, "
                    "rotary and SiLU MLP as fused kernels)")
    ap.add_argument("--out", default=None, help="file (default benchmarks/results/decode/anatomy-METHOD-bB-<device>.json)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    row = measure(args.method, args.batch, parse_sizes(args.context)[0], args.steps, args.decode_base, args.fused_ops)
    record = {"task": "decode-anatomy", "device": device_description("cuda"), "date": datetime.date.today().isoformat(),
              "commit": git_commit(), "command": "python3 -m benchmarks.generate.bench_decode_step_anatomy " + shlex.join(sys.argv[1:]),
              "model": "llama-3.2-1b-shaped-random", **row}
    fused = "-fused" if args.fused_ops else ""
    out = result_file("decode", f"anatomy-{args.method}-b{args.batch}{fused}-{device_token()}.json", args.out)
    with open(out, "w") as f:
        json.dump(record, f, indent=1)
    print("wrote", out)


if __name__ == "__main__":
    main()
