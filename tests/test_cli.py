"""CLI verbs run, and bad input exits non-zero with one readable line."""

import json

import pytest
from click.testing import CliRunner

from cli.main import main

from conftest import tiny_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny llama saved with a real tokenizer (the embedded model's), so every verb can run fast."""
    import longctx_patch as lp

    d = tmp_path_factory.mktemp("tiny")
    tok = lp.models.load_tokenizer("smollm2-135m")
    model = tiny_model("llama", vocab_size=len(tok))
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d


def run(*args):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_help_on_every_verb():
    for verb in ([], ["info"], ["patch"], ["generate"]):
        r = run(*verb, "--help")
        assert r.exit_code == 0 and "Usage" in r.output


def test_info_lists_methods_and_options():
    r = run("info")
    assert r.exit_code == 0
    assert "sliding-window" in r.output and "window = 256" in r.output
    assert "llama, mistral, qwen2, qwen3" in r.output and "CUDA:" in r.output and "Triton:" in r.output


def test_patch_summary_fidelity_and_output(tiny_dir, tmp_path):
    out = tmp_path / "saved"
    r = run("patch", "--model", str(tiny_dir), "--method", "sliding-window", "--set", "window=16",
            "--layers", "0-1", "--fidelity-tokens", "64", "--output", str(out), "--device", "cpu")
    assert r.exit_code == 0, r.output
    assert "layers patched: 2/3" in r.output
    assert "131072" in r.output and "next-token agreement" in r.output
    rec = json.loads((out / "longctx_patch.json").read_text())
    assert rec["method"] == "sliding-window" and rec["layers"] == [0, 1]
    r = run("generate", "--model", str(out), "--prompt", "hello", "--max-new-tokens", "3", "--no-chat")
    assert r.exit_code == 0, r.output


def test_generate_stream_and_prompt_file(tiny_dir, tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("Once upon a time")
    r = run("generate", "--model", str(tiny_dir), "--method", "exact", "--prompt-file", str(f), "-n", "4", "--stream")
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize(
    "args,needle",
    [
        (["patch", "--method", "nope"], "unknown method 'nope'"),
        (["patch", "--method", "sliding-window", "--set", "windw=3"], "unknown key(s) windw"),
        (["patch", "--method", "sliding-window", "--set", "window=-1"], "allowed: int >= 1"),
        (["patch", "--method", "sliding-window", "--set", "window"], "not key=value"),
        (["generate"], "exactly one of --prompt or --prompt-file"),
        (["generate", "--model", "/nonexistent/x.gguf", "--prompt", "hi"], "not found"),
        (["generate", "--prompt", "hi", "--set", "window=3"], "--set/--layers need --method"),
        (["generate", "--model", "/nonexistent/dir", "--prompt", "hi"], "no such directory or file"),
        # eval's inline NAME(KEY=VALUE,...) form, checked before the model loads
        (["patch", "--method", "lola(window=-3)"], "bad value -3 for window"),
        (["patch", "--method", "lola(foo=1)"], "unknown key(s) foo"),
        (["generate", "--method", "lola(window=64", "--prompt", "hi"], "NAME(KEY=VALUE,...)"),
        (["generate", "--method", "exact(layers=0-1)", "--layers", "1", "--prompt", "hi"], "keep one"),
        (["patch", "--method", "exact", "--layers", "abc"], "cannot read 'abc'"),
    ],
)
def test_bad_input_one_line_nonzero(args, needle):
    r = CliRunner().invoke(main, args)
    assert r.exit_code != 0
    assert needle in r.output
    assert "Traceback" not in r.output
    errors = [line for line in r.output.splitlines() if line.startswith("error:") or line.startswith("Error:")]
    assert len(errors) == 1


def test_inline_method_config_patches(tiny_dir):
    """`--method 'NAME(KEY=VALUE,...)'` works for patch and generate as for eval, inline layers included."""
    r = run("patch", "--model", str(tiny_dir), "--method", "sliding-window(window=3,layers=0)", "--fidelity-tokens", "16")
    assert r.exit_code == 0, r.output
    assert "'window': 3" in r.output and "on layers 0 " in r.output


def test_python_patch_explains_the_inline_form():
    import longctx_patch as lp
    from longctx_patch.errors import ConfigError

    with pytest.raises(ConfigError, match=r"patch\(model, 'lola', window=8\)"):
        lp.get_method("lola(window=8)")


def test_debug_shows_traceback():
    r = CliRunner().invoke(main, ["--debug", "patch", "--method", "nope"])
    assert r.exit_code != 0
    assert "Traceback" in r.output


def test_real_model_patch_summary():
    """The issue's 'done when' command, with a shorter sample to keep the suite fast."""
    r = run("patch", "--model", "smollm2-135m", "--method", "sliding-window", "--set", "window=256",
            "--fidelity-tokens", "384", "--device", "cpu")
    assert r.exit_code == 0, r.output
    assert "layers patched: 30/30" in r.output
    assert "8192" in r.output and "0.0311" in r.output  # 255/8192 of the full KV cache at 8k
