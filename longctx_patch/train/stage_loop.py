"""The training loop of one stage of a fine-tune run."""

from __future__ import annotations

import contextlib
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ..errors import CheckpointError, ConfigError, LongctxError
from .data import BatchOrder, local_slice
from .recipe import Stage
from .resume import _full
from .plan import GIB, format_duration, peak_memory, peak_memory_reset
from ..timing import StepTimer


def lr_lambda(stage: Stage) -> Callable[[int], float]:
    """Multiplier of the base lr after `step` optimizer steps: linear warm-up, then the schedule."""
    warm, total, floor = min(stage.warmup, stage.steps), stage.steps, stage.min_lr_ratio

    def f(step: int) -> float:
        if warm and step < warm:
            return (step + 1) / warm
        if stage.schedule == "constant":
            return 1.0
        span = max(1, total - warm)
        t = min(1.0, (step - warm) / span)
        if stage.schedule == "linear":
            return 1.0 - (1.0 - floor) * t
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * t))

    return f


def make_optimizer(groups: list[dict[str, Any]], stage: Stage, fused: bool) -> torch.optim.AdamW:
    """AdamW over `groups`; `fused` (CUDA, unsharded parameters): one kernel for every tensor of the step instead
    of a loop of small ones (same update up to rounding)."""
    return torch.optim.AdamW(groups, lr=stage.lr, betas=tuple(stage.betas), **({"fused": True} if fused else {}))


def activation_checkpointing(model, enable: bool) -> None:
    """transformers' recomputation of the decoder layers in the backward, on or off, under the name the installed
    version has: `activation_checkpointing_enable/_disable` (newer 5.x, where `gradient_checkpointing_*` are deprecated
    aliases), else `gradient_checkpointing_enable/_disable`. Non-reentrant checkpoints."""
    if enable:
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif hasattr(model, "activation_checkpointing_disable"):
        model.activation_checkpointing_disable()
    else:
        model.gradient_checkpointing_disable()


@dataclass
class StageLog:
    name: str
    objective: str
    trainable: list[str]
    steps: int
    seq_len: int
    batch_size: int
    grad_accum: int
    lr: float
    trainable_params: int = 0
    train_chunks: int = 0
    eval_chunks: int = 0
    steps_done: int = 0
    tokens: int = 0
    time_s: float = 0.0  # wall time of the training steps (evaluations and checkpoint writes excluded)
    eval_time_s: float = 0.0
    tokens_per_s: float = 0.0
    steady_tokens_per_s: float | None = None  # tokens/s after the first log point (no compile or autotune)
    # peak memory of this process during the stage: CUDA, its allocated device memory; CPU (Linux), its resident memory
    peak_memory_gib: float | None = None
    estimated_peak_gib: float | None = None  # what the plan before the run estimated for the stage (plan.py)
    loss: list[list[float]] = field(default_factory=list)  # [step, mean loss since the last entry]
    eval_loss: list[list[float]] = field(default_factory=list)  # [step, held-out loss]
    lr_curve: list[list[float]] = field(default_factory=list)
    grad_norm: list[list[float]] = field(default_factory=list)
    first_loss: float | None = None
    final_loss: float | None = None
    final_eval_loss: float | None = None
    resumed_from_step: int | None = None
    stopped_early: str | None = None  # why the stage ended before `steps` (max_time_s)
    text: dict[str, Any] | None = None  # what the stage read: source, documents, tokens, sha256 (data.text_record)
    commands: list[str] = field(default_factory=list)  # the command lines that ran its steps, in order


class StageLoopMixin:
    """One training stage of a `Finetuner` run: the optimisation loop with its evaluations, checkpoints and
    progress bar."""

    def run_stage(self, si: int, stage: Stage, start_step: int, ckpt: Path | None, log: StageLog) -> None:
        from tqdm.auto import tqdm

        acc = self.accelerator
        self._note_text(stage, ckpt, log)
        params = self.setup_stage(stage)
        if ckpt is not None:
            self.read_checkpoint(ckpt)
            self.load_trained_state(ckpt)
        self.enter_stage_modes(stage)
        data = self.packed(stage)
        log.train_chunks, log.eval_chunks = int(data.train.shape[0]), int(data.eval.shape[0])
        log.trainable_params = int(sum(p.numel() for _, p in params))
        if stage.batch_size % self.world:
            raise ConfigError(
                f"stages.{si}.batch_size={stage.batch_size} is not divisible by the {self.world} processes; "
                f"use a multiple of {self.world}"
            )
        order = BatchOrder(log.train_chunks, stage.batch_size, self.recipe.seed + 7919 * si)

        if self.fsdp is not None:  # shard first: the optimizer holds the sharded parameters
            self.root.train()
            keep = stage.objective == "attention_transfer" and (not stage.teacher_forcing or stage.gradient_checkpointing)
            model = self._shard(self.root, keep_gathered=keep)
            now = dict(model.named_parameters())
            params = [(n, now[n]) for n, _ in params]
        optimizer = make_optimizer(self.param_groups(stage, params), stage, fused=self.fsdp is None and acc.device.type == "cuda")
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(stage))
        if ckpt is not None:
            self.load_resume_state(ckpt, optimizer, scheduler, start_step)
        else:
            # dropout streams differ per process; the model itself was initialised identically everywhere
            torch.manual_seed(self.recipe.seed + 1_000 * si + self.rank)
        self.root.train()
        if self.fsdp is None:
            model, optimizer = acc.prepare(self.root, optimizer)
        # the scheduler is stepped by hand once per optimizer step (not prepared: no per-process scaling)

        trainable = [p for _, p in params]
        cuda = acc.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(acc.device)
        cpu_peak = not cuda and peak_memory_reset()
        planned = self.plan.stages[si] if getattr(self, "plan", None) is not None else None
        if planned is not None:
            log.estimated_peak_gib = planned.peak / GIB
        t0 = time.time()
        self._eval_time = 0.0
        show = self.is_main and self.progress
        bar = show and sys.stderr.isatty()  # logs (no terminal): a plain line per log_every steps and every log_seconds
        pbar = tqdm(
            total=stage.steps, initial=start_step, desc=f"{stage.name}", disable=not bar, dynamic_ncols=True,
            file=sys.stderr,
        )
        t_run, tok_run = time.time(), 0  # live tokens/s and the max_time_s budget (evaluations included)
        # losses and gradient norms stay on the device until a log point: a float() every step would make the
        # host wait for the device every step, and a small model's step is mostly launch time
        pending: list[tuple[int, torch.Tensor, Any, float]] = []  # (step, loss, grad norm, lr)
        window: list[float] = []
        gn = lr_now = float("nan")
        steady: list[float] | None = None  # [tokens, training time] at the first log point
        eta = _Eta(stage.steps, start_step, self.plan, si)
        last_line = time.time()

        def flush() -> None:
            nonlocal gn
            if not pending:
                return
            losses = torch.stack([p[1] for p in pending])
            losses = acc.reduce(losses, reduction="mean").float().cpu().tolist()
            for (st, _, g, _lr), v in zip(pending, losses):
                if not math.isfinite(v):
                    raise LongctxError(
                        f"stage {stage.name!r}: the loss became {v} at step {st}; lower stages.{si}.lr "
                        f"or raise stages.{si}.warmup"
                    )
                if log.first_loss is None:
                    log.first_loss = v
                log.final_loss = v
                window.append(v)
            g = pending[-1][2]
            gn = float(_full(g)) if g is not None else float("nan")
            pending.clear()

        with self._objective(stage) as transfer:
            if start_step == 0 and stage.eval_every and data.eval.shape[0]:
                ev = self.evaluate(model, data, stage, transfer)
                if ev is not None:
                    log.eval_loss.append([0, ev])
            for step in range(start_step, stage.steps):
                batches = [self.micro_batch(data, order, step * stage.grad_accum + m) for m in range(stage.grad_accum)]
                lr_now = optimizer.param_groups[0]["lr"]
                local, g = self.train_step(model, optimizer, scheduler, batches, stage, transfer, trainable)
                done = step + 1
                eta.step_done(done)
                pending.append((done, local, g, lr_now))
                log.tokens += stage.tokens_per_step
                tok_run += stage.tokens_per_step
                log.steps_done = done
                at_log = done % stage.log_every == 0 or done == stage.steps
                # without a terminal: a line at every log point and at least every log_seconds in between
                at_line = show and not bar and (at_log or time.time() - last_line >= self.log_seconds)
                if at_log or bar or at_line:  # a progress bar shows every step's loss (and so waits for it)
                    flush()
                tps = tok_run / max(time.time() - t_run, 1e-9)
                pbar.update(1)
                if window:
                    pbar.set_postfix(loss=f"{window[-1]:.4g}", lr=f"{lr_now:.2e}", tok_s=f"{tps:.0f}")
                if at_line:
                    mean = sum(window) / len(window)
                    print(f"{stage.name} step {done}/{stage.steps}: loss {mean:.4g}, {tps:.0f} tok/s, lr {lr_now:.2e}, "
                          f"grad-norm {gn:.3g}, {eta.words(done)}", file=sys.stderr, flush=True)
                    last_line = time.time()
                if at_log:
                    if steady is None:
                        steady = [log.tokens, log.time_s + time.time() - t0 - self._eval_time]
                    mean = sum(window) / len(window)
                    log.loss.append([done, mean])
                    log.lr_curve.append([done, lr_now])
                    log.grad_norm.append([done, gn])
                    window = []
                if stage.eval_every and done % stage.eval_every == 0 and done != stage.steps:
                    ev = self.evaluate(model, data, stage, transfer)
                    if ev is not None:
                        log.eval_loss.append([done, ev])
                        if show:
                            pbar.write(f"{stage.name} step {done}: eval loss {ev:.4g}", file=sys.stderr)
                if stage.save_every and done % stage.save_every == 0 and done != stage.steps:
                    flush()  # a non-finite loss raises here, before it could be saved
                    log.time_s += time.time() - t0 - self._eval_time
                    log.eval_time_s += self._eval_time
                    self._eval_time = 0.0
                    self.save_checkpoint(si, done, optimizer, scheduler, keep=self.recipe.output.keep_checkpoints)
                    t0 = time.time()
                if stage.max_time_s is not None and done < stage.steps:
                    over = time.time() - t_run >= stage.max_time_s
                    if self.world > 1:  # one decision for every process (a single process need not wait for its device)
                        over = float(acc.reduce(torch.tensor(float(over), device=acc.device), reduction="sum")) > 0
                    if over:
                        flush()
                        if window:
                            log.loss.append([done, sum(window) / len(window)])
                            log.lr_curve.append([done, lr_now])
                            log.grad_norm.append([done, gn])
                        log.stopped_early = f"max_time_s={stage.max_time_s:g} reached after step {done}"
                        self._log(f"{stage.name}: {log.stopped_early}; ending the stage")
                        break
            ev = self.evaluate(model, data, stage, transfer)
            if ev is not None:
                log.eval_loss.append([log.steps_done, ev])
                log.final_eval_loss = ev
        pbar.close()
        flush()
        log.time_s += time.time() - t0 - self._eval_time
        log.eval_time_s += self._eval_time
        log.tokens_per_s = log.tokens / max(log.time_s, 1e-9)
        if cuda:  # this process's peak, training and evaluation of the stage
            log.peak_memory_gib = torch.cuda.max_memory_allocated(acc.device) / 2**30
        elif cpu_peak:
            log.peak_memory_gib = peak_memory() / GIB
        if steady is not None and log.tokens > steady[0]:
            # after the first log point: compilation and autotuning of the first steps left out
            log.steady_tokens_per_s = (log.tokens - steady[0]) / max(log.time_s - steady[1], 1e-9)
        self.leave_stage_modes(stage)
        self.save_checkpoint(
            si, log.steps_done, optimizer, scheduler, keep=self.recipe.output.keep_checkpoints, completed=True
        )
        # back to the plain model for the next stage / the final save
        if self.fsdp is not None:
            trained = self._named_trained()
            del model, optimizer, scheduler, params, trainable
            self._rebuild(si, trained)
        else:
            self.root = acc.unwrap_model(model, keep_fp32_wrapper=False)
            acc.free_memory()
            del optimizer, scheduler
        self._log(
            f"{stage.name}: {log.steps_done} steps, {log.tokens} tokens, {log.time_s:.1f} s, "
            f"loss {log.first_loss if log.first_loss is None else round(log.first_loss, 4)} -> "
            f"{log.final_loss if log.final_loss is None else round(log.final_loss, 4)}"
            + (f", eval {log.final_eval_loss:.4f}" if log.final_eval_loss is not None else "")
            + (f", peak memory {log.peak_memory_gib:.1f} GiB" if log.peak_memory_gib is not None else "")
            + (f" (estimated {log.estimated_peak_gib:.1f})" if log.estimated_peak_gib is not None and
               log.peak_memory_gib is not None else "")
        )

    def _note_text(self, stage: Stage, ckpt: Path | None, log: StageLog) -> None:
        """Records the text this run reads and its command in the stage's log; a stage resumed from a checkpoint
        taken in its middle must read the text it started with (the batches an uninterrupted run draws), else a
        CheckpointError names both. At a stage boundary the next stage may read other text."""
        text = getattr(self, "text", None)
        was = log.text
        if ckpt is not None and was and text and was.get("sha256") != text["sha256"]:
            raise CheckpointError(
                f"checkpoint {ckpt} is in the middle of stage {stage.name!r}, which read {was.get('source')!r} "
                f"({was.get('tokens')} tokens, sha256 {str(was.get('sha256'))[:12]}); this run reads "
                f"{text['source']!r} ({text['tokens']} tokens, sha256 {text['sha256'][:12]}): resume with the "
                "text the stage started with (the same --text and tokenizer), or start again in another --output")
        log.text = text if text is not None else was
        if self.command and (not log.commands or log.commands[-1] != self.command):
            log.commands.append(self.command)

    def enter_stage_modes(self, stage: Stage) -> None:
        """Gradient checkpointing of the decoder layers and their compilation (`compile`), for this stage."""
        if stage.gradient_checkpointing:
            activation_checkpointing(self.root, True)
            if hasattr(self.root, "enable_input_require_grads"):
                self.root.enable_input_require_grads()
        if stage.compile:
            for layer in self._decoder_layers():
                layer.compile(dynamic=False)

    def leave_stage_modes(self, stage: Stage) -> None:
        if stage.gradient_checkpointing:
            activation_checkpointing(self.root, False)
        if stage.compile:
            for layer in self._decoder_layers():
                layer._compiled_call_impl = None  # what nn.Module.compile set: calls go to forward again

    def _decoder_layers(self):
        from ..architectures import get_adapter

        return get_adapter(self.model).decoder_layers(self.model)

    def micro_batch(self, data, order: BatchOrder, m: int) -> torch.Tensor:
        """This process's rows of micro-step `m`'s batch, on the device."""
        batch = local_slice(data.train[order.indices(m)], self.rank, self.world)
        return batch.to(self.accelerator.device, non_blocking=True)

    def train_step(self, model, optimizer, scheduler, batches: list[torch.Tensor], stage: Stage, transfer,
                   trainable: list[torch.nn.Parameter], timer: StepTimer | None = None):
        """One optimizer step over the micro-batches `batches` (gradient accumulation). Returns the mean loss and the
        gradient norm (None without clipping) as device tensors: nothing here waits for the device. `timer`
        (StepTimer, started by the caller) marks the end of each forward, backward and of the optimizer."""
        acc = self.accelerator
        local = torch.zeros((), device=acc.device)
        for micro, batch in enumerate(batches):
            sync = micro == len(batches) - 1
            if self.fsdp is not None:  # reduce-scatter the accumulated gradients on the last micro-step
                model.set_requires_gradient_sync(sync)
                ctx = contextlib.nullcontext()
            else:
                ctx = contextlib.nullcontext() if sync else acc.no_sync(model)
            with ctx:
                loss = self._forward_loss(model, batch, stage, transfer)
                if timer is not None:
                    timer.mark("forward")
                acc.backward(loss / len(batches))
                if timer is not None:
                    timer.mark("backward")
            local += loss.detach().float() / len(batches)
        if self.fsdp is not None:
            self._average_replicated_grads(trainable)
        g = acc.clip_grad_norm_(trainable, stage.max_grad_norm) if stage.max_grad_norm else None
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if self.fsdp is not None:
            self._reshard_all(model)
        if timer is not None:
            timer.mark("optimizer")
        return local, g

    # ------------------------------------------------------------------------------------------- the run


class _Eta:
    """The remaining time of a stage from its measured steps (the first one, which compiles and warms up, left out
    once there are others), and of the run: the later stages' planned times scaled by how this stage's measured time
    compares with its own plan."""

    def __init__(self, steps: int, start: int, plan, si: int):
        self.steps, self.start, self.plan, self.si = steps, start, plan, si
        self.t_start = time.time()
        self.t_first: float | None = None  # when the first step of this run ended

    def step_done(self, done: int) -> None:
        if self.t_first is None:
            self.t_first = time.time()
            self.first = done

    def stage_seconds(self, done: int) -> float:
        now = time.time()
        if self.t_first is not None and done > self.first:
            per = (now - self.t_first) / (done - self.first)
        else:
            per = (now - self.t_start) / max(done - self.start, 1)
        self.per_step = per
        return per * (self.steps - done)

    def words(self, done: int) -> str:
        left = self.stage_seconds(done)
        text = f"ETA stage {format_duration(left)}"
        if self.plan is not None and self.si + 1 < len(self.plan.stages):
            mine = self.plan.stages[self.si]
            scale = self.per_step / (mine.seconds / max(mine.steps, 1)) if mine.seconds > 0 else 1.0
            later = sum(s.seconds for s in self.plan.stages[self.si + 1:]) * scale
            text += f", run {format_duration(left + later)}"
        return text

