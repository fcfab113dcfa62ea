"""Shared pieces of the evaluation tasks: method selection, length parsing, result files, plots.

A run compares several methods on one loaded model. Methods are given by name (`exact`,
`sliding-window`, ... or `none` for the unpatched model) and configured with `--set` items:
`METHOD.key=value` sets a key of one method, a plain `key=value` sets the key on every selected
method whose config has it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

from ..errors import ConfigError
from ..methods import UNPATCHED, get_method, list_methods, split_method_spec
from ..patcher import parse_layers
from ..provenance import git_commit, result_header

RESULTS_ENV = "LONGCTX_RESULTS"


def repo_root(start: str | os.PathLike | None = None) -> Path | None:
    """The checkout of this project that holds `start` (default: the working directory): the nearest folder, `start`
    or one above it, with this project's pyproject.toml (name "longctx-patch") and the longctx_patch package; None
    outside one. A copy of the tree without its .git counts too."""
    here = Path(start if start is not None else Path.cwd()).resolve()
    for d in (here, *here.parents):
        if (d / "longctx_patch" / "__init__.py").is_file() and (d / "pyproject.toml").is_file():
            try:
                text = (d / "pyproject.toml").read_text()
            except OSError:
                continue
            if re.search(r'^name\s*=\s*"longctx-patch"\s*$', text, re.MULTILINE):
                return d
    return None


RESULTS_FOLDER = "longctx-results"


def default_results_dir(cwd: str | os.PathLike | None = None) -> Path:
    """Where results go when no output folder is given: $LONGCTX_RESULTS when set (set it once, e.g. in your shell's
    profile, to keep every result in one place), else `longctx-results/` in the working directory (`cwd`): never
    inside the tracked files of a checkout of this repository (its .gitignore lists `longctx-results/`). An explicit
    folder (the CLI's --out-dir, a function's out_dir) always wins over this."""
    env = os.environ.get(RESULTS_ENV)
    if env:
        return Path(env).expanduser()
    return Path(cwd if cwd is not None else Path.cwd()) / RESULTS_FOLDER


class _DefaultFolder:
    """The `out_dir` default of the run_* functions: `default_results_dir() / TASK` (None: write nothing)."""

    def __repr__(self) -> str:
        return "<the default results folder>"


RESULTS_DEFAULT = _DefaultFolder()


def output_dir(out_dir, task: str) -> Path | None:
    """The folder a run writes into: None for None, `default_results_dir() / task` for RESULTS_DEFAULT, else
    `out_dir` as given (an explicit folder wins, as the CLI's --out-dir does)."""
    if out_dir is None:
        return None
    if out_dir is RESULTS_DEFAULT:
        return default_results_dir() / task
    return Path(out_dir)


def __getattr__(name: str):
    if name == "DEFAULT_RESULTS_DIR":  # resolved when read: it follows $LONGCTX_RESULTS and the working directory
        return default_results_dir()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ----------------------------------------------------------------------------------------------- methods
@dataclass
class MethodRun:
    """One entry of a comparison: a registered method (or the unpatched model) and its config."""

    name: str  # registered method name, or UNPATCHED[0] ("none") for the unpatched model
    config: dict[str, Any] = field(default_factory=dict)
    layers: str | None = None  # decoder layers to patch, `lp.patch`'s syntax ('0-3,26-29'); None: every layer
    # every option as the patch ran it (set by `applied`): the config's defaults and any an asset chose for the
    # model (e.g. lola's window on the linearized Qwen) besides `config`, so a result says what ran
    effective: dict[str, Any] | None = field(default=None, compare=False)

    @property
    def patched(self) -> bool:
        return self.name not in UNPATCHED

    @property
    def reference(self) -> bool:
        """Whether this run attends as the model does (unpatched, or a method of `Method.exact_reference`): the
        baseline the evaluations measure the other runs against."""
        return not self.patched or get_method(self.name).exact_reference

    @property
    def label(self) -> str:
        items = [f"{k}={v}" for k, v in self.config.items()]
        if self.layers is not None:
            items.append("layers=" + self.layers.replace(",", "+"))  # ',' separates the inline items
        if not items:
            return self.name
        return self.name + "(" + ",".join(items) + ")"


def _config_keys(name: str) -> list[str]:
    cls = get_method(name).config_cls
    return [f.name for f in dataclasses.fields(cls)]


def inline_layers(value: str) -> str:
    """An inline `layers=RANGES` item -> `lp.patch`'s layers syntax: the items of NAME(...) are comma-separated,
    so ranges are joined by '+' (layers=0-3+26-29 -> '0-3,26-29'). The syntax is checked now; the range is
    checked against the model when it is patched."""
    layers = value.strip().replace("+", ",")
    parse_layers(layers, sys.maxsize)
    return layers


def parse_methods(methods: Sequence[str], sets: Sequence[str] = ()) -> list[MethodRun]:
    """Turns `--method` names and `--set` items into validated `MethodRun`s, e.g.
    `parse_methods(["exact", "sliding-window"], ["sliding-window.window=256"])`.

    A method can carry its own config inline, `NAME(KEY=VALUE,...)`, so that one method is compared with
    itself under several configs: `parse_methods(["lola(window=64,sparse_cache=64)", "lola"])`. `--set
    NAME.KEY=VALUE` applies to every entry of NAME; inline values win over `--set` ones."""
    if not methods:
        raise ConfigError("no method given; pass --method NAME (e.g. --method exact), or --method none for the unpatched model")
    known = list_methods()
    runs: list[MethodRun] = []
    inline: list[dict[str, str]] = []
    for raw in methods:
        base, items = split_method_spec(raw)
        name = base.strip().lower().replace("_", "-")
        if name in UNPATCHED:
            name = UNPATCHED[0]
        if name not in UNPATCHED and name not in known:
            raise ConfigError(f"unknown method {raw!r}; choose from: none, {', '.join(known)}")
        if name in UNPATCHED and items:
            raise ConfigError(f"--method {raw!r}: the unpatched model ('none') has no config")
        own = {}
        run_layers = None
        for item in items:
            k, v = item.split("=", 1)
            k = k.strip()
            if k == "layers" and "layers" not in _config_keys(name):
                run_layers = inline_layers(v)
                continue
            if k not in _config_keys(name):
                raise ConfigError(f"--method {raw!r}: {name} has no key {k!r}; its keys: {', '.join(_config_keys(name))}, "
                                  f"and layers=RANGES (which decoder layers to patch, e.g. layers=0-23)")
            own[k] = v.strip()
        runs.append(MethodRun(name, layers=run_layers))
        inline.append(own)
    names = {r.name for r in runs}
    for item in sets:
        if "=" not in item:
            raise ConfigError(f"bad --set {item!r}: write METHOD.KEY=VALUE or KEY=VALUE, e.g. --set sliding-window.window=256")
        lhs, value = item.split("=", 1)
        lhs, value = lhs.strip(), value.strip()
        targets: list[MethodRun]
        if "." in lhs:
            mname, key = lhs.rsplit(".", 1)
            mname = mname.lower().replace("_", "-")
            if mname not in names:
                raise ConfigError(
                    f"--set {item!r} names method {mname!r}, which is not selected; selected: {', '.join(sorted(names))}"
                )
            if mname in UNPATCHED:
                raise ConfigError(f"--set {item!r}: the unpatched model ('none') has no config")
            if key not in _config_keys(mname):
                raise ConfigError(
                    f"--set {item!r}: {mname} has no key {key!r}; its keys: {', '.join(_config_keys(mname)) or '(none)'}"
                )
            targets = [r for r in runs if r.name == mname]
        else:
            key = lhs
            targets = [r for r in runs if r.patched and key in _config_keys(r.name)]
            if not targets:
                raise ConfigError(
                    f"--set {item!r}: no selected method has a key {key!r}; use METHOD.KEY=VALUE with one of: "
                    + "; ".join(f"{r.name}: {', '.join(_config_keys(r.name)) or '(none)'}" for r in runs if r.patched)
                )
        if not key:
            raise ConfigError(f"bad --set {item!r}: the key is empty")
        for r in targets:
            r.config[key] = value
    for r, own in zip(runs, inline):
        r.config.update(own)
    for r in runs:  # validate and normalise values now, before any model is loaded
        if r.patched:
            cfg = get_method(r.name).parse_config(r.config)
            r.config = {k: getattr(cfg, k) for k in r.config}
    seen: set[str] = set()
    for r in runs:
        if r.label in seen:
            raise ConfigError(f"method {r.label!r} given twice; give each method once, or give each entry its own "
                              f"config, e.g. --method '{r.name}(KEY=VALUE)'")
        seen.add(r.label)
    return runs


@contextlib.contextmanager
def applied(model, run: MethodRun, layers=None, *, decode_graphs: bool | None = None) -> Iterator[Any]:
    """Patches `model` with `run` for the duration of the block (nothing for the unpatched model). `decode_graphs`:
    `patch()`'s (False: every decode step eager; None: its default, `decode_graphs.default_enabled`)."""
    import longctx_patch as lp

    if not run.patched:
        yield model
        return
    lp.patch(model, run.name, layers=run.layers if run.layers is not None else layers, decode_graphs=decode_graphs,
             **run.config)
    from ..patcher import patch_groups

    run.effective = patch_groups(model)[-1].config.to_dict()
    try:
        yield model
    finally:
        lp.unpatch(model)


# ----------------------------------------------------------------------------------------------- parsing
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*$")


def parse_size(text: str) -> int:
    """`'4k'` -> 4096, `'1.5k'` -> 1536, `'1m'` -> 1048576, `'300'` -> 300."""
    m = _SIZE.match(str(text))
    if not m:
        raise ConfigError(f"bad length {text!r}; write a number of tokens such as 1000, 4k or 128k")
    mult = {"": 1, "k": 1024, "m": 1024 * 1024}[m.group(2).lower()]
    value = float(m.group(1)) * mult
    if value < 1 or not float(value).is_integer():
        raise ConfigError(f"bad length {text!r}; it must be a positive whole number of tokens")
    return int(value)


def parse_sizes(text: str | Sequence[str]) -> list[int]:
    items = text.split(",") if isinstance(text, str) else [s for t in text for s in str(t).split(",")]
    items = [s for s in (i.strip() for i in items) if s]
    if not items:
        raise ConfigError("no lengths given; write e.g. --lengths 1k,2k,4k")
    return [parse_size(s) for s in items]


def parse_fractions(text: str | Sequence[float]) -> list[float]:
    items = text.split(",") if isinstance(text, str) else list(text)
    out = []
    for s in items:
        if isinstance(s, str) and not s.strip():
            continue
        try:
            f = float(s)
        except ValueError:
            raise ConfigError(f"bad depth {s!r}; write fractions between 0 and 1, e.g. --depths 0,0.25,0.5,0.75,1") from None
        if not 0.0 <= f <= 1.0:
            raise ConfigError(f"bad depth {s!r}; depths are fractions between 0 and 1")
        out.append(f)
    if not out:
        raise ConfigError("no depths given; write e.g. --depths 0,0.5,1")
    return out


def format_bytes(n: float) -> str:
    """1536 -> '1.5 KiB' (binary units, B to TiB)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


P_FLOOR = 1e-6


def format_p(p: float) -> str:
    """A p-value as printed everywhere: `p = 0.031` (three significant digits), `p < 1e-6` below one in a million
    (an exact test's tail can be far smaller; no `p = 0`)."""
    return "p < 1e-6" if p < P_FLOOR else f"p = {p:.3g}"


def size_label(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


# ----------------------------------------------------------------------------------------------- results
def slug(text: str) -> str:
    s = re.sub(r"[^A-Za-z0-9._-]+", "-", str(text)).strip("-.")
    return s or "x"


def begin_run(model, model_name: str | None) -> str:
    """Called when a run starts: fixes the commit recorded in its result (HEAD now, not when the run ends)
    and returns the model's name for the result (`model_name`, the name/path given, or the class name)."""
    git_commit()
    if model_name:
        return model_name
    return model if isinstance(model, str) else type(model[0]).__name__


def default_name(task: str, model: str, runs: Sequence[MethodRun]) -> str:
    model_part = slug(Path(str(model)).name if os.sep in str(model) else str(model))
    methods = "+".join(slug(r.name) for r in runs)
    return f"{task}-{model_part}-{methods}"


def write_result(
    path: str | os.PathLike,
    *,
    task: str,
    model: str,
    runs: Sequence[MethodRun],
    figures: dict[str, Any],
    command: str | None = None,
    device: str | None = None,
) -> Path:
    """Writes one result JSON with the fields every evaluation shares, plus `figures`.

    `method` is the list of method labels in run order and `config` maps each label to its config. device, date,
    commit and command: `provenance.result_header` (`device` given: that description instead).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    record: dict[str, Any] = {
        "task": task,
        **result_header(command=command),
        **({"device": device} if device else {}),
        "model": str(model),
        "method": [r.label for r in runs],
        "config": {r.label: dict(r.config) for r in runs},
    }
    if any(r.effective is not None for r in runs):
        record["effective_config"] = {r.label: r.effective for r in runs if r.effective is not None}
    if any(r.layers is not None for r in runs):
        record["layers"] = {r.label: r.layers for r in runs if r.layers is not None}
    clash = set(record) & set(figures)
    if clash:
        raise ValueError(f"figures may not reuse the reserved fields {sorted(clash)}")
    record.update(figures)
    path.write_text(json.dumps(record, indent=1, default=_json_default) + "\n")
    return path


def _json_default(obj):
    try:
        import numpy as np

        if isinstance(obj, np.generic):
            return obj.item()
    except ImportError:  # pragma: no cover
        pass
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"cannot write {type(obj).__name__} to JSON")


def pyplot():
    """matplotlib.pyplot with a file-only backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    return plt


def format_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in header]] + [[_cell(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _cell(c) -> str:
    if c is None:
        return "-"
    if isinstance(c, float):
        return f"{c:.4g}"
    return str(c)


def load_model(model, dtype=None, device=None):
    """`(model, tokenizer)` from a name/path, or passes through an already loaded pair."""
    if isinstance(model, tuple):
        return model
    import longctx_patch as lp

    return lp.load_model(model, dtype=dtype, device=device)


__all__ = [
    "MethodRun",
    "UNPATCHED",
    "applied",
    "parse_methods",
    "parse_size",
    "parse_sizes",
    "parse_fractions",
    "size_label",
    "write_result",
    "default_results_dir",
    "output_dir",
    "RESULTS_DEFAULT",
    "repo_root",
    "RESULTS_ENV",
    "RESULTS_FOLDER",
    "format_p",
    "default_name",
    "begin_run",
    "format_table",
    "pyplot",
    "load_model",
]
