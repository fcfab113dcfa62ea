"""Where results go by default: $LONGCTX_RESULTS, else longctx-results/ of the working directory (ignored by git in a
checkout, never its tracked tree); an explicit --out-dir wins over both."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

import longctx_patch.evals.common as common
from longctx_patch.cli.main import main

from conftest import tiny_model

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def no_env(monkeypatch, tmp_path):
    from longctx_patch.models import cache_dir

    monkeypatch.delenv(common.RESULTS_ENV, raising=False)
    # the embedded model's dequantised copy stays where it is (under a new HOME its first load would make it again)
    monkeypatch.setenv("LONGCTX_CACHE", str(cache_dir()))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))


def test_results_go_to_longctx_results_of_the_working_directory(no_env, tmp_path, monkeypatch):
    assert common.default_results_dir(tmp_path) == tmp_path / "longctx-results"
    monkeypatch.chdir(tmp_path)
    assert common.default_results_dir() == tmp_path / "longctx-results"
    assert common.DEFAULT_RESULTS_DIR == tmp_path / "longctx-results"


def test_inside_a_checkout_results_stay_out_of_its_tracked_tree(no_env, monkeypatch):
    """Run from a clone's root (as the README's commands are), results land in its longctx-results/, which git
    ignores: `git status` stays clean."""
    monkeypatch.chdir(REPO)
    d = common.default_results_dir()
    assert d == REPO / "longctx-results"
    assert not d.resolve().is_relative_to((REPO / "evals").resolve())
    if (REPO / ".git").exists():
        probe = "longctx-results/niah/a.json"
        r = subprocess.run(["git", "check-ignore", "-q", "--no-index", probe], cwd=REPO)
        assert r.returncode == 0, f"{probe} is not ignored by the checkout's .gitignore"


def test_the_environment_variable_wins(no_env, tmp_path, monkeypatch):
    monkeypatch.setenv(common.RESULTS_ENV, str(tmp_path / "mine"))
    assert common.default_results_dir(REPO) == tmp_path / "mine"
    assert common.default_results_dir(tmp_path) == tmp_path / "mine"
    assert common.DEFAULT_RESULTS_DIR == tmp_path / "mine"
    monkeypatch.setenv(common.RESULTS_ENV, "~/res")
    assert common.default_results_dir(tmp_path) == tmp_path / "home" / "res"
    monkeypatch.setenv(common.RESULTS_ENV, "")  # empty: not set
    assert common.default_results_dir(tmp_path) == tmp_path / "longctx-results"


def test_repo_root_finds_this_checkout_only(tmp_path):
    assert common.repo_root(REPO) == REPO
    assert common.repo_root(REPO / "docs") == REPO
    other = tmp_path / "other"
    (other / "longctx_patch").mkdir(parents=True)
    (other / "longctx_patch" / "__init__.py").write_text("")
    (other / "pyproject.toml").write_text('[project]\nname = "some-other-project"\nversion = "0"\n')
    assert common.repo_root(other) is None


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
    assert not (tmp_path / "default").exists() and not (tmp_path / "longctx-results").exists()


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
    assert not (tmp_path / "longctx-results").exists()
    summary = {"device": "cpu", "date": "d", "commit": "c", "command": "x"}
    assert write_results("run1", summary) == tmp_path / "default" / "finetune" / "run1.json"
    assert common.output_dir(None, "niah") is None  # None still means: write nothing


def test_cli_without_env_or_out_dir_writes_into_longctx_results(no_env, tmp_path, monkeypatch):
    import longctx_patch as lp

    model_dir = tmp_path / "tiny"
    tok = lp.models.load_tokenizer("smollm2-135m")
    tiny_model("llama", vocab_size=len(tok)).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    r = CliRunner().invoke(main, ["eval", "approx", "--model", str(model_dir), "--method", "exact", "--length", "32",
                                  "--lengths", "16", "--name", "a"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert (work / "longctx-results" / "approx" / "a.json").is_file()
