"""Throughput of the fine-tune trainer's stages (attention transfer, LoRA next-token) on a SmolLM2-135M-shaped
random-weight model patched with lolcats (recipes/linearize.yaml) or OVQ (recipes/ovq-finetune.yaml, every layer or
the OVQ + sliding-window hybrid), or unpatched (the OVQ recipe's LoRA stage alone, its reference): tokens/s, peak
memory and a step-time breakdown (forward, backward, optimizer), through the runner's own step
(`Finetuner.train_step`) and the stages of a recipe.

    python3 -m benchmarks.train.bench_train_throughput [--batch 8,16] [--seq 4096] [--stages transfer,lora] [--compile]
        [--grad-checkpointing] [--steps 5] [--warmup 2] [--profile] [--out FILE]
    python3 -m benchmarks.train.bench_train_throughput --method ovq [--batch 8] [--seq 4096]   # calibrate, finetune
    python3 -m benchmarks.train.bench_train_throughput --device cpu --seq 256 --batch 1 --layers 2   # smoke test
    python3 -m benchmarks.train.bench_train_throughput --merge DIR --out FILE   # the rows of DIR/*.json in one file

One row per (stage, batch); a batch that runs out of memory gives a row with its error. Writes device, date, commit
(LONGCTX_COMMIT or git), command and the rows to --out (default benchmarks/results/finetune/train-throughput-<device>.json).
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.shared import REPO_ROOT, device_token, kernel_kind, lora_stage_only, result_file
from longctx_patch.provenance import device_description, git_commit

# SmolLM2-135M (HuggingFaceTB/SmolLM2-135M config.json)
SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0,
                    rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=0, eos_token_id=0)


class _NoTokenizer:
    """The runner asks for a tokenizer beside a given model; the benchmark feeds random token ids."""


# --method: (default recipe, default stages)
METHODS = {"lolcats": ("linearize.yaml", "transfer,lora"), "ovq": ("ovq-finetune.yaml", "calibrate,finetune"),
           "ovq-hybrid": ("ovq-finetune.yaml", "calibrate,finetune"), "none": ("ovq-finetune.yaml", "finetune")}


def method_overrides(args) -> list[str]:
    """The recipe overrides of --method: the OVQ paper's hybrid (OVQ on even layers, a 256-token sliding window on
    the others), or the reference of the OVQ fine-tune (the same LoRA stage on the unpatched model)."""
    if args.method == "ovq-hybrid":
        return [f"layers={list(range(0, args.layers, 2))}", "rest_method=sliding-window", "rest_config={window: 256}"]
    if args.method == "none":
        return ["method=null", "method_config={}", lora_stage_only(args.recipe)]
    return []


def build_model(layers: int, dtype: torch.dtype, device: str, vocab: int | None = None, recipe=None):
    """The random-weight SmolLM2-shaped model, patched as `recipe` says (None: lolcats as recipes/linearize.yaml
    starts, without its shipped weights)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import longctx_patch as lp

    cfg = dict(SMOLLM2_135M, num_hidden_layers=layers)
    if vocab:
        cfg["vocab_size"] = vocab
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs (a CPU init of 135M parameters takes seconds)
        model = LlamaForCausalLM(LlamaConfig(**cfg)).to(dtype=dtype)
    if recipe is None:
        lp.patch(model, "lolcats", checkpoint="none", init_window_factor=-2.197)
    elif recipe.method:  # as the runner patches a loaded model (Finetuner.load)
        lp.patch(model, recipe.method, layers=recipe.layers, **recipe.method_config)
        rest = [i for i in range(layers) if i not in set(recipe.layers or [])]
        if recipe.rest_method and rest:
            lp.patch(model, recipe.rest_method, layers=rest, **recipe.rest_config)
    return model


def overrides(args, batch: int) -> list[str]:
    out = method_overrides(args)
    for name in args.stages:
        out += [f"stages.{name}.batch_size={batch}", f"stages.{name}.seq_len={args.seq}",
                f"stages.{name}.gradient_checkpointing={str(args.grad_checkpointing).lower()}",
                f"stages.{name}.compile={str(args.compile).lower()}",
                f"stages.{name}.fused_loss={str(not args.no_fused_loss).lower()}",
                f"stages.{name}.steps={args.warmup + args.steps}", f"stages.{name}.warmup=1"]
        if args.attention_checkpointing != "recipe":  # else the recipe's own (linearize.yaml: off for transfer)
            out.append(f"stages.{name}.attention_checkpointing={str(args.attention_checkpointing == 'on').lower()}")
    return out


def set_kernel_tuning(model, tuning) -> int:
    """Passes `tuning` (kernels/lola/tuning.LolaTuning) to the model's patched LoLA/LoLCATs layers (their `tuning`);
    returns how many took it."""
    from longctx_patch.kernels.lola.tuning import LolaTuning
    from longctx_patch.patch_state import find_state

    st = find_state(model)
    mods = [m for m in (st.modules.values() if st is not None else ()) if isinstance(getattr(m, "tuning", None),
                                                                                      LolaTuning)]
    for m in mods:
        m.tuning = tuning
    return len(mods)


def time_stage(ft, stage, args, device) -> dict:
    """Warm-up steps, then `args.steps` timed steps of `stage` through the runner's own step."""
    from longctx_patch.train.stage_loop import lr_lambda, make_optimizer
    from longctx_patch.timing import StepTimer

    acc = ft.accelerator
    cuda = device.type == "cuda"
    params = ft.setup_stage(stage)
    set_kernel_tuning(ft.model, args.tuning)
    ft.enter_stage_modes(stage)
    trainable = [p for _, p in params]
    optimizer = make_optimizer(ft.param_groups(stage, params), stage, fused=cuda)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(stage))
    ft.root.train()
    model, optimizer = acc.prepare(ft.root, optimizer)
    vocab = ft.model.config.vocab_size
    gen = torch.Generator(device="cpu").manual_seed(1)
    timer = StepTimer(device)
    steps, losses = [], []
    try:
        with ft._objective(stage) as transfer:
            for i in range(args.warmup + args.steps):
                batch = torch.randint(3, vocab, (stage.batch_size, stage.seq_len), generator=gen).to(device)
                if cuda and i == args.warmup:
                    torch.cuda.reset_peak_memory_stats(device)
                timer.start()
                loss, _ = ft.train_step(model, optimizer, scheduler, [batch], stage, transfer, trainable, timer)
                t = timer.finish()  # waits for the step: one host sync per step, outside it
                if i >= args.warmup:
                    steps.append(t)
                    losses.append(float(loss))
            if args.profile:  # one more step, its kernels by device time
                batch = torch.randint(3, vocab, (stage.batch_size, stage.seq_len), generator=gen).to(device)

                def one_step():
                    timer.start()
                    ft.train_step(model, optimizer, scheduler, [batch], stage, transfer, trainable, timer)
                    timer.finish()

                profile = profile_step(one_step, cuda)
    finally:
        ft.root = acc.unwrap_model(model, keep_fp32_wrapper=False)
        ft.leave_stage_modes(stage)
        del optimizer, scheduler
        acc.free_memory()
    tokens = stage.batch_size * stage.seq_len
    mean = {k: sum(s[k] for s in steps) / len(steps) for k in steps[0]}
    return ({"profile": profile} if args.profile else {}) | {
        "tokens_per_step": tokens,
        "step_ms": round(mean["total"], 3),
        "tokens_per_s": round(tokens / (mean["total"] / 1e3), 1),
        "breakdown_ms": {k: round(v, 3) for k, v in mean.items() if k != "total"},
        "step_ms_all": [round(s["total"], 3) for s in steps],
        "peak_memory_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 3) if cuda else None,
        "trainable_params": int(sum(p.numel() for p in trainable)),
        "loss": losses,
    }


def profile_step(step, cuda: bool, top: int = 30) -> dict:
    """One call of `step` under torch.profiler: its kernels (CUDA) or ops (CPU) by self time, the top `top` of them,
    the time by kind (GEMM, attention, Triton, copies and casts, reductions, elementwise, other) and the count."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=acts) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if (e.self_device_time_total if cuda else e.self_cpu_time_total) > 0]
    ms = {e.key: (e.self_device_time_total if cuda else e.self_cpu_time_total) / 1e3 for e in events}
    kinds: dict[str, float] = {}
    for e in events:
        kinds[kernel_kind(e.key)] = kinds.get(kernel_kind(e.key), 0.0) + ms[e.key]
    events.sort(key=lambda e: -ms[e.key])
    return {
        "timer": "device" if cuda else "cpu (ops, children excluded)",
        "total_ms": round(sum(ms.values()), 3),
        "launches": int(sum(e.count for e in events)),
        "by_kind_ms": {k: round(v, 3) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
        "top": [{"name": e.key[:120], "calls": e.count, "ms": round(ms[e.key], 3), "kind": kernel_kind(e.key)}
                for e in events[:top]],
    }


def run_batch(args, batch: int, device: torch.device) -> list[dict]:
    from longctx_patch.train.recipe import load_recipe
    from longctx_patch.train.runner import Finetuner

    recipe = load_recipe(args.recipe, overrides(args, batch))
    recipe.mixed_precision = "bf16" if device.type == "cuda" else "no"
    recipe.frozen_dtype = args.frozen_dtype
    dtype = getattr(torch, args.dtype)
    model = build_model(args.layers, dtype, str(device), args.vocab, None if args.method == "lolcats" else recipe)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        ft = Finetuner(recipe, tmp, progress=False, model=model, tokenizer=_NoTokenizer(), command="bench")
        ft.load()
        for stage in recipe.stages:
            if stage.name not in args.stages:
                continue
            row = {"stage": stage.name, "objective": stage.objective, "batch": batch, "seq": args.seq,
                   "gradient_checkpointing": stage.gradient_checkpointing, "compile": stage.compile,
                   "attention_checkpointing": stage.attention_checkpointing, "fused_loss": stage.fused_loss,
                   "frozen_dtype": args.frozen_dtype}
            try:
                row.update(time_stage(ft, stage, args, device))
            except torch.OutOfMemoryError as e:
                row["error"] = f"out of memory: {str(e).splitlines()[0]}"
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k not in ("step_ms_all", "loss", "profile")}), flush=True)
            if "profile" in row:
                pr = row["profile"]
                print(f"  profile: {pr['total_ms']} ms in {pr['launches']} launches; by kind {pr['by_kind_ms']}")
                for e in pr["top"][:12]:
                    print(f"    {e['ms']:9.3f} ms x {e['calls']:5d}  [{e['kind']}] {e['name']}")
            if device.type == "cuda":
                torch.cuda.empty_cache()
    del model, ft
    return rows


def merge(folder: Path) -> dict:
    files = sorted(folder.glob("*.json"))
    if not files:
        raise SystemExit(f"--merge: no *.json files in {folder}")
    runs = [json.loads(f.read_text()) for f in files]
    head = {k: runs[0][k] for k in ("device", "date")}
    # runs from several commits (a sweep re-run after a fix): every commit named, and each row keeps its own
    head["commit"] = " ".join(dict.fromkeys(r["commit"] for r in runs))
    head["command"] = " ; ".join(r["command"] for r in runs)
    head["rows"] = [dict(row, config=r.get("config", {}), commit=r["commit"], date=r["date"])
                    for r in runs for row in r["rows"]]
    return head


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", default="8", help="comma-separated batch sizes (sequences per step)")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--vocab", type=int, default=None, help="vocabulary size (default SmolLM2's 49152)")
    ap.add_argument("--method", default="lolcats", choices=sorted(METHODS),
                    help="lolcats: recipes/linearize.yaml's stages; ovq / ovq-hybrid: recipes/ovq-finetune.yaml's, on "
                         "every layer or on even layers with a 256-token sliding window on the others; none: that "
                         "recipe's LoRA stage on the unpatched model")
    ap.add_argument("--stages", default=None, help="stages of the recipe to time (default: the method's recipe's)")
    ap.add_argument("--recipe", default=None, help="default: the method's (see --method)")
    ap.add_argument("--dtype", default="float32", choices=("bfloat16", "float32"),
                    help="weights' dtype (bf16 autocast on CUDA either way); float32 is what recipes/linearize.yaml "
                         "loads (rows before 2026-12-02 were measured with bfloat16 weights)")
    ap.add_argument("--frozen-dtype", default="auto", choices=("auto", "keep"),
                    help="recipe key frozen_dtype: auto holds the base weights in bf16 under bf16 autocast (rows before "
                         "2026-12-03 had keep)")
    ap.add_argument("--fmap-prec", default="auto", choices=("auto", "ieee", "tf32x3"),
                    help="the feature map's projection with fp32 weights (LolaTuning.fmap_prec): the kernels' "
                         "choice (auto: tf32x3 on a GPU with tf32, since 2026-12-03), fp32 products (ieee: rows before "
                         "that date) or three tf32 tensor-core products (tf32x3, fp32's accuracy)")
    ap.add_argument("--tune", action="append", default=[], metavar="KEY=INT",
                    help="set a LoLA/LoLCATs kernel setting (kernels/lola/tuning.py LolaTuning), e.g. train_state_chunk=128; "
                         "repeatable")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--compile", action="store_true", help="stage option compile: torch.compile each decoder layer")
    ap.add_argument("--grad-checkpointing", action="store_true", help="stage option gradient_checkpointing")
    ap.add_argument("--attention-checkpointing", choices=("recipe", "on", "off"), default="recipe",
                    help="stage option attention_checkpointing: recompute the patched attentions in the backward (on) "
                         "or keep their intermediates (off); default: as the recipe says")
    ap.add_argument("--no-attention-checkpointing", dest="attention_checkpointing", action="store_const", const="off",
                    help="the same as --attention-checkpointing off")
    ap.add_argument("--no-fused-loss", action="store_true", help="the model's own loss (stage option fused_loss: false)")
    ap.add_argument("--profile", action="store_true", help="also profile one more step: its kernels by device time, "
                    "grouped by kind (GEMM, attention, Triton, copies, reductions, elementwise), in the row's 'profile'")
    ap.add_argument("--merge", default=None, help="merge the result files of this folder into --out and exit")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    command = "python3 -m benchmarks.train.bench_train_throughput " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    if args.merge:
        out = Path(args.out or "train-throughput.json")
        out.write_text(json.dumps(merge(Path(args.merge)), indent=1) + "\n")
        return out
    recipe_name, stages = METHODS[args.method]
    args.recipe = args.recipe or str(REPO_ROOT / "recipes" / recipe_name)
    args.stages = (args.stages or stages).split(",")
    from longctx_patch.kernels.lola.tuning import DEFAULT_TUNING

    tune = {}
    for kv in args.tune:
        key, _, val = kv.partition("=")
        settings = DEFAULT_TUNING.launch_settings()
        if key not in settings or not val.lstrip("-").isdigit():
            ap.error(f"--tune {kv!r}: expected KEY=INT with KEY one of {', '.join(sorted(settings))}")
        tune[key] = int(val)
    # what the patched LoLA/LoLCATs layers pass to their kernels (set on the modules: `set_kernel_tuning`)
    args.tuning = DEFAULT_TUNING.replace(**tune, **({"fmap_prec": args.fmap_prec} if args.fmap_prec != "auto" else {}))
    device = torch.device(args.device)
    rows = []
    for b in [int(x) for x in args.batch.split(",")]:
        rows += run_batch(args, b, device)
    res = {
        "task": "finetune",
        "device": device_description(device),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "command": command,
        "config": {"model": "SmolLM2-135M-shaped, random weights", "layers": args.layers, "dtype": args.dtype,
                   "method": args.method, "recipe": Path(args.recipe).name, "fmap_prec": args.fmap_prec,
                   "tune": tune, "steps": args.steps, "warmup": args.warmup, "torch": torch.__version__},
        "rows": rows,
    }
    name = f"train-throughput-{device_token(str(device)) if device.type == 'cuda' else 'cpu'}.json"
    out = result_file("finetune", name, args.out)
    out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {out}", flush=True)
    return out


if __name__ == "__main__":
    main()
