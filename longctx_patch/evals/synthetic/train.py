"""The trainer of the synthetic suite: every (mixer, learning rate, seed) trained from scratch with the same
budget (steps, learning-rate schedule, tokens per step), then evaluated at every length."""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from ...errors import ConfigError
from .model import ModelConfig, SyntheticLM
from .registry import MixerSpec


# ================================================================================================ training
@dataclass
class TrainConfig:
    steps: int = 200
    lrs: tuple[float, ...] = (3e-4, 1e-3, 3e-3)
    seeds: tuple[int, ...] = (0,)
    tokens_per_step: int = 16384  # batch = max(1, tokens_per_step // length)
    warmup: float = 0.05  # fraction of the steps
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_sequences: int = 64
    eval_tokens_per_batch: int = 65536
    device: str = "cpu"
    log_every: int = 10
    # curriculum: the first `curriculum_fraction` of the steps train at `curriculum_length` only (short
    # sequences, where the recall circuit forms), the rest cycle through the run's lengths
    curriculum_length: int | None = None
    curriculum_fraction: float = 0.0

    def validate(self) -> "TrainConfig":
        if self.steps < 1:
            raise ConfigError(f"steps must be >= 1, got {self.steps}")
        if self.curriculum_length is not None and self.curriculum_length < 1:
            raise ConfigError(f"curriculum length must be >= 1 token, got {self.curriculum_length}")
        if not 0.0 <= self.curriculum_fraction < 1.0:
            raise ConfigError(f"curriculum fraction must be in [0, 1), got {self.curriculum_fraction}")
        if not self.lrs or any(lr <= 0 for lr in self.lrs):
            raise ConfigError(f"learning rates must be > 0, got {self.lrs}")
        if not self.seeds:
            raise ConfigError("give at least one seed")
        if self.tokens_per_step < 1 or self.eval_sequences < 1:
            raise ConfigError("tokens_per_step and eval_sequences must be >= 1")
        return self


def curriculum_at(step: int, tcfg: TrainConfig) -> int | None:
    """The curriculum's sequence length at ``step``, or None once the curriculum is over (or without one)."""
    if tcfg.curriculum_length and step < int(tcfg.curriculum_fraction * tcfg.steps):
        return int(tcfg.curriculum_length)
    return None


def parse_curriculum(text: str | None) -> tuple[int | None, float]:
    """``'64:0.25'`` -> (64, 0.25): the first 25% of the steps at 64 tokens. None / '' / 'none' -> no curriculum."""
    if not text or str(text).strip().lower() == "none":
        return None, 0.0
    from ..common import parse_size

    length, sep, frac = str(text).partition(":")
    try:
        fraction = float(frac) if sep else float("nan")
    except ValueError:
        fraction = float("nan")
    if not 0.0 < fraction < 1.0:
        raise ConfigError(f"bad curriculum {text!r}; write LENGTH:FRACTION, e.g. 64:0.25 (the first 25% of the "
                          "steps at 64 tokens)")
    return parse_size(length), fraction


def _batch_to(batch: dict[str, torch.Tensor], device) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def _lr_at(step: int, steps: int, lr: float, warmup: float) -> float:
    w = max(1, int(warmup * steps))
    if step < w:
        return lr * (step + 1) / w
    t = (step - w) / max(1, steps - w)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def evaluate(model: SyntheticLM, task, length: int, n_seq: int, tokens_per_batch: int, device, seed: int = 10 ** 9) -> dict:
    model.eval()
    bs = max(1, min(n_seq, tokens_per_batch // length))
    sums: dict[str, float] = {}
    done = 0
    with torch.no_grad():
        while done < n_seq:
            b = min(bs, n_seq - done)
            batch = _batch_to(task.sample(length, b, seed + 7919 * length + done), device)
            out = model(**task.model_inputs(batch))
            for k, v in task.metric_sums(out, batch).items():
                sums[k] = sums.get(k, 0.0) + v
            done += b
    model.train()
    return task.finish(sums)


def train_one(task, spec: MixerSpec, lengths: Sequence[int], mcfg: ModelConfig, tcfg: TrainConfig, lr: float, seed: int,
              progress: bool = False, eval_lengths: Sequence[int] | None = None,
              deadline: float | None = None) -> dict[str, Any]:
    """Trains one model from scratch and evaluates it at every length. Returns a JSON-ready record.

    Steps cycle through ``lengths`` (after the curriculum's steps at ``curriculum_length``, if any); a step at
    length ``L`` uses ``max(1, tokens_per_step // L)`` sequences.
    ``deadline`` (a ``time.time()`` value): training stops there even if ``steps`` are not done; the record's
    ``steps_done`` says how many ran (a guard for time-limited runs, reported, never silent).
    """
    device = torch.device(tcfg.device)
    torch.manual_seed(seed)
    model = SyntheticLM(task.vocab_size, task.feat_dim, task.out_dim, spec, mcfg).to(device)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n and "codebook" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n and "codebook" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": tcfg.weight_decay}, {"params": rest, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.98))
    losses: list[tuple[int, float]] = []
    bar = None
    if progress:
        from ...progress import Progress

        bar = Progress(tcfg.steps, f"{task.name} {spec.label} lr={lr:g} seed={seed}", unit="steps")
    t0 = time.perf_counter()
    diverged = False
    running = None
    steps_done = 0
    for step in range(tcfg.steps):
        if deadline is not None and time.time() > deadline:
            break
        L = curriculum_at(step, tcfg) or lengths[step % len(lengths)]
        bs = max(1, tcfg.tokens_per_step // L)
        batch = _batch_to(task.sample(L, bs, 1_000_003 * (seed + 1) + step), device)
        for gr in opt.param_groups:
            gr["lr"] = _lr_at(step, tcfg.steps, lr, tcfg.warmup)
        out = model(**task.model_inputs(batch))
        loss = task.loss(out, batch)
        aux = model.aux_loss()
        total = loss + aux if aux is not None else loss
        opt.zero_grad(set_to_none=True)
        total.backward()
        if tcfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), tcfg.grad_clip)
        opt.step()
        if step % tcfg.log_every == 0 or step == tcfg.steps - 1:
            val = float(loss.detach())
            if not math.isfinite(val):
                diverged = True
                losses.append((step, val))
                break
            losses.append((step, val))
            running = val
            if bar is not None:
                bar.set_postfix(loss=f"{val:.3f}")
        steps_done = step + 1
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    train_s = time.perf_counter() - t0
    evals = {}
    if not diverged:
        for L in (eval_lengths or lengths):
            evals[str(L)] = evaluate(model, task, L, tcfg.eval_sequences, tcfg.eval_tokens_per_batch, device)
    return {
        "mixer": spec.label, "lr": lr, "seed": seed, "diverged": diverged, "final_loss": running, "steps_done": steps_done,
        "losses": losses, "train_seconds": round(train_s, 2), "eval": evals,
        "params": sum(p.numel() for p in model.parameters()),
        "state_bytes": {str(L): model.state_bytes(L) for L in (eval_lengths or lengths)},
    }


def _job(args):
    task, spec, lengths, mcfg, tcfg, lr, seed, eval_lengths = args[:8]
    deadline = args[8] if len(args) > 8 else None
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    torch.set_num_threads(max(1, int(os.environ.get("LONGCTX_SYNTH_THREADS", "1"))))
    try:
        return train_one(task, spec, lengths, mcfg, tcfg, lr, seed, progress=False, eval_lengths=eval_lengths,
                         deadline=deadline)
    except Exception as e:  # noqa: BLE001 - one failing mixer must not lose the others' results
        return {"mixer": spec.label, "lr": lr, "seed": seed, "error": f"{type(e).__name__}: {e}"}


def run_sweep(task, specs: Sequence[MixerSpec], lengths: Sequence[int], mcfg: ModelConfig, tcfg: TrainConfig, *,
              workers: int = 1, progress: bool = True, eval_lengths: Sequence[int] | None = None,
              on_result: Callable[[dict], None] | None = None) -> list[dict]:
    """Trains every (mixer, lr, seed) with the same budget. ``workers > 1`` runs jobs in parallel processes
    (several small models share one GPU well). Returns the run records (``error`` set on failure)."""
    tcfg.validate()
    mcfg.validate()
    curriculum = [tcfg.curriculum_length] if tcfg.curriculum_length else []
    task.check_lengths(list(lengths) + list(eval_lengths or []) + curriculum)
    jobs = [(task, s, list(lengths), mcfg, tcfg, lr, seed, list(eval_lengths) if eval_lengths else None)
            for s in specs for lr in tcfg.lrs for seed in tcfg.seeds]
    records: list[dict] = []
    if workers <= 1:
        from ...progress import progress_iter

        for j in progress_iter(jobs, f"{task.name} runs", enabled=progress, unit="runs"):
            try:
                rec = train_one(*j[:7], progress=progress, eval_lengths=j[7])
            except (ConfigError, KeyboardInterrupt):
                raise
            except Exception as e:  # noqa: BLE001
                rec = {"mixer": j[1].label, "lr": j[5], "seed": j[6], "error": f"{type(e).__name__}: {e}"}
            records.append(rec)
            if on_result:
                on_result(rec)
        return records
    import concurrent.futures as cf
    import multiprocessing as mp

    from ...progress import Progress

    with cf.ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn")) as ex, \
            Progress(len(jobs), f"{task.name} runs", unit="runs", enabled=progress) as bar:
        futs = [ex.submit(_job, j) for j in jobs]
        for f in cf.as_completed(futs):
            rec = f.result()
            records.append(rec)
            if on_result:
                on_result(rec)
            bar.update(1)
    return records


__all__ = ["TrainConfig", "curriculum_at", "parse_curriculum", "evaluate", "train_one", "run_sweep"]
