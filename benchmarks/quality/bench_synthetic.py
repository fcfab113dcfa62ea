"""Reduced GPU sweep of the synthetic benchmarks (ICR basic, ICR positional, ICL) within a time budget.

    python3 -m benchmarks.quality.bench_synthetic --budget 240 --workers 8 --out $OUT --commit abc1234
    python3 -m benchmarks.quality.bench_synthetic --cpu-smoke --out /tmp/smoke   # tiny CPU smoke run

1. Probe: every mixer trains a few timed steps at the longest length (kernels warmed up). A mixer whose
   default (Triton on CUDA) path fails is retried with ``backend=torch``; the fallback is recorded.
2. Steps: one number for every mixer, task, learning rate and seed (same budget), chosen from the probed
   step times so that the whole sweep fits the budget with ``--workers`` processes sharing the GPU
   (assumed parallel speed-up ``--speedup``, default workers / 3). A deadline guards the budget: a run
   stopped by it reports ``steps_done`` < steps.
3. All runs go through one process pool; after each run ``<prefix>-partial.json`` is written. At the end, per
   task, ``<prefix>-<task>.json`` + ``-length.png`` + ``-state.png`` (fields device, date, commit, command) and
   the tables are printed; the prefix is ``<device>-<run>`` (benchmarks/README.md, results), e.g. ``h200-seeds``.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import multiprocessing as mp
import os
import shlex
import sys
import time

import torch

from benchmarks.shared import device_token, results_dir
from longctx_patch.evals import synthetic as M
from longctx_patch.evals.common import parse_sizes
from longctx_patch.provenance import device_description
from longctx_patch.evals.synthetic.icl import IclConfig, IclTask
from longctx_patch.evals.synthetic.icr import IcrConfig, IcrTask
from longctx_patch.evals.synthetic.train import _job

GPU_MIXERS = "softmax,sliding(window=1024),linear,vq(codes=512),ovq,lola"


def make_tasks(names, args):
    tasks = {}
    for n in names:
        if n == "icr-basic":
            tasks[n] = IcrTask(IcrConfig(variant="basic", num_keys=args.num_keys, num_values=args.num_values))
        elif n == "icr-positional":
            tasks[n] = IcrTask(IcrConfig(variant="positional", num_keys=args.num_keys, num_values=args.num_values))
        elif n == "icl":
            tasks[n] = IclTask(IclConfig(num_functions=args.functions, dim=args.icl_dim, segment=4))
        else:
            raise SystemExit(f"unknown task {n!r}; choose from icr-basic, icr-positional, icl")
    return tasks


def probe(task, spec, L, mcfg, tcfg, n_timed=3):
    """Seconds per training step at length L (after two warm-up steps), or raises."""
    dev = torch.device(tcfg.device)
    torch.manual_seed(0)
    model = M.SyntheticLM(task.vocab_size, task.feat_dim, task.out_dim, spec, mcfg).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    bs = max(1, tcfg.tokens_per_step // L)
    batch = {k: v.to(dev) for k, v in task.sample(L, bs, 0).items()}
    times = []
    for i in range(2 + n_timed):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = model(**task.model_inputs(batch))
        loss = task.loss(out, batch)
        aux = model.aux_loss()
        (loss + aux if aux is not None else loss).backward()
        opt.step()
        opt.zero_grad()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - t)
    with torch.no_grad():  # the evaluation path too (LoLA's cache manager runs only there)
        model.eval()
        model(**task.model_inputs(batch))
    return sorted(times)[len(times) // 2]


def with_option(spec, key, value):
    opts = dict(spec.options)
    opts[key] = value
    return M.MixerSpec(spec.name, tuple(opts.items()))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", type=float, default=240.0, help="seconds for the whole script")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--speedup", type=float, default=None,
                    help="assumed parallel speed-up (default workers / 3: 8 processes on one H200 measured ~3x)")
    ap.add_argument("--prefix", default=None,
                    help="result file prefix, <device>-<run> (default <gpu>-sweep, or cpu-smoke with --cpu-smoke)")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="folder (default $OUT, else benchmarks/results/synthetic)")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--tasks", default="icr-basic,icr-positional,icl")
    ap.add_argument("--mixers", default=GPU_MIXERS)
    ap.add_argument("--lengths", default="512,1k,2k,4k")
    ap.add_argument("--icl-lengths", default="2k")
    ap.add_argument("--functions", type=int, default=16)
    ap.add_argument("--icl-dim", type=int, default=8)
    ap.add_argument("--num-keys", type=int, default=1024)
    ap.add_argument("--num-values", type=int, default=1024)
    ap.add_argument("--lrs", default="3e-4,1e-3,3e-3")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--tokens-per-step", type=int, default=8192)
    ap.add_argument("--eval-sequences", type=int, default=32)
    ap.add_argument("--max-steps", type=int, default=4000)
    ap.add_argument("--min-steps", type=int, default=40)
    ap.add_argument("--steps", type=int, default=None, help="fixed steps (skips the budget rule)")
    ap.add_argument("--curriculum", default=None, metavar="LENGTH:FRACTION",
                    help="the first FRACTION of the steps at LENGTH tokens only (e.g. 64:0.25; README, synthetic section)")
    ap.add_argument("--eval-reserve", type=float, default=30.0, help="seconds kept for evaluation and writing")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on the CPU, labelled as a smoke run")
    args = ap.parse_args()
    t0 = time.time()
    command = shlex.join(["python3", "-m", "benchmarks.quality.bench_synthetic", *sys.argv[1:]])
    if args.cpu_smoke:
        args.mixers = "softmax,sliding(window=32),linear(chunk=32),hedgehog(chunk=32),vq(chunk=32,codes=32)," \
                      "ovq(chunk=32,max_centroids=32,growth=16),lolcats(window=32,chunk=32)," \
                      "lola(window=32,chunk=32,sparse=16)"
        args.lengths, args.icl_lengths = "128,256", "256"
        args.d_model, args.layers, args.heads = 32, 2, 2
        args.num_keys = args.num_values = 64
        args.functions, args.icl_dim = 4, 4
        args.tokens_per_step, args.eval_sequences = 1024, 16
        args.steps = args.steps or 150
        args.workers = 1
    device = "cuda" if torch.cuda.is_available() and not args.cpu_smoke else "cpu"
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    out = results_dir("synthetic", args.out)
    prefix = args.prefix or ("cpu-smoke" if args.cpu_smoke else f"{device_token() if device == 'cuda' else 'cpu'}-sweep")
    lengths, icl_lengths = parse_sizes(args.lengths), parse_sizes(args.icl_lengths)
    tasks = make_tasks([t for t in args.tasks.split(",") if t], args)
    task_lengths = {n: (icl_lengths if n == "icl" else lengths) for n in tasks}
    specs = M.parse_mixers(args.mixers)
    c_len, c_frac = M.parse_curriculum(args.curriculum)
    for n, t in tasks.items():  # refuse a length the task cannot hold (keys, curriculum) before any device time
        t.check_lengths(list(task_lengths[n]) + ([c_len] if c_len else []))
    mcfg = M.ModelConfig(d_model=args.d_model, n_layers=args.layers, n_heads=args.heads).validate()
    lrs = tuple(float(x) for x in args.lrs.split(","))
    seeds = tuple(int(x) for x in args.seeds.split(","))
    base = M.TrainConfig(steps=1, lrs=lrs, seeds=seeds, tokens_per_step=args.tokens_per_step,
                         eval_sequences=args.eval_sequences, device=device, log_every=25)
    print(f"device: {device_description(device)}; tasks {list(tasks)}; mixers {[s.label for s in specs]}", flush=True)

    # 1. probe
    notes = {}
    step_s = {}
    probe_task = next(iter(tasks.values()))
    Lp = max(max(v) for v in task_lengths.values())
    kept = []
    for s in specs:
        try:
            step_s[s.label] = probe(probe_task, s, Lp, mcfg, base)
            kept.append(s)
        except Exception as e:  # noqa: BLE001
            if getattr(s.config, "backend", None) == "auto":
                s2 = with_option(s, "backend", "torch")
                try:
                    step_s[s2.label] = probe(probe_task, s2, Lp, mcfg, base)
                    notes[s.label] = f"default backend failed ({type(e).__name__}: {str(e)[:200]}); ran {s2.label}"
                    kept.append(s2)
                    continue
                except Exception as e2:  # noqa: BLE001
                    e = e2
            notes[s.label] = f"dropped: {type(e).__name__}: {str(e)[:300]}"
        print(f"probe {s.label}: {step_s.get(s.label, float('nan')) * 1e3:.1f} ms/step at {Lp} "
              f"({notes.get(s.label, 'ok')})", flush=True)
    specs = kept
    n_jobs_per_mixer = len(lrs) * len(seeds) * len(tasks)
    serial = sum(step_s[s.label] for s in specs) * n_jobs_per_mixer
    speedup = args.speedup or max(1.0, args.workers / 3)
    window = args.budget - (time.time() - t0) - args.eval_reserve - 15.0  # 15 s: starting the worker processes
    if args.steps:
        steps = args.steps
    else:
        steps = int(window * speedup / max(serial, 1e-9))
        steps = max(args.min_steps, min(args.max_steps, steps))
    deadline = t0 + args.budget - args.eval_reserve if not args.cpu_smoke else None
    print(f"steps per run: {steps} (train window {window:.0f} s, serial estimate {serial * steps:.0f} s, "
          f"assumed speed-up {speedup})", flush=True)
    tcfg = M.TrainConfig(steps=steps, lrs=lrs, seeds=seeds, tokens_per_step=args.tokens_per_step,
                         eval_sequences=args.eval_sequences, device=device, log_every=25,
                         curriculum_length=c_len, curriculum_fraction=c_frac).validate()

    # 2. runs
    # order: learning rate and seed outermost, so that a deadline cut shortens the same (last) learning rate of
    # every mixer instead of every run of the cheapest mixers; the costly mixers first inside each round
    jobs = []
    for lr in lrs:
        for seed in seeds:
            for tname, task in tasks.items():
                for s in sorted(specs, key=lambda s: -step_s[s.label]):
                    jobs.append((tname, (task, s, task_lengths[tname], mcfg, tcfg, lr, seed, None, deadline)))
    records = {t: [] for t in tasks}

    def save_partial():
        (out / f"{prefix}-partial.json").write_text(json.dumps({"steps": steps, "notes": notes, "records": records},
                                                               indent=1, default=str))

    if args.workers <= 1:
        for tname, j in jobs:
            records[tname].append(_job(j))
            r = records[tname][-1]
            print(f"[{time.time() - t0:5.0f}s] {tname} {r['mixer']} lr={r['lr']:g}: "
                  f"{r.get('error') or {L: round(next(iter(e.values())), 3) for L, e in r['eval'].items()}}", flush=True)
            save_partial()
    else:
        with cf.ProcessPoolExecutor(max_workers=args.workers, mp_context=mp.get_context("spawn")) as ex:
            futs = {ex.submit(_job, j): tname for tname, j in jobs}
            for f in cf.as_completed(futs):
                tname = futs[f]
                r = f.result()
                records[tname].append(r)
                summary = r.get("error") or {L: round(next(iter(e.values())), 3) for L, e in r.get("eval", {}).items()}
                print(f"[{time.time() - t0:5.0f}s] {tname} {r['mixer']} lr={r['lr']:g} steps={r.get('steps_done')}: "
                      f"{summary}", flush=True)
                save_partial()

    # 3. reports
    label = "CPU smoke run (tiny sizes, not a benchmark)" if args.cpu_smoke else f"reduced sweep on {device}"
    for tname, task in tasks.items():
        path = out / f"{prefix}-{tname}.json"
        extra = {"probe_step_seconds": {s.label: step_s[s.label] for s in specs}, "probe_length": Lp,
                 "notes": notes, "steps_rule": "same steps for every run; from the probed step times and the budget",
                 "budget_s": args.budget, "workers": args.workers, "smoke": bool(args.cpu_smoke),
                 "wall_s": round(time.time() - t0, 1)}
        try:
            text, _ = M.write_report(path, task, specs, records[tname], task_lengths[tname], mcfg, tcfg,
                                     label=f"{tname}: {label}", command=command, extra=extra)
        except Exception as e:  # noqa: BLE001 - plots are optional, the numbers are not
            print(f"plotting failed ({e}); writing the JSON only", flush=True)
            text, _ = M.write_report(path, task, specs, records[tname], task_lengths[tname], mcfg, tcfg,
                                     label=f"{tname}: {label}", command=command, plots=False, extra=extra)
        if args.commit:  # the device's copy of the tree may have no git metadata
            data = json.loads(path.read_text())
            data["commit"] = args.commit
            path.write_text(json.dumps(data, indent=1) + "\n")
        print(f"\n== {tname} ({label}; {steps} steps, lrs {lrs}, seeds {seeds}) ==\n{text}", flush=True)
    print(f"total {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
