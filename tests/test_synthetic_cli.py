"""`longctx eval icr` / `longctx eval icl` commands at tiny sizes on the CPU."""

import json

import pytest
from click.testing import CliRunner

from longctx_patch.cli.eval_synthetic_cmd import icl_cmd, icr_cmd

TINY = ["--device", "cpu", "--d-model", "16", "--layers", "1", "--steps", "3", "--lrs", "1e-3",
        "--tokens-per-step", "128", "--eval-sequences", "2", "--quiet"]


pytestmark = pytest.mark.usefixtures("one_thread")


def test_icr_command_writes_results(tmp_path):
    res = CliRunner().invoke(icr_cmd, ["--variant", "both", "--lengths", "64,96", "--num-keys", "32", "--num-values", "32",
                                       "--mixers", "softmax,linear(chunk=16)", "--out-dir", str(tmp_path), "--name", "t", *TINY])
    assert res.exit_code == 0, res.output
    for var in ("basic", "positional"):
        data = json.loads((tmp_path / f"t-{var}.json").read_text())
        assert data["task"] == "icr" and data["task_config"]["variant"] == var
        assert data["command"].startswith("longctx eval icr") and data["commit"] and data["date"]
        assert data["method"] == ["softmax", "linear(chunk=16)"]
        assert set(data["summary"]["softmax"]["by_length"]) == {"64", "96"}
        assert (tmp_path / f"t-{var}-length.png").exists() and (tmp_path / f"t-{var}-state.png").exists()
    assert "accuracy@64" in res.output and "warning" not in res.output


def test_old_mixer_form_warns_and_runs_as_the_new_one(tmp_path):
    res = CliRunner().invoke(icr_cmd, ["--variant", "basic", "--lengths", "64", "--num-keys", "32", "--num-values", "32",
                                       "--mixers", "softmax,linear:chunk=16", "--out-dir", str(tmp_path), "--name", "t",
                                       "--no-plots", *TINY])
    assert res.exit_code == 0, res.output
    assert ("warning: mixer 'linear:chunk=16': the NAME:KEY=VALUE form is deprecated and will be removed; "
            "write 'linear(chunk=16)'") in res.output
    data = json.loads((tmp_path / "t-basic.json").read_text())
    assert data["method"] == ["softmax", "linear(chunk=16)"]
    assert data["mixer_options"]["linear(chunk=16)"] == {"chunk": 16}


def test_icl_command_and_errors(tmp_path):
    res = CliRunner().invoke(icl_cmd, ["--functions", "3", "--dim", "2", "--lengths", "64", "--mixers", "softmax",
                                       "--curriculum", "32:0.5", "--out-dir", str(tmp_path), "--no-plots", *TINY])
    assert res.exit_code == 0, res.output
    data = json.loads((tmp_path / "icl-F3.json").read_text())
    assert data["summary"]["softmax"]["eval"]["64"]["mse_by_shots"]
    assert data["train_config"]["curriculum_length"] == 32 and data["train_config"]["curriculum_fraction"] == 0.5
    bad = CliRunner().invoke(icr_cmd, ["--curriculum", "64", "--out-dir", str(tmp_path), *TINY])
    assert bad.exit_code == 2 and "LENGTH:FRACTION" in bad.output
    bad = CliRunner().invoke(icr_cmd, ["--mixers", "mamba", "--out-dir", str(tmp_path), *TINY])
    assert bad.exit_code == 2 and "unknown mixer" in bad.output
    bad = CliRunner().invoke(icr_cmd, ["--mixers", "softmax,ovq(window=3)", "--out-dir", str(tmp_path), *TINY])
    assert bad.exit_code == 2 and "allowed keys: max_centroids, growth, chunk, beta, backend" in bad.output
    bad = CliRunner().invoke(icr_cmd, ["--lengths", "8k", "--num-keys", "16", "--mixers", "softmax",
                                       "--out-dir", str(tmp_path), *TINY])
    assert bad.exit_code == 1 and "num_keys" in bad.output
