"""Where results go by default: $LONGCTX_RESULTS, else benchmarks/results of the checkout the working directory is in,
else the user's data folder; an explicit --out-dir wins over all of them."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

import longctx_patch.evals.common as common
from cli.main import main

from conftest import tiny_model

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def no_env(monkeypatch, tmp_path):
    monkeypatch.delenv(common.RESULTS_ENV, raising=False)
    monkeypatch.delenv("XDG_DATA_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))


def fake_checkout(root: Path, name: str = "longctx-patch") -> Path:
    (root / "longctx_patch").mkdir(parents=True)
    (root / "longctx_patch" / "__init__.py").write_text("")
    (root / "pyproject.toml").write_text(f'[project]\nname = "{name}"\nversion = "0"\n')
    return root


def test_inside_this_checkout_results_go_to_its_evals_results(no_env, monkeypatch):
    assert common.repo_root(REPO) == REPO
    assert common.default_results_dir(REPO) == REPO / "benchmarks" / "results"
    assert common.default_results_dir(REPO / "docs") == REPO / "benchmarks" / "results"  # from a subfolder too
    monkeypatch.chdir(REPO / "tests")
    assert common.default_results_dir() == REPO / "benchmarks" / "results"
    assert common.DEFAULT_RESULTS_DIR == REPO / "benchmarks" / "results"


def test_a_copy_of_the_tree_without_git_is_a_checkout(no_env, tmp_path):
    root = fake_checkout(tmp_path / "copy")
    assert not (root / ".git").exists()
    assert common.default_results_dir(root / "longctx_patch") == root / "benchmarks" / "results"


def test_outside_a_checkout_results_go_to_the_user_data_folder(no_env, tmp_path, monkeypatch):
    other = fake_checkout(tmp_path / "other", name="some-other-project")  # another project's tree is not ours
    assert common.repo_root(other) is None
    want = tmp_path / "home" / ".local" / "share" / "longctx-patch" / "results"
    assert common.default_results_dir(other) == want
    monkeypatch.chdir(tmp_path)
    assert common.default_results_dir() == want
    assert common.DEFAULT_RESULTS_DIR == want
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert common.default_results_dir() == tmp_path / "xdg" / "longctx-patch" / "results"


def test_the_environment_variable_wins_inside_and_outside_a_checkout(no_env, tmp_path, monkeypatch):
    monkeypatch.setenv(common.RESULTS_ENV, str(tmp_path / "mine"))
    assert common.default_results_dir(REPO) == tmp_path / "mine"
    assert common.default_results_dir(tmp_path) == tmp_path / "mine"
    assert common.DEFAULT_RESULTS_DIR == tmp_path / "mine"
    monkeypatch.setenv(common.RESULTS_ENV, "~/res")
    assert common.default_results_dir(tmp_path) == tmp_path / "home" / "res"
    monkeypatch.setenv(common.RESULTS_ENV, "")  # empty: not set
    assert common.default_results_dir(REPO) == REPO / "benchmarks" / "results"


def test_cli_out_dir_wins_over_the_default(no_env, tmp_path, monkeypatch):
    import longctx_patch as lp

    model_dir = tmp_path / "tiny"
    tok = lp.models.load_tokenizer("smollm2-135m")
    tiny_model("llama", vocab_size=len(tok)).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    monkeypatch.setenv(common.RESULTS_ENV, str(tmp_path / "default"))
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "explicit"
    r = CliRunner().invoke(main, ["eval", "approx", "--model", str(model_dir), "--method", "exact", "--length", "32",
                                  "--lengths", "16", "--out-dir", str(out), "--name", "a"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert (out / "a.json").is_file()
    assert not (tmp_path / "default").exists() and not (tmp_path / "benchmarks").exists()


def test_cli_without_out_dir_writes_into_the_default_folders_task_subfolder(no_env, tmp_path, monkeypatch):
    import longctx_patch as lp
    from longctx_patch.train.runner import write_results

    model_dir = tmp_path / "tiny"
    tok = lp.models.load_tokenizer("smollm2-135m")
    tiny_model("llama", vocab_size=len(tok)).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    monkeypatch.setenv(common.RESULTS_ENV, str(tmp_path / "default"))
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(main, ["eval", "approx", "--model", str(model_dir), "--method", "exact", "--length", "32",
                                  "--lengths", "16", "--name", "a"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert (tmp_path / "default" / "approx" / "a.json").is_file()
    assert not (tmp_path / "benchmarks").exists()
    summary = {"device": "cpu", "date": "d", "commit": "c", "command": "x"}
    assert write_results("run1", summary) == tmp_path / "default" / "finetune" / "run1.json"
    assert common.output_dir(None, "niah") is None  # None still means: write nothing
