"""The README's examples run as shown and quietly: its Python lines raise no warning, and its commands stay the
few-minute runs it promises on a 2-core CPU (docs/cpu.md has their measured times)."""

from __future__ import annotations

import logging
import re
import shlex
import warnings

import pytest

from conftest import REPO, tiny_model


def _blocks(lang: str) -> list[str]:
    """The README's fenced blocks opened with ```LANG (```: no language)."""
    out, cur, inside = [], [], False
    for line in (REPO / "README.md").read_text().splitlines():
        if line.startswith("```"):
            if inside and keep:
                out.append("\n".join(cur) + "\n")
            inside, keep, cur = not inside, line[3:].strip() == lang, []
        elif inside:
            cur.append(line)
    return out


def _commands() -> list[str]:
    lines = []
    for block in _blocks(""):
        lines += [line.split("   #")[0].strip() for line in block.splitlines() if line.startswith("longctx ")]
    return lines


def test_readme_python_lines_run_without_warnings(monkeypatch, one_thread):
    """The README's Python block, on a tiny model with the embedded model's tokenizer in place of the real one: no
    Python warning and no warning logged by transformers (e.g. generate()'s default max_length)."""
    import longctx_patch as lp

    (code,) = _blocks("python")
    tok = lp.models.load_tokenizer("smollm2-135m")
    monkeypatch.setattr(lp, "load_model", lambda name: (tiny_model("llama", vocab_size=len(tok)), tok))
    logged: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            logged.append(record.getMessage())

    handler = Keep(level=logging.WARNING)
    hf = logging.getLogger("transformers")
    hf.addHandler(handler)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            exec(compile(code, "README.md", "exec"), {"__name__": "readme"})
    finally:
        hf.removeHandler(handler)
    assert not logged, logged


def test_readme_commands_stay_small():
    """What keeps the README's commands in minutes on a CPU: the NIAH comparison runs at most 16 prompts, the
    fine-tune is --quick, the fidelity check keeps its default length."""
    cmds = _commands()
    niah = next(c for c in cmds if c.startswith("longctx eval niah"))
    args = shlex.split(niah)

    def opt(name, default):
        return args[args.index(name) + 1] if name in args else default

    n = (args.count("--method") * len(opt("--tasks", "s-niah-1,s-niah-2,s-niah-3,mk-niah").split(","))
         * len(opt("--lengths", "1k,2k,4k,8k").split(",")) * len(opt("--depths", "0,0.25,0.5,0.75,1").split(","))
         * int(opt("--samples", "1")))
    assert n <= 16, (niah, n)
    assert all("--quick" in c for c in cmds if c.startswith("longctx finetune"))
    assert not any("--fidelity-tokens" in c for c in cmds if c.startswith("longctx patch"))


@pytest.mark.parametrize("marker", ["main-command", "test-command"])
def test_ci_blocks_are_in_place(marker):
    """CI (.ci/run) runs the first fenced block after each marker: both are there, one line each."""
    text = (REPO / "README.md").read_text()
    after = text.split(f"<!-- {marker} -->\n", 1)[1]
    block = re.match(r"```\n(.*?)\n```", after, flags=re.S)
    assert block and "\n" not in block.group(1) and block.group(1).startswith("python3 -m venv .venv")


def test_models_doc_says_which_dtype_on_a_cpu():
    """docs/models.md's Python example loads in fp32 (bf16 is 2.3x slower on a CPU) and says which dtype to use
    where; --dtype's help says it too."""
    from click.testing import CliRunner

    from longctx_patch.cli.main import main

    text = (REPO / "docs" / "models.md").read_text()
    code = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert code and not any("bfloat16" in c or "float16" in c for c in code), code
    assert "on a CPU keep fp32" in " ".join(text.split())
    help_text = " ".join(CliRunner().invoke(main, ["generate", "--help"]).output.split())
    assert "On a CPU use float32" in help_text
