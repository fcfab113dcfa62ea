"""Every damaged file that resuming a run or loading a saved model reads is a CheckpointError that names the file and
says what to do: a run's checkpoint (trained.safetensors, state.json), a PEFT adapter saved as a pickle, a method
tensor that is not floating-point, NaN or inf in a saved patched model's base weights."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import longctx_patch as lp
from longctx_patch.checkpoint import PATCH_WEIGHTS
from longctx_patch.errors import CheckpointError

from conftest import tiny_model
from test_train import recipe_dict, temp_method, text_file, tiny_dir  # noqa: F401 - fixtures

pytestmark = pytest.mark.usefixtures("one_thread_module")


class _WritesMarker:
    """Unpickling this writes a marker file: a stand-in for a crafted file that runs code."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').write('ran')",))


# ----------------------------------------------------------------------------------------------- a run's checkpoint
@pytest.fixture(scope="module")
def checkpointed(tiny_dir, text_file, temp_method, tmp_path_factory):  # noqa: F811 - fixtures
    """A run interrupted after its step-2 checkpoint (attention transfer, 4 steps): (recipe, run folder, checkpoint,
    a pristine copy of the checkpoint)."""
    from longctx_patch.train import Finetuner, recipe_from_dict
    from longctx_patch.train import runner as runner_mod

    d = recipe_dict(tiny_dir, text_file, transfer={"steps": 4, "save_every": 2, "eval_every": 0})
    d["stages"] = d["stages"][:1]
    d["output"]["save_model"] = False
    out = tmp_path_factory.mktemp("run") / "out"

    class Interrupt(Exception):
        pass

    orig = runner_mod.Finetuner.save_checkpoint

    def save_then_stop(self, *a, **kw):
        orig(self, *a, **kw)
        raise Interrupt

    runner_mod.Finetuner.save_checkpoint = save_then_stop
    try:
        with pytest.raises(Interrupt):
            Finetuner(recipe_from_dict(d), out, progress=False).run()
    finally:
        runner_mod.Finetuner.save_checkpoint = orig
    ckpt = out / "checkpoints" / "stage0-step0000002"
    assert sorted(p.name for p in ckpt.parent.iterdir()) == [ckpt.name]
    pristine = out.parent / "pristine"
    shutil.copytree(out, pristine)
    return d, out, ckpt, pristine


@pytest.fixture
def run_folder(checkpointed):
    """The interrupted run folder as it was left (restored after each test: a resume writes into it)."""
    d, out, ckpt, pristine = checkpointed
    yield d, out, ckpt
    shutil.rmtree(out)
    shutil.copytree(pristine, out)


def _resume(d, out):
    from longctx_patch.train import Finetuner, recipe_from_dict

    return Finetuner(recipe_from_dict(d), out, resume=True, progress=False).run()


def test_the_untouched_checkpoint_resumes(run_folder):
    d, out, ckpt = run_folder
    log = _resume(d, out)
    assert log["stages"][0]["resumed_from_step"] == 2 and log["stages"][0]["steps_done"] == 4


def _garbage_header(path: Path) -> None:
    path.write_bytes((10**12).to_bytes(8, "little") + b"{}" * 20)  # a header length past the file: "header too large"


def _with(path: Path, **changes) -> None:
    sd = load_file(str(path))
    for k, fn in changes.items():
        name = next(n for n in sd if k in n)
        sd[name] = fn(sd[name])
    save_file(sd, str(path))


@pytest.mark.parametrize("damage,phrase", [
    (_garbage_header, "cannot be read as safetensors .*: the file is truncated or corrupt"),
    (lambda p: p.write_bytes(p.read_bytes()[:-5]), "truncated or corrupt"),
    (lambda p: p.write_bytes(b""), "truncated or corrupt"),
    (lambda p: p.unlink(), "lacks trained.safetensors"),
    (lambda p: _with(p, log_t=lambda t: t.fill_(float("nan"))), r"\['.*log_t'\] hold NaN or inf values"),
    (lambda p: _with(p, log_t=lambda t: t.long()), r"holds .*log_t as int64 where the model has float32"),
])
def test_a_damaged_trained_safetensors_is_named(run_folder, damage, phrase):
    d, out, ckpt = run_folder
    damage(ckpt / "trained.safetensors")
    with pytest.raises(CheckpointError, match=phrase) as e:
        _resume(d, out)
    msg = str(e.value)
    assert str(ckpt) in msg and "\n" not in msg, msg
    assert f"delete {ckpt}" in msg and "--resume" in msg, msg


@pytest.mark.parametrize("edit,phrase", [
    (lambda s: s.pop("stage"), "lacks \"stage\""),
    (lambda s: s.pop("step"), "lacks \"step\""),
    (lambda s: s.pop("logs"), "lacks \"logs\""),
    (lambda s: s.update(stage="0"), "\"stage\" is '0', not a stage index"),
    (lambda s: s.update(stage=-1), "\"stage\" is -1, not a stage index"),
    (lambda s: s.update(stage=7), "\"stage\" is 7, but the recipe has 1 stage"),
    (lambda s: s.update(step=2.5), "\"step\" is 2.5, not a step count"),
    (lambda s: s.update(completed="yes"), "\"completed\" is 'yes', not true or false"),
    (lambda s: s.update(logs={"a": 1}), "\"logs\" is .*, not a list of stage logs"),
    (lambda s: s.update(logs=[{"bogus": 1}]), "\"logs\"\\[0\\] is not a stage log"),
    (lambda s: s.update(stage_name=3), "\"stage_name\" is 3, not a stage name"),
])
def test_a_malformed_state_json_is_named(run_folder, edit, phrase):
    d, out, ckpt = run_folder
    state = json.loads((ckpt / "state.json").read_text())
    edit(state)
    (ckpt / "state.json").write_text(json.dumps(state))
    with pytest.raises(CheckpointError, match=phrase) as e:
        _resume(d, out)
    msg = str(e.value)
    assert f"{ckpt / 'state.json'}" in msg and "\n" not in msg, msg
    assert f"delete {ckpt}" in msg, msg


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b"null", b"\xff\xfe\x00", b""])
def test_a_state_json_that_is_not_an_object_is_named(run_folder, content):
    d, out, ckpt = run_folder
    (ckpt / "state.json").write_bytes(content)
    with pytest.raises(CheckpointError, match="state.json") as e:
        _resume(d, out)
    assert str(ckpt) in str(e.value) and f"delete {ckpt}" in str(e.value) and "\n" not in str(e.value)


def test_the_cli_prints_one_line_naming_the_file(run_folder, tmp_path):
    import yaml
    from click.testing import CliRunner

    from longctx_patch.cli.finetune_cmd import finetune_cmd

    d, out, ckpt = run_folder
    _garbage_header(ckpt / "trained.safetensors")
    rec = tmp_path / "r.yaml"
    rec.write_text(yaml.safe_dump(d))
    r = CliRunner().invoke(finetune_cmd, [str(rec), "--output", str(out), "--resume", "--quiet"])
    assert r.exit_code == 1
    errors = [line for line in r.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and str(ckpt / "trained.safetensors") in errors[0], r.output
    assert "Traceback" not in r.output and "SafetensorError" not in r.output


# ----------------------------------------------------------------------------------------------- a PEFT adapter
@pytest.fixture
def trainable_with_adapter(tmp_path):
    """A run's trainable/ folder holding only a LoRA adapter, saved by PEFT as safetensors: (base model, folder)."""
    from peft import LoraConfig

    from conftest import get_peft_model

    base = tiny_model("llama")
    wrapped = get_peft_model(tiny_model("llama"), LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]))
    out = tmp_path / "run"
    wrapped.save_pretrained(str(out / "trainable" / "adapter"))
    return base, out


def test_a_pickled_adapter_is_refused_unread(trainable_with_adapter, tmp_path):
    from longctx_patch.train import apply_trained

    base, out = trainable_with_adapter
    adapter = out / "trainable" / "adapter"
    marker = tmp_path / "marker"
    (adapter / "adapter_model.safetensors").unlink()
    (adapter / "adapter_model.bin").write_bytes(pickle.dumps(_WritesMarker(marker)))
    with pytest.raises(CheckpointError) as e:
        apply_trained(base, out)
    msg = str(e.value)
    assert str(adapter / "adapter_model.bin") in msg and "pickle" in msg and "\n" not in msg, msg
    assert "convert it to safetensors" in msg and "adapter_model.safetensors" in msg, msg
    assert not marker.exists()
    # a pickle of plain tensors is refused the same way: nothing there is unpickled
    torch.save({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(2, 64)},
               adapter / "adapter_model.bin")
    with pytest.raises(CheckpointError, match="convert it to safetensors"):
        apply_trained(base, out)


@pytest.mark.parametrize("damage,phrase", [
    (_garbage_header, "truncated or corrupt"),
    (lambda p: _with(p, lora_B=lambda t: t.fill_(float("inf"))), "hold NaN or inf values"),
])
def test_a_damaged_adapter_is_named(trainable_with_adapter, damage, phrase):
    from longctx_patch.train import apply_trained

    base, out = trainable_with_adapter
    path = out / "trainable" / "adapter" / "adapter_model.safetensors"
    damage(path)
    with pytest.raises(CheckpointError, match=phrase) as e:
        apply_trained(base, out)
    assert str(path) in str(e.value)


def test_the_untouched_adapter_applies(trainable_with_adapter):
    from longctx_patch.train import apply_trained

    base, out = trainable_with_adapter
    assert apply_trained(base, out, merge=True) is not None


# ----------------------------------------------------------------------------------------------- a saved patched model
@pytest.fixture
def saved(tmp_path):
    model = tiny_model()
    lp.patch(model, "ovq", layers=[0, 2])
    lp.save_patched(model, tmp_path / "saved")
    return tmp_path / "saved"


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_a_method_tensor_that_is_not_floating_point_is_refused(saved, dtype):
    path = saved / PATCH_WEIGHTS
    _with(path, **{"layers.2.ovq_log_beta": lambda t: t.to(dtype)})
    with pytest.raises(CheckpointError, match=rf"{path}: holds layers.2.ovq_log_beta as {str(dtype)[6:]} where the "
                                              r"patched model has float32") as e:
        lp.load_patched(saved)
    assert "write it again with save_patched" in str(e.value)
    model = tiny_model()
    from longctx_patch.patcher import apply_patch_record

    with pytest.raises(CheckpointError, match="as " + str(dtype)[6:]):
        apply_patch_record(model, saved)
    assert not lp.is_patched(model)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_base_weights_of_a_saved_model_are_refused(tmp_path, value):
    """A model saved after a diverged run (NaN or inf in a base weight) is refused when loaded, naming the file and
    the parameter."""
    model = tiny_model()
    lp.patch(model, "ovq", layers=[0, 2])
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[3, 5] = value
    saved = tmp_path / "saved"
    lp.save_patched(model, saved)
    path = saved / "model.safetensors"
    with pytest.raises(CheckpointError) as e:
        lp.load_patched(saved)
    msg = str(e.value)
    assert str(path) in msg and "model.layers.1.mlp.down_proj.weight" in msg and "NaN or inf" in msg, msg
    assert "\n" not in msg


def test_the_untouched_saved_model_loads(saved):
    assert lp.patched_layers(lp.load_patched(saved)) == {0: "ovq", 2: "ovq"}


def test_an_asset_made_from_a_saved_folder_applies(tmp_path):
    """The record of a saved folder lists its files; an asset holds only some of them, so its copy of the record
    does not list them (a complete asset is not taken for a half-written folder)."""
    from longctx_patch import assets
    from longctx_patch.checkpoint import PATCH_JSON
    from longctx_patch.train import apply_trained

    model = tiny_model()
    lp.patch(model, "lolcats", window=4, chunk=4, checkpoint="none")
    lp.save_patched(model, tmp_path / "saved")
    assert "model.safetensors" in json.loads((tmp_path / "saved" / PATCH_JSON).read_text())["files"]
    out = assets.write_asset(tmp_path / "saved", tiny_model(), tmp_path / "asset", name="t", description="t",
                             dtype=torch.float32)
    assert "files" not in json.loads((out / PATCH_JSON).read_text())
    ids = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(apply_trained(tiny_model(), out)(ids).logits, model(ids).logits)
