"""Resumable checkpoints of a fine-tune run (see runner.py's docstring for the folder layout)."""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import pickle
import random
import shutil
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError


CKPT_DIR = "checkpoints"
OPTIMIZER_FILE = "optimizer.pt"  # tensors and plain values only: read with torch.load(weights_only=True)
SCHEDULER_FILE = "scheduler.json"
RNG_FILE = "rng.json"  # one entry per process


def _full(t):
    """A DTensor (an FSDP shard) as the full tensor (collective); anything else as it is."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _rng_state() -> dict[str, Any]:
    """This process's RNG states as plain JSON values (lists of ints), so that a checkpoint stores them
    without pickling and resuming reads them without unpickling."""
    import numpy as np

    version, internal, gauss_next = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    st = {
        "python": [version, list(internal), gauss_next],
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available():
        st["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return st


def _set_rng_state(st: dict[str, Any]) -> None:
    """Restores what `_rng_state` returned (after a JSON round trip). Raises TypeError/ValueError on a
    malformed state (RuntimeError from torch)."""
    import numpy as np

    version, internal, gauss_next = st["python"]
    random.setstate((int(version), tuple(int(x) for x in internal), None if gauss_next is None else float(gauss_next)))
    kind, keys, pos, has_gauss, cached = st["numpy"]
    np.random.set_state((str(kind), np.asarray(keys, dtype=np.uint32), int(pos), int(has_gauss), float(cached)))
    torch.set_rng_state(torch.tensor(st["torch"], dtype=torch.uint8))
    if "cuda" in st and torch.cuda.is_available():
        with contextlib.suppress(Exception):
            torch.cuda.set_rng_state_all([torch.tensor(c, dtype=torch.uint8) for c in st["cuda"]])


class CheckpointMixin:
    """Resumable checkpoints of a `Finetuner` run: the trained tensors, the optimizer (tensors and plain values,
    read with torch.load(weights_only=True)), the scheduler and the RNG states as JSON."""

    def _ckpt_root(self) -> Path:
        return self.out / CKPT_DIR

    def latest_checkpoint(self) -> Path | None:
        root = self._ckpt_root()
        if not root.is_dir():
            return None
        best, best_key = None, None
        for d in root.iterdir():
            st = d / "state.json"
            if d.name.endswith(".tmp") or not st.exists():
                continue  # incomplete (interrupted while writing)
            try:
                s = json.loads(st.read_text())
            except json.JSONDecodeError:
                continue
            key = (s["stage"], s["step"])
            if best_key is None or key > best_key:
                best, best_key = d, key
        return best

    def _named_trained(self) -> dict[str, torch.Tensor]:
        """Every parameter trained so far, named as in the current root model, as full tensors on the CPU.
        Collective under FSDP (every process gathers the shards)."""
        if self.fsdp is not None:
            self._reshard_all(self.root)
        return {
            n: _full(p).detach().to("cpu").contiguous()
            for n, p in self.root.named_parameters()
            if id(p) in self.trained
        }

    def _optimizer_state(self, optimizer) -> dict[str, Any]:
        """optimizer.state_dict() with full tensors (collective under FSDP): the format of a single process."""
        sd = optimizer.state_dict()
        if self.fsdp is None:
            return sd
        state = {i: {k: _full(v) for k, v in sd["state"][i].items()} for i in sorted(sd["state"])}
        return {"state": state, "param_groups": sd["param_groups"]}

    def _load_optimizer_state(self, optimizer, sd: dict[str, Any]) -> None:
        """Loads a saved (full) optimizer state; under FSDP each state tensor is cut to its parameter's shard."""
        if self.fsdp is not None:
            from torch.distributed.tensor import DTensor, distribute_tensor

            saved = [i for g in sd["param_groups"] for i in g["params"]]
            now = [p for g in optimizer.param_groups for p in g["params"]]
            by_index = dict(zip(saved, now))
            state = {}
            for i, st in sd["state"].items():
                p = by_index.get(i)
                if isinstance(p, DTensor):
                    st = {
                        k: distribute_tensor(v.to(p.device), p.device_mesh, p.placements, src_data_rank=None)
                        if k != "step" and torch.is_tensor(v) and v.shape == p.shape
                        else v
                        for k, v in st.items()
                    }
                state[i] = st
            sd = {"state": state, "param_groups": sd["param_groups"]}
        optimizer.load_state_dict(sd)

    def save_checkpoint(self, si: int, step: int, optimizer, scheduler, keep: int = 2, completed: bool = False) -> None:
        from accelerate.utils import gather_object
        from safetensors.torch import save_file

        # collectives: every process takes part (under FSDP they gather the full tensors)
        rng = gather_object([_rng_state()])
        trained, opt_state = self._named_trained(), self._optimizer_state(optimizer)
        if self.is_main:
            d = self._ckpt_root() / f"stage{si}-step{step:07d}"
            tmp = d.with_name(d.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            save_file(trained, str(tmp / "trained.safetensors"))
            # nothing here needs pickle to read back: tensors and plain values (torch.load(weights_only=True)),
            # the scheduler and the RNG states as JSON
            torch.save(opt_state, tmp / OPTIMIZER_FILE)
            (tmp / SCHEDULER_FILE).write_text(json.dumps(scheduler.state_dict(), allow_nan=True))
            (tmp / RNG_FILE).write_text(json.dumps(rng))
            state = {
                "stage": si,
                "stage_name": self.recipe.stages[si].name,
                "step": step,
                "completed": completed,
                "fingerprint": self.recipe.fingerprint(),
                "world_size": self.world,
                "logs": [l.__dict__ for l in self.stage_logs],
                "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            }
            (tmp / "state.json").write_text(json.dumps(state, indent=1))
            shutil.rmtree(d, ignore_errors=True)
            tmp.rename(d)
            if keep > 0:
                found = []
                for p in self._ckpt_root().iterdir():
                    if not p.name.endswith(".tmp") and (p / "state.json").exists():
                        s = json.loads((p / "state.json").read_text())
                        found.append(((s["stage"], s["step"]), p))
                for _, old in sorted(found)[:-keep]:
                    shutil.rmtree(old, ignore_errors=True)
        self.accelerator.wait_for_everyone()

    def read_checkpoint(self, d: Path) -> dict[str, Any]:
        try:
            state = json.loads((d / "state.json").read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(f"checkpoint {d} cannot be read ({e}); delete it or start without --resume") from None
        if state.get("fingerprint") != self.recipe.fingerprint():
            raise CheckpointError(
                f"checkpoint {d} was written by a different recipe (model, method, layers or stage structure "
                "differ); resume with the same recipe and --set values, or use a new --output directory"
            )
        return state

    @staticmethod
    def _read_ckpt_file(d: Path, name: str) -> Any:
        """A checkpoint file, read without unpickling anything but tensors and plain values: JSON, or
        torch.load(weights_only=True). Any failure is a one-line CheckpointError."""
        p = d / name
        if not p.exists():
            legacy = {SCHEDULER_FILE: "scheduler.pt", RNG_FILE: "rng.pt"}.get(name)
            if legacy and (d / legacy).exists():
                raise CheckpointError(
                    f"checkpoint {d} is in the older format ({legacy}, a pickle, is not loaded: unpickling can run "
                    "code); resume it with the version that wrote it, or start without --resume"
                )
            raise CheckpointError(f"checkpoint {d} lacks {name}; delete it or start without --resume")
        try:
            if name.endswith(".json"):
                return json.loads(p.read_text())
            return torch.load(p, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError:
            raise CheckpointError(
                f"checkpoint {d}: {name} holds objects other than tensors and plain values and is refused "
                "(unpickling them could run code); delete the checkpoint or start without --resume"
            ) from None
        except Exception as e:  # noqa: BLE001 - unreadable in any other way (truncated, not JSON ...)
            msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise CheckpointError(
                f"checkpoint {d}: {name} cannot be read ({type(e).__name__}: {msg}); delete it or start without --resume"
            ) from None

    def load_resume_state(self, d: Path, optimizer, scheduler, start_step: int) -> None:
        """Optimizer, scheduler and RNG states of checkpoint `d` (the RNG reseeded when the number of processes
        changed)."""
        opt_sd = self._read_ckpt_file(d, OPTIMIZER_FILE)
        sched_sd = self._read_ckpt_file(d, SCHEDULER_FILE)
        rng = self._read_ckpt_file(d, RNG_FILE)
        if not (isinstance(opt_sd, dict) and {"state", "param_groups"} <= set(opt_sd)):
            raise CheckpointError(f"checkpoint {d}: {OPTIMIZER_FILE} is not an optimizer state dict")
        if not isinstance(sched_sd, dict) or not isinstance(rng, list):
            bad = SCHEDULER_FILE if not isinstance(sched_sd, dict) else RNG_FILE
            raise CheckpointError(f"checkpoint {d}: {bad} does not hold the expected state")
        try:
            self._load_optimizer_state(optimizer, opt_sd)
            scheduler.load_state_dict(sched_sd)
        except (KeyError, TypeError, ValueError, RuntimeError) as e:
            raise CheckpointError(
                f"checkpoint {d}: the optimizer or scheduler state does not fit this stage ({type(e).__name__}: "
                f"{str(e).strip().splitlines()[0] if str(e).strip() else ''})"
            ) from None
        if len(rng) == self.world:
            try:
                _set_rng_state(rng[self.rank])
            except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as e:
                raise CheckpointError(f"checkpoint {d}: {RNG_FILE} holds a malformed RNG state ({type(e).__name__})") from None
        else:
            self._log(f"note: checkpoint written by {len(rng)} processes, resuming with {self.world}; RNG reseeded")
            torch.manual_seed(self.recipe.seed + 104729 * start_step + self.rank)

    def load_trained_state(self, d: Path) -> None:
        from safetensors.torch import load_file

        try:
            sd = load_file(str(d / "trained.safetensors"))
        except (OSError, RuntimeError) as e:
            raise CheckpointError(f"checkpoint {d}: trained.safetensors cannot be read ({e})") from None
        self._load_trained(sd, f"checkpoint {d}")

    def _load_trained(self, sd: dict[str, torch.Tensor], source: str) -> None:
        params = dict(self.root.named_parameters())
        unknown = sorted(set(sd) - set(params))
        if unknown:
            raise CheckpointError(f"{source} holds parameters the model lacks: {unknown[:5]}")
        with torch.no_grad():
            for n, t in sd.items():
                if params[n].shape != t.shape:
                    raise CheckpointError(f"{source}: {n} has shape {tuple(t.shape)}, model {tuple(params[n].shape)}")
                params[n].copy_(t.to(params[n].device, params[n].dtype))
                self.trained[id(params[n])] = params[n]

    # ------------------------------------------------------------------------------------------- FSDP
