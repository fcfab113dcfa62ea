"""Model-level speed: what a user of `patch()` then `model.generate()` meets, against plain transformers.

For each method, batch size and context length, on random prompts:
- prefill: median seconds of `model(ids, use_cache=True)` (logits of the last position only, as generate());
- decode: inside one `generate()` call of B + N new tokens (greedy, `min_new_tokens` so that no row stops early),
  the time of its steps B .. B+N-1, marked by CUDA events a logits processor records after each step (no
  synchronisation: the steps run as unobserved; the prefill's jitter stays out), the median of `repeats` calls:
  tokens/s (batch x N / seconds) and ms per step;
- the bytes floor of a step: (weight bytes read per step + the attention state at that context) / the device's
  measured copy bandwidth, and the step's ratio to it;
- peak device memory (CUDA) and the decode-time attention state the patched layers report.

`static=True` adds plain transformers with its static cache (`cache_implementation="static"`), which
transformers compiles with `torch.compile` on CUDA: the best a user gets without this package. A cell that runs
out of memory records the error and the run goes on.
"""

from __future__ import annotations

import inspect
import statistics
import time
from pathlib import Path
from typing import Any, Sequence

from ..decode_graphs import default_enabled
from ..errors import ConfigError
from .common import (RESULTS_DEFAULT, MethodRun, applied, begin_run, default_name, format_table, load_model,
                     output_dir, pyplot, size_label, write_result)

STATIC = "none(static cache, compiled)"  # the label of plain transformers with its static cache


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device, nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes moved per second (read + written) by a device-to-device copy of `nbytes` (the median of `repeats`);
    on the CPU a smaller buffer (64 MiB)."""
    import torch

    if device.type != "cuda":
        nbytes = min(nbytes, 64 << 20)
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 1):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - t0)
    del src, dst
    return 2 * nbytes / statistics.median(times[1:])


def weight_bytes(model) -> int:
    """Bytes of the parameters a decode step reads: all of them but an untied input embedding (a step reads only
    the batch's rows of it)."""
    emb = model.get_input_embeddings().weight
    out = model.get_output_embeddings()
    tied = out is not None and out.weight.data_ptr() == emb.data_ptr()
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return total if tied else total - emb.numel() * emb.element_size()


def full_kv_bytes(model, context: int, batch: int = 1) -> int:
    """Bytes of the unpatched model's K/V cache after `context` tokens, in the model's dtype (every layer)."""
    import torch

    from ..architectures import model_config

    cfg = model_config(model)
    elt = torch.tensor([], dtype=next(model.parameters()).dtype).element_size()
    hkv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * batch * hkv * context * hd * elt * cfg.num_hidden_layers


def state_bytes(model, context: int, batch: int = 1) -> int:
    """Decode-time attention state of the whole model at `context` tokens (full K/V for unpatched layers)."""
    from ..architectures import model_config
    from ..patcher import is_patched, patched_modules

    n = model_config(model).num_hidden_layers
    dtype = next(model.parameters()).dtype
    full_layer = full_kv_bytes(model, context, batch) // n
    mods = patched_modules(model) if is_patched(model) else {}
    return int(sum(mods[i].state_bytes(context, batch, dtype) if i in mods else full_layer for i in range(n)))


class _StepMarks:
    """A logits processor that marks the end of each generate() step with a `StepTimer` (CUDA events recorded on
    the current stream, no synchronisation: the steps run as they would unobserved; the host clock on a CPU). Step
    i's mark follows forward i (forward 0 is the prefill)."""

    def __init__(self, device):
        from ..timing import StepTimer

        self.timer = StepTimer(device)
        self.timer.start()
        self.steps = 0

    def __call__(self, input_ids, scores):
        self.timer.mark("step")
        self.steps += 1
        return scores

    def seconds(self, a: int, b: int) -> float:
        """Seconds from the end of step a to the end of step b (the forwards a+1 .. b)."""
        return self.timer.span_ms(a + 1, b + 1) / 1e3


RANGES = ((1, 16), (17, 64), (65, 128), (129, 256))  # decode steps whose mean ms a cell reports (1 = the first)


def timed_generate(model, ids, new_tokens: int, extra: dict, marked: bool = False):
    """One greedy generate() call of `new_tokens` tokens: its wall seconds; `marked`: also the milliseconds of each
    forward (0: the prefill with the first token, then one per decode step), from CUDA events a logits processor
    records after each step (no synchronisation: the steps run as they would unobserved)."""
    import torch
    from transformers import LogitsProcessorList

    device = ids.device
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
              attention_mask=torch.ones_like(ids), pad_token_id=0, **extra)
    _sync(device)
    marks = _StepMarks(device) if marked else None
    if marks is not None:
        kw["logits_processor"] = LogitsProcessorList([marks])
    t0 = time.perf_counter()
    model.generate(ids, **kw)
    _sync(device)
    total = time.perf_counter() - t0
    if marks is None:
        return total
    if marks.steps != new_tokens:
        raise RuntimeError(f"generate() ran {marks.steps} steps for {new_tokens} new tokens")
    return total, [marks.timer.span_ms(i, i + 1) for i in range(new_tokens)]


def _prefill(model, ids, chunk: int | None, last: dict) -> None:
    """`model(ids, use_cache=True)`, or chunk by chunk through the cache (as generate()'s `prefill_chunk_size`)."""
    if not chunk:
        model(input_ids=ids, use_cache=True, **last)
        return
    from ..cache import cache_argument

    cache = None
    name = cache_argument(model.forward)
    for s in range(0, ids.shape[1], chunk):
        cache = model(input_ids=ids[:, s:s + chunk], use_cache=True, **{name: cache}, **last).past_key_values


def step_ranges(step_ms: list[float]) -> dict[str, float]:
    """Mean milliseconds of the decode steps in each of RANGES that the call reached (step_ms[0] is the prefill)."""
    out = {}
    for a, b in RANGES:
        part = step_ms[a:b + 1]
        if part:
            out[f"{a}-{b}"] = round(sum(part) / len(part), 4)
    return out


def time_cell(model, *, batch: int, context: int, calls: Sequence[int], repeats: int, vocab: int, bandwidth: float,
              weights: int, generate_kwargs: dict | None = None, seed: int = 0,
              prefill_chunk: int | None = None) -> dict[str, Any]:
    """One (batch, context) cell of one method, as a user meets it: the prefill (median of `repeats`), then one
    generate() call per entry of `calls` (new tokens), in order, each timed whole and step by step from its first
    decode step: tokens/s over the call's whole decode (steps 1 .. N-1: batch x (N-1) tokens), the mean ms of the
    steps in each of RANGES, the steady state (the last range the longest call reached) and the warm-up ratio (steps
    1-16 against it), peak memory of the call. A short call at this batch comes first (kernels compiled, decode
    graphs of this batch shape known: what any earlier call at this batch leaves). `prefill_chunk`: the prompt goes
    through the model in chunks of that many tokens (generate()'s `prefill_chunk_size`)."""
    import torch

    device = next(model.parameters()).device
    extra = dict(generate_kwargs or {})
    timed_prefill = not extra  # the static-cache row shares the unpatched prefill; its own is generate()'s
    if prefill_chunk:
        extra["prefill_chunk_size"] = prefill_chunk
    gen = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(min(100, vocab - 1), vocab, (batch, context), generator=gen).to(device)
    last = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    cuda = device.type == "cuda"
    prefill = []
    calls = sorted({int(n) for n in calls if int(n) >= 2})
    row: dict[str, Any] = {"calls": {}}
    with torch.no_grad():
        if timed_prefill:
            for _ in range(repeats):
                _sync(device)
                t0 = time.perf_counter()
                _prefill(model, ids, prefill_chunk, last)
                _sync(device)
                prefill.append(time.perf_counter() - t0)
        if "cache_implementation" in extra:
            # transformers compiles the static-cache decode step at the first generate() of a new cache length;
            # later calls of that length (and shorter ones: the cache keeps the longest length) reuse it, so one
            # untimed call keeps the compilation out of the times below
            timed_generate(model, ids, max(calls, default=2), extra)
        else:
            timed_generate(model, ids[:, :min(context, 2048)], 4, extra)  # the short call at this batch
        steps = None
        for n in calls:
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            total, steps = timed_generate(model, ids, n, extra, marked=True)
            decode_ms = sum(steps[1:])
            row["calls"][str(n)] = {
                "generate_s": round(total, 5), "prefill_s": round(steps[0] / 1e3, 5),
                "decode_tok_s": round(batch * (n - 1) / (decode_ms / 1e3), 2),
                "ms_per_step": round(decode_ms / (n - 1), 4), "step_ms": step_ranges(steps),
                "peak_mem_bytes": torch.cuda.max_memory_allocated(device) if cuda else None}
    state = state_bytes(model, context + max(calls, default=0), batch)
    # read once, at the rate a device copy moves bytes (its reads plus its writes): a copy of the same bytes takes
    # twice as long, since it also writes them
    floor_ms = 1e3 * (weights + state) / bandwidth
    row.update({
        "prefill_s": round(statistics.median(prefill), 5) if prefill else None,
        "decode_tok_s": None, "ms_per_step": None,
        "floor_ms": round(floor_ms, 4),
        "peak_mem_bytes": max((c["peak_mem_bytes"] for c in row["calls"].values()
                               if c["peak_mem_bytes"] is not None), default=None),
        "state_bytes": state,
    })
    if steps is not None:  # the longest call
        longest = row["calls"][str(calls[-1])]
        ranges = longest["step_ms"]
        steady = ranges[list(ranges)[-1]]
        row.update(decode_tok_s=longest["decode_tok_s"], ms_per_step=longest["ms_per_step"], step_ms=ranges,
                   steady_ms=steady, warmup_ratio=round(ranges["1-16"] / steady, 3) if "1-16" in ranges else None,
                   generate_s=longest["generate_s"], floor_ratio=round(steady / floor_ms, 3))
    return row


def _cell_or_error(fn, **kw) -> dict[str, Any]:
    import torch

    try:
        return fn(**kw)
    except torch.cuda.OutOfMemoryError as e:
        torch.cuda.empty_cache()
        return {"error": f"out of memory: {str(e).splitlines()[0]}"}


def run_model_speed(
    model,
    methods: Sequence[MethodRun],
    *,
    contexts: Sequence[int] = (1024, 4096),
    batches: Sequence[int] = (1,),
    calls: Sequence[int] = (32,),
    repeats: int = 3,
    static: bool = False,
    cells: Sequence[tuple[int, int]] | None = None,
    prefill_chunk: int | None = None,
    decode_graphs: bool | None = None,
    out_dir=RESULTS_DEFAULT,
    name: str | None = None,
    model_name: str | None = None,
    command: str | None = None,
    echo=print,
) -> dict[str, Any]:
    """Every method x batch x context cell (`time_cell`), or only the (batch, context) pairs of `cells`; writes
    `<name>.json` + `<name>.png`. `decode_graphs`: each patched method's decode steps replayed from CUDA graphs (True)
    or eager (False), as `patch(..., decode_graphs=)`; None: patch()'s default (on, unless the user's
    LONGCTX_DECODE_GRAPHS=0 says off); the result records the one in force."""
    if decode_graphs is not None and not isinstance(decode_graphs, bool):
        raise ConfigError(f"decode_graphs must be True, False or None (patch()'s default), not {decode_graphs!r}")
    if cells:
        cells = [(int(b), int(c)) for b, c in cells]
        batches = sorted({b for b, _ in cells})
        contexts = sorted({c for _, c in cells})
    else:
        cells = [(b, c) for b in batches for c in contexts]
    calls = [int(n) for n in calls]
    if repeats < 1 or any(n < 2 for n in calls) or not batches or min(batches) < 1:
        raise ConfigError("--repeats must be >= 1, every --decode-tokens call >= 2 new tokens (a prefill and a "
                          "decode step) and every --batch >= 1")
    model_name = begin_run(model, model_name)
    mdl, _ = load_model(model)
    device = next(mdl.parameters()).device
    vocab = mdl.get_input_embeddings().weight.shape[0]
    bw = copy_bandwidth(device)
    weights = weight_bytes(mdl)
    echo(f"  copy bandwidth {bw / 1e9:.1f} GB/s, weights read per step {weights / 2**20:.1f} MiB")
    plan: list[tuple[str, MethodRun, dict]] = [(r.label, r, {}) for r in methods]
    if static:
        plan.append((STATIC, MethodRun("none"), {"cache_implementation": "static"}))
    rows: dict[str, dict[str, dict[str, Any]]] = {}
    compiled = None
    ref = next((r.label for r in methods if r.reference), None)
    graphs = decode_graphs if decode_graphs is not None else default_enabled()  # the patched methods' decode steps

    def figures_of(rows) -> dict[str, Any]:
        done = [p[0] for p in plan if p[0] in rows]
        figures: dict[str, Any] = {
            "level": "model", "layout": "results[method][b<batch>][context]",
            "contexts": list(contexts), "batches": list(batches), "calls": calls, "repeats": repeats,
            "decode_timing": ("per cell, after one short generate() call at its batch (4 new tokens, at most 2048 "
                              "prompt tokens), one greedy generate() call of N new tokens per entry of `calls`, in "
                              "order, each timed from its first decode step: calls[N].decode_tok_s = batch x (N-1) "
                              "/ the time of decode steps 1 .. N-1 (CUDA events a logits processor records after each "
                              "step, no synchronisation); step_ms: the mean ms of the steps in each range (step 1 = "
                              "the first decode step); steady_ms: the last range of the longest call; warmup_ratio: "
                              "steps 1-16 against it; decode_tok_s / ms_per_step / generate_s: the longest call"),
            "prefill_chunk": prefill_chunk, "decode_graphs": graphs, "max_batch": _max_batches(rows, device),
            "copy_bandwidth_Bps": round(bw), "weights_bytes": weights,
            "floor": "(weights_bytes + state_bytes) / copy_bandwidth_Bps: every byte read once at the copy's rate "
                     "of bytes moved (read + written)",
            "results": rows, "reference": ref, "complete": len(done) == len(plan),
        }
        if static:
            figures["static_compiled"] = compiled
        if ref is not None and ref in rows:
            figures["speedup_vs_reference"] = _speedups(rows, ref, done)
        return figures

    out_dir = output_dir(out_dir, "speed")
    json_path = None if out_dir is None else Path(out_dir) / f"{name or default_name('speed', model_name, methods)}.json"

    def save(figures) -> Path:
        return write_result(json_path, task="speed", model=model_name, runs=methods, figures=figures, command=command)

    was_training = mdl.training
    mdl.eval()
    try:
        for label, run, extra in plan:
            rows[label] = {}
            with applied(mdl, run, decode_graphs=decode_graphs):
                common = dict(calls=(2,), repeats=1, vocab=vocab, bandwidth=bw, weights=weights, generate_kwargs=extra)
                _cell_or_error(time_cell, model=mdl, batch=min(batches), context=min(contexts), **common)  # warm-up
                for B, C in cells:
                    cell = _cell_or_error(time_cell, model=mdl, batch=B, context=C, calls=calls,
                                          repeats=repeats, vocab=vocab, bandwidth=bw, weights=weights,
                                          generate_kwargs=extra, prefill_chunk=prefill_chunk)
                    rows[label].setdefault(f"b{B}", {})[size_label(C)] = cell
                    echo(f"  {label} batch {B} @ {size_label(C)}: {cell}")
                if extra:
                    compiled = hasattr(mdl, "_compiled_call")
                    if compiled:
                        del mdl._compiled_call  # the next rows run the model as users do, uncompiled
            if json_path is not None and len(rows) < len(plan):
                save(figures_of(rows))  # what is done so far survives a later method's crash or time limit
    finally:
        mdl.train(was_training)
    labels = [p[0] for p in plan]
    figures = figures_of(rows)
    header = ["method", "batch", "context", "prefill s"] + [f"tok/s {n}" for n in calls] + \
        ["steps 1-16 ms", "steady ms", "floor ms", "peak MiB", "state MiB"]
    table = [[lab, b[1:], c, r.get("prefill_s")]
             + [r.get("calls", {}).get(str(n), {}).get("decode_tok_s") for n in calls]
             + [r.get("step_ms", {}).get("1-16"), r.get("steady_ms"), r.get("floor_ms"),
                None if r.get("peak_mem_bytes") is None else round(r["peak_mem_bytes"] / 2**20, 1),
                None if "state_bytes" not in r else round(r["state_bytes"] / 2**20, 2)]
             for lab in labels for b, per in rows[lab].items() for c, r in per.items()]
    echo(format_table(header, table))
    result = {"figures": figures}
    if json_path is not None:
        path = save(figures)
        png = plot(figures, labels, json_path.with_suffix(".png"))
        echo(f"wrote {path} and {png}")
        result.update({"json": str(path), "png": str(png)})
    return result


def _max_batches(rows, device) -> dict:
    """Per method and context with cells at two or more batches: the largest batch whose generate() fits the device,
    from the measured peaks (a peak is affine in the batch: weights and fixed buffers, plus per-row state and
    activations; the two largest batches give the line). None where no device memory is known (the CPU)."""
    import torch

    if device.type != "cuda":
        return {}
    total = torch.cuda.get_device_properties(device).total_memory
    out: dict = {}
    for lab, per_b in rows.items():
        by_ctx: dict = {}
        for b, per in per_b.items():
            for c, r in per.items():
                if r.get("peak_mem_bytes"):
                    by_ctx.setdefault(c, []).append((int(b[1:]), r["peak_mem_bytes"]))
        for c, pts in by_ctx.items():
            pts.sort()
            if len(pts) >= 2 and pts[-1][0] > pts[-2][0]:
                (b1, p1), (b2, p2) = pts[-2], pts[-1]
                slope = (p2 - p1) / (b2 - b1)
                if slope > 0:
                    out.setdefault(lab, {})[c] = int((total - (p2 - slope * b2)) // slope)
    return out


def _speedups(rows, ref: str, labels) -> dict:
    def ratio(a, b):
        return None if a is None or b is None else round(a / b, 3)

    out = {}
    for lab in labels:
        if lab == ref:
            continue
        out[lab] = {b: {c: {"prefill": ratio(rows[ref][b].get(c, {}).get("prefill_s"), cell.get("prefill_s")),
                            "decode": ratio(cell.get("decode_tok_s"), rows[ref][b].get(c, {}).get("decode_tok_s"))}
                        for c, cell in per.items()} for b, per in rows[lab].items()}
    return out


def plot(figures, labels, path) -> Path:
    """Decode tokens/s against context, one line per method and batch; prefill seconds beside it."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for lab in labels:
        for b, per in figures["results"][lab].items():
            xs = [C for C in figures["contexts"] if per.get(size_label(C), {}).get("decode_tok_s") is not None]
            for ax, key in zip(axes, ("decode_tok_s", "prefill_s")):
                ys = [per[size_label(C)].get(key) for C in xs]
                if any(y is not None for y in ys):
                    ax.plot(xs, ys, marker="o", ms=3, label=f"{lab} {b}")
    for ax, title in zip(axes, ("decode (tokens/s, generate())", "prefill (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=6)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


__all__ = ["STATIC", "copy_bandwidth", "run_model_speed", "state_bytes", "time_cell", "weight_bytes"]
