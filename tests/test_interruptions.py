"""Interruptions lose nothing.

A `longctx finetune` killed with SIGKILL (between checkpoints, in the middle of a checkpoint's file, after a checkpoint
is written but before it is renamed into place, while an old checkpoint is removed, at a random moment, and in the
middle of writing the final model) resumes with --resume to the trained weights of a run that was never interrupted,
bit for bit (CPU, one thread, same code: the resumed run replays the same batches from the saved optimizer, scheduler
and RNG states, so no tolerance is needed). `save_patched` killed at any point of its write leaves the previous save
loadable (or the new one once it has taken its place), and what a killed save left behind is a CheckpointError.

The runs are processes forked from a server that has imported torch and the package once (multiprocessing's
forkserver): each runs the `longctx finetune` command and is killed with SIGKILL, by itself at a point a patched
function marks (the test's hooks, `_arm`) or by the test at a random time.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import longctx_patch as lp
from longctx_patch.errors import CheckpointError

from conftest import tiny_model
from test_train import TEXT, byte_tokenizer, recipe_dict, register_temp_method, write_recipe

CTX = multiprocessing.get_context("forkserver")
CTX.set_forkserver_preload(["torch", "transformers", "peft", "accelerate", "longctx_patch.train", "longctx_patch.cli.finetune_cmd"])


# ----------------------------------------------------------------------------------------------- in the child
def _die() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _half_then_die(path, data: bytes) -> None:
    """Writes the first half of `data` to `path`, on disk, then dies: a file cut by the kill."""
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])
        f.flush()
        os.fsync(f.fileno())
    _die()


def _arm(kill: tuple) -> None:
    """Patches the function where this process is to kill itself: ("step", n) before the n-th optimizer step;
    ("ckpt-file", name, n) half-way through writing file `name` of the n-th checkpoint; ("ckpt-rename", n) when the
    n-th checkpoint is on disk under its .tmp name; ("prune", n) in the middle of removing the n-th old checkpoint;
    ("model-file", name) half-way through writing `name` of a saved model; ("method-file",) half-way through writing
    the method weights of a save_patched folder; ("save-swap",) / ("save-after-swap",) just before / just after a
    save_patched folder takes its place."""
    import shutil

    import safetensors.torch
    import transformers.modeling_utils as mu

    from longctx_patch import checkpoint
    from longctx_patch.train import resume as checkpointing
    from longctx_patch.train.stage_loop import StageLoopMixin

    what, *args = kill
    count = [0]

    def nth(n: int) -> bool:
        count[0] += 1
        return count[0] == n

    if what == "step":
        step = StageLoopMixin.train_step

        def train_step(self, *a, **kw):
            if nth(args[0]):
                _die()
            return step(self, *a, **kw)

        StageLoopMixin.train_step = train_step
    elif what == "ckpt-file":
        name, n = args
        save_file, save = safetensors.torch.save_file, torch.save

        def counted(path) -> bool:  # trained.safetensors is each checkpoint's first file
            if str(path).endswith("trained.safetensors"):
                count[0] += 1
            return count[0] == n and str(path).endswith(name)

        def save_file_hook(tensors, path, *a, **kw):
            if counted(path):
                _half_then_die(path, safetensors.torch.save(tensors, *a, **kw))
            return save_file(tensors, path, *a, **kw)

        def torch_save_hook(obj, path, *a, **kw):
            if counted(path):
                import io

                buf = io.BytesIO()
                save(obj, buf)
                _half_then_die(path, buf.getvalue())
            return save(obj, path, *a, **kw)

        safetensors.torch.save_file, torch.save = save_file_hook, torch_save_hook
    elif what == "ckpt-rename":
        fsync_tree = checkpointing.fsync_tree

        def before_rename(path):
            fsync_tree(path)
            if nth(args[0]):
                _die()

        checkpointing.fsync_tree = before_rename
    elif what == "prune":
        rmtree = shutil.rmtree

        def half_removed(path, *a, **kw):
            p = Path(path)
            if p.name.endswith(".old") and p.is_dir() and nth(args[0]):
                (p / "trained.safetensors").unlink()  # part of it gone, then the kill
                _die()
            return rmtree(path, *a, **kw)

        shutil.rmtree = half_removed
    elif what == "model-file":
        real = mu.safe_save_file

        def model_file(tensors, path, *a, **kw):
            if str(path).endswith(args[0]):
                _half_then_die(path, safetensors.torch.save(tensors, metadata=kw.get("metadata")))
            return real(tensors, path, *a, **kw)

        mu.safe_save_file = model_file
    elif what == "method-file":
        save_file = safetensors.torch.save_file

        def method_file(tensors, path, *a, **kw):
            if str(path).endswith(checkpoint.PATCH_WEIGHTS):
                _half_then_die(path, safetensors.torch.save(tensors, *a, **kw))
            return save_file(tensors, path, *a, **kw)

        safetensors.torch.save_file = method_file
    elif what in ("save-swap", "save-after-swap"):
        if what == "save-swap":
            fsync_tree = checkpoint.fsync_tree

            def before_swap(path):
                fsync_tree(path)
                _die()

            checkpoint.fsync_tree = before_swap
        else:
            rmtree = shutil.rmtree

            def after_swap(path, *a, **kw):
                if ".partial-" in str(path) and Path(path).exists():
                    _die()
                return rmtree(path, *a, **kw)

            shutil.rmtree = after_swap
    else:
        raise ValueError(kill)


def _child(log: str, kill: tuple | None, job: str, *args) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    torch.set_num_threads(1)
    if kill is not None:
        _arm(kill)
    if job == "finetune":
        register_temp_method()
        from longctx_patch.cli.finetune_cmd import finetune_cmd

        finetune_cmd.main(args=list(args), prog_name="longctx finetune", standalone_mode=False)
    else:
        _save(*args)


def _start(tmp: Path, kill, job: str, *args):
    p = CTX.Process(target=_child, args=(str(tmp / "child.log"), kill, job, *args))
    p.start()
    return p


def _run(tmp: Path, kill, job: str, *args) -> int:
    p = _start(tmp, kill, job, *args)
    p.join(600)
    assert p.exitcode is not None, "the child did not end"
    return p.exitcode


def _log_tail(tmp: Path) -> str:
    return (tmp / "child.log").read_text(errors="replace")[-3000:]


# ----------------------------------------------------------------------------------------------- fine-tune
@pytest.fixture(scope="module")
def run_inputs(tmp_path_factory):
    """A tiny llama with a byte tokenizer, a text, and a two-stage recipe (attention transfer of the test method with
    noise, then LoRA with dropout), a checkpoint every 2 steps, the 2 newest kept."""
    root = tmp_path_factory.mktemp("interrupted")
    model_dir = root / "tiny"
    tiny_model("llama", vocab_size=260, num_hidden_layers=2).save_pretrained(model_dir)
    byte_tokenizer().save_pretrained(model_dir)
    text = root / "book.txt"
    text.write_text(TEXT * 12)
    d = recipe_dict(model_dir, text, transfer={"steps": 6, "save_every": 2, "eval_every": 0},
                    lora={"steps": 6, "save_every": 2})
    d["method_config"] = {"noise": 0.1}  # the transfer stage draws from the RNG too (LoRA's initialisation follows it)
    d["output"]["keep_checkpoints"] = 2
    return root, write_recipe(root / "recipe.yaml", d)


def _outputs(out: Path) -> dict[str, torch.Tensor]:
    """Every tensor a run leaves: the method weights and the adapter (trainable/), the merged model (model/)."""
    files = {"method": out / "trainable" / "longctx_patch.safetensors",
             "adapter": out / "trainable" / "adapter" / "adapter_model.safetensors",
             "model": out / "model" / "model.safetensors"}
    return {f"{k}:{n}": t for k, f in files.items() for n, t in load_file(str(f)).items()}


def test_a_finetune_killed_anywhere_resumes_to_the_same_weights(run_inputs, tmp_path):
    root, recipe = run_inputs
    ref_out, out = tmp_path / "ref", tmp_path / "run"
    args = [str(recipe), "--quiet"]
    assert _run(tmp_path, None, "finetune", *args, "--output", str(ref_out)) == 0, _log_tail(tmp_path)
    ref = _outputs(ref_out)
    ckpts = out / "checkpoints"
    resume = [*args, "--output", str(out), "--resume"]
    killed = -signal.SIGKILL

    # before the 4th optimizer step: the checkpoint of step 2 is the newest
    assert _run(tmp_path, ("step", 4), "finetune", *args, "--output", str(out)) == killed, _log_tail(tmp_path)
    assert sorted(p.name for p in ckpts.iterdir()) == ["stage0-step0000002"]
    # half-way through the optimizer state of the next checkpoint: left as .tmp, not a checkpoint
    assert _run(tmp_path, ("ckpt-file", "optimizer.pt", 1), "finetune", *resume) == killed, _log_tail(tmp_path)
    assert sorted(p.name for p in ckpts.iterdir()) == ["stage0-step0000002", "stage0-step0000004.tmp"]
    # and half-way through its trained tensors
    assert _run(tmp_path, ("ckpt-file", "trained.safetensors", 1), "finetune", *resume) == killed, _log_tail(tmp_path)
    assert sorted(p.name for p in ckpts.iterdir()) == ["stage0-step0000002", "stage0-step0000004.tmp"]
    # every file on disk, the rename not done
    assert _run(tmp_path, ("ckpt-rename", 1), "finetune", *resume) == killed, _log_tail(tmp_path)
    assert sorted(p.name for p in ckpts.iterdir()) == ["stage0-step0000002", "stage0-step0000004.tmp"]
    # the checkpoint of step 4 written, that of step 6 (the stage's end) too, and the removal of step 2's cut short
    assert _run(tmp_path, ("prune", 1), "finetune", *resume) == killed, _log_tail(tmp_path)
    assert sorted(p.name for p in ckpts.iterdir()) == ["stage0-step0000002.old", "stage0-step0000004",
                                                       "stage0-step0000006"]
    # at a random moment of the LoRA stage (once its first checkpoint is written): anything from a step to a write
    p = _start(tmp_path, None, "finetune", *resume)
    deadline = time.time() + 300
    while not (ckpts / "stage1-step0000002").exists() and p.is_alive() and time.time() < deadline:
        time.sleep(0.02)
    time.sleep(random.uniform(0.0, 1.0))
    if p.is_alive():
        os.kill(p.pid, signal.SIGKILL)
    p.join(600)
    assert p.exitcode in (killed, 0), _log_tail(tmp_path)
    # half-way through the final model's weights: model/ as it was (absent, unless the random kill came after the
    # end), its staging folder refused by name
    had_model = (out / "model").exists()
    assert _run(tmp_path, ("model-file", "model.safetensors"), "finetune", *resume) == killed, _log_tail(tmp_path)
    assert (out / "model").exists() == had_model
    staging = [p for p in out.iterdir() if p.name.startswith(".model.partial-")]
    assert len(staging) == 1
    with pytest.raises(CheckpointError, match="interrupted save_patched"):
        lp.load_patched(staging[0])
    # the end
    assert _run(tmp_path, None, "finetune", *resume) == 0, _log_tail(tmp_path)
    got = _outputs(out)
    assert sorted(got) == sorted(ref)
    for k, t in ref.items():
        assert torch.equal(got[k], t), k
    assert not [p for p in out.iterdir() if ".partial-" in p.name]  # the killed save's leftovers are gone


# ----------------------------------------------------------------------------------------------- save_patched
def _model(seed: int):
    """A patched tiny model whose method weights depend on `seed`."""
    model = tiny_model("llama")
    lp.patch(model, "ovq", layers=[0, 2])
    with torch.no_grad():
        for mod in lp.patcher.patched_modules(model).values():
            mod.ovq_log_beta.add_(0.1 * seed)
    return model


def _save(target: str, seed: int) -> None:
    lp.save_patched(_model(seed), target)


def _logits(model) -> torch.Tensor:
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("kill,which", [
    (("model-file", "model.safetensors"), "previous"),
    (("method-file",), "previous"),
    (("save-swap",), "previous"),
    (("save-after-swap",), "new"),
])
def test_an_interrupted_save_leaves_a_loadable_folder(tmp_path, kill, which):
    target = tmp_path / "saved"
    lp.save_patched(_model(1), target)
    before = _logits(lp.load_patched(target))
    assert _run(tmp_path, kill, "save", str(target), 2) == -signal.SIGKILL, _log_tail(tmp_path)
    after = _logits(lp.load_patched(target))
    expected = before if which == "previous" else _logits(_model(2))
    assert torch.equal(after, expected)
    if which == "previous":  # what the killed save left: refused by name, then removed by the next save
        staging = [p for p in tmp_path.iterdir() if p.name.startswith(".saved.partial-")]
        assert len(staging) == 1
        with pytest.raises(CheckpointError, match=r"interrupted save_patched\(\) of 'saved'"):
            lp.load_patched(staging[0])
        with pytest.raises(CheckpointError, match="interrupted save_patched"):
            lp.load_model(str(staging[0]))
        lp.save_patched(_model(3), target)
        assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name]
        assert torch.equal(_logits(lp.load_patched(target)), _logits(_model(3)))


def test_a_killed_first_save_leaves_no_folder(tmp_path):
    target = tmp_path / "saved"
    assert _run(tmp_path, ("save-swap",), "save", str(target), 1) == -signal.SIGKILL, _log_tail(tmp_path)
    assert not target.exists()
    with pytest.raises(CheckpointError, match="not found"):
        lp.load_patched(target)


@pytest.mark.parametrize("damage", ["model.safetensors cut", "config.json missing", "tokenizer file missing"])
def test_a_half_written_folder_is_refused_by_name(tmp_path, damage):
    """A folder that lost a file or holds a cut weights file (an interrupted copy) is refused before transformers
    reads it; a config edited by hand is not taken for damage."""
    from transformers import AutoTokenizer

    target = tmp_path / "saved"
    tok = AutoTokenizer.from_pretrained(lp.models._resolve_path("smollm2-135m"))
    lp.save_patched(_model(1), target, tokenizer=tok)
    if damage == "model.safetensors cut":
        data = (target / "model.safetensors").read_bytes()
        (target / "model.safetensors").write_bytes(data[: len(data) // 2])
        phrase = r"model.safetensors is cut short or changed \(\d+ bytes, \d+ written\)"
    elif damage == "config.json missing":
        (target / "config.json").unlink()
        phrase = "config.json is missing"
    else:
        (target / "tokenizer.json").unlink()
        phrase = "tokenizer.json is missing"
    for load in (lp.load_patched, lp.load_model):
        with pytest.raises(CheckpointError, match=rf"{target} is incomplete \({phrase}.*copy it again") as e:
            load(str(target))
        assert "\n" not in str(e.value)


def test_a_config_edited_by_hand_still_loads(tmp_path):
    import json

    target = tmp_path / "saved"
    lp.save_patched(_model(1), target)
    cfg = json.loads((target / "config.json").read_text())
    cfg["max_position_embeddings"] = 4096
    (target / "config.json").write_text(json.dumps(cfg, indent=4))
    assert lp.load_patched(target).config.max_position_embeddings == 4096


def test_save_patched_refuses_to_replace_a_folder_it_did_not_write(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(lp.ConfigError, match=r"holds files save_patched\(\) did not write \(notes.txt\).*replaced as "
                                             "a whole"):
        lp.save_patched(_model(1), tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "mine"
    lp.save_patched(_model(1), tmp_path / "new")  # a new folder, then the same one again: replaced whole
    (tmp_path / "new" / "extra.bin").write_bytes(b"x")
    lp.save_patched(_model(2), tmp_path / "new")
    assert not (tmp_path / "new" / "extra.bin").exists()
    assert torch.equal(_logits(lp.load_patched(tmp_path / "new")), _logits(_model(2)))
