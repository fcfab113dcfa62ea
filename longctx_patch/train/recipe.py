"""Fine-tune recipes: loading, `--set` overrides by dotted path, validation.

A recipe is a YAML mapping (format in recipes/README.md):

    model: HuggingFaceTB/SmolLM2-135M-Instruct
    method: lolcats
    method_config: {window: 64}
    layers: null
    data: {text: my_texts/}   # a .txt file or a folder of them
    stages:
      - {name: transfer, objective: attention_transfer, lr: 1.0e-2, steps: 200, seq_len: 1024}
      - {name: lora, objective: next_token, lora: {r: 8, alpha: 16}}

`load_recipe(path, overrides)` returns a validated `Recipe`; every error is a `ConfigError` naming the key
(as a dotted path) and what is allowed.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import yaml

from ..errors import ConfigError
from ..texts import binary_reason

OBJECTIVES = ("attention_transfer", "next_token")
TRAINABLE = ("method", "lora", "full")
SCHEDULES = ("cosine", "linear", "constant")
PRECISIONS = ("auto", "no", "bf16", "fp16")
DTYPES = ("auto", "float32", "bfloat16", "float16")
FROZEN_DTYPES = ("auto", "keep")
LORA_TARGETS_DEFAULT = ["q_proj", "k_proj", "v_proj", "o_proj"]
LORA_INITS = ("fresh", "checkpoint")
# The largest int a recipe key takes unless it says otherwise (steps, sizes, seeds: 32-bit counts and seeds), and the
# largest token count (data.max_tokens: an int64 index).
INT_MAX = 2**31 - 1
INDEX_MAX = 2**63 - 1
_BOUND_NOTE = {INT_MAX: " (2**31 - 1)", INDEX_MAX: " (2**63 - 1, the largest int64 index)"}


# ----------------------------------------------------------------------------------------------- schema
@dataclass
class LoraSpec:
    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: list[str] = field(default_factory=lambda: list(LORA_TARGETS_DEFAULT))
    layers: list[int] | None = None  # decoder layers that get adapters (None: all)
    # fresh: B = 0 (peft's initialisation); checkpoint: the adapter of method_config.checkpoint (a packaged asset's,
    # a run's trainable/), taken out of the projections it was merged into, trains on from its values
    init: str = "fresh"


@dataclass
class Stage:
    name: str = "stage"
    objective: str = "next_token"
    trainable: list[str] | None = None  # None: ["method"] for attention_transfer, ["lora"] or ["full"] otherwise
    lora: LoraSpec | None = None
    lr: float = 1e-4
    method_lr: float | None = None  # lr of the method's own parameters when they train beside others (None: lr)
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    steps: int = 100  # optimizer steps
    batch_size: int = 8  # sequences per micro-step, summed over all processes
    seq_len: int = 1024
    grad_accum: int = 1
    warmup: int = 0  # optimizer steps of linear warm-up (capped at steps)
    schedule: str = "cosine"
    min_lr_ratio: float = 0.1  # final lr / lr for the cosine and linear schedules
    max_grad_norm: float | None = 1.0
    log_every: int = 10
    eval_every: int = 0  # 0: only at the end of the stage
    eval_batches: int = 4
    save_every: int = 0  # 0: only at the end of the stage
    gradient_checkpointing: bool = False
    teacher_forcing: bool = True  # attention_transfer: pass the exact attention output on to the next layer
    # recompute each patched attention in the backward (same values, less memory); auto: off on CUDA, on elsewhere
    attention_checkpointing: bool | str = True
    fused_loss: bool = True  # next_token: chunked cross-entropy, never the whole batch's fp32 logits (same value)
    compile: bool = False  # torch.compile each decoder layer for the stage (fixed shapes)
    max_time_s: float | None = None  # end the stage after this much wall time (the schedule still assumes `steps`)

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.grad_accum * self.seq_len


@dataclass
class DataSpec:
    text: str | None = None  # a file or a directory of text files
    dataset: str | None = None  # a local datasets directory (save_to_disk) or a name datasets can load offline
    split: str = "train"
    field: str = "text"
    eval_fraction: float = 0.02  # held-out share of the packed chunks (taken from the end of the stream)
    max_tokens: int | None = None  # cap on the tokens read
    add_eos: bool = True  # end each document with the tokenizer's EOS token


@dataclass
class OutputSpec:
    dir: str | None = None
    save_model: bool = True  # write model/ (save_patched of the final model, LoRA merged)
    keep_checkpoints: int = 2  # newest resumable checkpoints kept (0: keep all)
    lolcats_export: bool = False  # also write the LoLCATs `model.pt` layout (lolcats/lola methods only)


@dataclass
class Recipe:
    model: str | None = None
    method: str | None = None  # None / "none": fine-tune the unpatched model
    method_config: dict[str, Any] = field(default_factory=dict)
    layers: list[int] | None = None
    # Hybrids: patch every layer NOT in `layers` with this second method (e.g. sliding-window beside ovq).
    rest_method: str | None = None
    rest_config: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    dtype: str = "float32"  # weights as loaded for training
    mixed_precision: str = "auto"  # auto: bf16 on CUDA devices that support it, otherwise no
    # auto: under bf16 mixed precision the parameters no stage trains (the base model's) are held in bf16, as
    # the model runs at inference; keep: as loaded (`dtype`)
    frozen_dtype: str = "auto"
    data: DataSpec = field(default_factory=DataSpec)
    stages: list[Stage] = field(default_factory=list)
    output: OutputSpec = field(default_factory=OutputSpec)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def fingerprint(self) -> str:
        """Hash of everything a checkpoint depends on structurally (not lr, steps or cadences)."""
        d = self.to_dict()
        key = {
            "model": d["model"],
            "method": d["method"],
            "method_config": d["method_config"],
            "layers": d["layers"],
            "rest_method": d["rest_method"],
            "rest_config": d["rest_config"],
            "dtype": d["dtype"],
            "stages": [
                {k: _fresh_lora_as_before(s[k]) if k == "lora" else s[k]
                 for k in ("name", "objective", "trainable", "lora", "batch_size", "seq_len", "grad_accum")}
                for s in d["stages"]
            ],
        }
        return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _fresh_lora_as_before(lora: dict[str, Any] | None) -> dict[str, Any] | None:
    """A stage's LoRA block as the fingerprint hashes it: `init: fresh` (the default) left out, so that checkpoints
    written before the key existed still resume."""
    if lora is None or lora.get("init") != "fresh":
        return lora
    return {k: v for k, v in lora.items() if k != "init"}


# ----------------------------------------------------------------------------------------------- overrides
def parse_value(text: str) -> Any:
    """A `--set` value: YAML scalar/flow syntax (`1e-3`, `true`, `[1, 2]`, `{r: 4}`, `null`)."""
    try:
        return yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        return text


def _float_like(v: Any) -> Any:
    # YAML 1.1 reads `1e-3` (no dot) as a string; accept it as a number.
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            return v
    return v


def apply_overrides(raw: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Applies `key.sub=value` items to a raw recipe mapping (copied).

    A stage is addressed by index or by name: `stages.0.lr=1e-3`, `stages.lora.steps=50`. Setting a key
    on every stage: `stages.*.seq_len=256`.
    """
    out = copy.deepcopy(raw)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE with a dotted key, e.g. stages.0.lr=1e-3")
        key, _, text = item.partition("=")
        path = [p for p in key.strip().split(".")]
        if not key.strip() or any(not p for p in path):
            raise ConfigError(f"--set {item!r}: empty key part; use a dotted key such as data.text=DIR")
        _set_path(out, path, parse_value(text), item)
    return out


def _set_path(node: Any, path: list[str], value: Any, item: str) -> None:
    head, rest = path[0], path[1:]
    if isinstance(node, list):
        targets = _list_targets(node, head, item)
        for i in targets:
            if not rest:
                node[i] = value
            else:
                if node[i] is None or not isinstance(node[i], (dict, list)):
                    node[i] = {}
                _set_path(node[i], rest, value, item)
        return
    if not isinstance(node, dict):
        raise ConfigError(f"--set {item!r}: {head!r} is inside a value that is not a mapping")
    if not rest:
        node[head] = value
        return
    if not isinstance(node.get(head), (dict, list)):
        node[head] = {}
    _set_path(node[head], rest, value, item)


def _list_targets(node: list, head: str, item: str) -> list[int]:
    if head == "*":
        return list(range(len(node)))
    if head.lstrip("-").isdigit():
        i = int(head)
        if not -len(node) <= i < len(node):
            raise ConfigError(f"--set {item!r}: index {i} out of range; the list has {len(node)} entries")
        return [i % len(node)]
    names = [e.get("name") if isinstance(e, dict) else None for e in node]
    if head in names:
        return [names.index(head)]
    raise ConfigError(
        f"--set {item!r}: no entry named {head!r}; use an index 0..{len(node) - 1}, '*', or one of "
        f"{', '.join(repr(n) for n in names if n)}"
    )


# ----------------------------------------------------------------------------------------------- building
def _build(cls, raw: Any, where: str):
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(raw).__name__} {raw!r}")
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(known))
    if unknown:
        prefix = f"{where}." if where != "recipe" else ""
        raise ConfigError(
            f"unknown recipe key(s) {', '.join(prefix + u for u in unknown)}; allowed under {where}: {', '.join(known)}"
        )
    return cls(**raw)


def _allowed(kind, optional: bool, minimum, maximum, above) -> str:
    """What a numeric key accepts, in words: 'a number > 0', 'an integer >= 1', 'a number in 0.0..1.0 or null'."""
    noun = "an integer" if kind is int else "a number"
    if above is not None:
        rng = f" > {above}"
    elif minimum is not None and maximum is not None:
        rng = f" in {minimum}..{maximum}"
    elif minimum is not None:
        rng = f" >= {minimum}"
    elif maximum is not None:
        rng = f" <= {maximum}"
    else:
        rng = ""
    return noun + rng + (" or null" if optional else "")


def _check_type(where: str, value: Any, kind, *, optional: bool = False, minimum=None, maximum=None, choices=None,
                above=None):
    """`value` as `kind`, or a ConfigError naming `where`, the value and what is allowed. Numbers: a float must be
    finite (NaN passes every comparison: refused by name), an int at most `maximum` (default INT_MAX); `above`: a
    strict lower bound."""
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{where} must be set (got null)")
    shown = value
    if kind is float:
        value = _float_like(value)
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
        shown = value
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
        if not ok and isinstance(value, float) and value.is_integer():
            value, ok = int(value), True
        if maximum is None:
            maximum = INT_MAX
    elif kind is bool:
        ok = isinstance(value, bool)
    elif kind is str:
        ok = isinstance(value, str)
        if not ok and isinstance(value, (int, float)) and not isinstance(value, bool):
            value, ok = str(value), True
    else:
        ok = isinstance(value, kind)
    if not ok:
        name = getattr(kind, "__name__", str(kind))
        raise ConfigError(f"{where}: expected {name}{' or null' if optional else ''}, got {value!r}")
    if kind is float and not math.isfinite(value):
        raise ConfigError(f"{where}: {value!r} is not a finite number; allowed: "
                          f"{_allowed(kind, optional, minimum, maximum, above)}")
    if choices is not None and value not in choices:
        raise ConfigError(f"{where}: bad value {value!r}; allowed: {', '.join(repr(c) for c in choices)}")
    if above is not None and value <= above:
        raise ConfigError(f"{where}: {shown!r} is too small; must be > {above}")
    if minimum is not None and value < minimum:
        raise ConfigError(f"{where}: {shown!r} is too small; must be >= {minimum}")
    if maximum is not None and value > maximum:
        raise ConfigError(f"{where}: {shown!r} is too large; must be <= {maximum}{_BOUND_NOTE.get(maximum, '')}")
    return value


def _int_list(where: str, value: Any, optional: bool = True) -> list[int] | None:
    if value is None and optional:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ConfigError(f"{where}: expected a list of layer indices (e.g. [0, 2, 4]) or null, got {value!r}")
    return [int(v) for v in value]


def _validate_stage(s: Stage, where: str) -> None:
    s.name = _check_type(f"{where}.name", s.name, str)
    s.objective = _check_type(f"{where}.objective", s.objective, str, choices=OBJECTIVES)
    if s.lora is not None and not isinstance(s.lora, LoraSpec):
        if s.lora is True:
            s.lora = {}
        s.lora = _build(LoraSpec, s.lora, f"{where}.lora")
    if s.lora is not None:
        lw = f"{where}.lora"
        s.lora.r = _check_type(f"{lw}.r", s.lora.r, int, minimum=1)
        s.lora.alpha = _check_type(f"{lw}.alpha", s.lora.alpha, float, minimum=0.0)
        s.lora.dropout = _check_type(f"{lw}.dropout", s.lora.dropout, float, minimum=0.0, maximum=0.99)
        t = s.lora.targets
        if isinstance(t, str):
            t = [t]
        if not isinstance(t, list) or not t or not all(isinstance(x, str) and x for x in t):
            raise ConfigError(f"{lw}.targets: expected a non-empty list of module names (e.g. [q_proj, v_proj]), got {t!r}")
        s.lora.targets = list(t)
        s.lora.layers = _int_list(f"{lw}.layers", s.lora.layers)
        s.lora.init = _check_type(f"{lw}.init", s.lora.init, str, choices=LORA_INITS)
    tr = s.trainable
    if tr is None:
        tr = ["method"] if s.objective == "attention_transfer" else (["lora"] if s.lora is not None else ["full"])
    if isinstance(tr, str):
        tr = [x.strip() for x in tr.replace("+", ",").split(",") if x.strip()]
    if not isinstance(tr, list) or not tr:
        raise ConfigError(f"{where}.trainable: expected a list drawn from {', '.join(TRAINABLE)}, got {s.trainable!r}")
    for x in tr:
        _check_type(f"{where}.trainable", x, str, choices=TRAINABLE)
    s.trainable = sorted(set(tr), key=TRAINABLE.index)
    if "lora" in s.trainable and s.lora is None:
        s.lora = LoraSpec()
    if "full" in s.trainable and "lora" in s.trainable:
        raise ConfigError(f"{where}.trainable: 'full' and 'lora' exclude each other; pick one")
    s.lr = _check_type(f"{where}.lr", s.lr, float, above=0)
    s.method_lr = _check_type(f"{where}.method_lr", s.method_lr, float, optional=True, above=0)
    s.weight_decay = _check_type(f"{where}.weight_decay", s.weight_decay, float, minimum=0.0)
    if not isinstance(s.betas, (list, tuple)) or len(s.betas) != 2:
        raise ConfigError(f"{where}.betas: expected two numbers such as [0.9, 0.999], got {s.betas!r}")
    s.betas = [_check_type(f"{where}.betas", b, float, minimum=0.0, maximum=0.999999) for b in s.betas]
    s.steps = _check_type(f"{where}.steps", s.steps, int, minimum=1)
    s.batch_size = _check_type(f"{where}.batch_size", s.batch_size, int, minimum=1)
    s.seq_len = _check_type(f"{where}.seq_len", s.seq_len, int, minimum=2)
    s.grad_accum = _check_type(f"{where}.grad_accum", s.grad_accum, int, minimum=1)
    s.warmup = _check_type(f"{where}.warmup", s.warmup, int, minimum=0)
    s.schedule = _check_type(f"{where}.schedule", s.schedule, str, choices=SCHEDULES)
    s.min_lr_ratio = _check_type(f"{where}.min_lr_ratio", s.min_lr_ratio, float, minimum=0.0, maximum=1.0)
    s.max_grad_norm = _check_type(f"{where}.max_grad_norm", s.max_grad_norm, float, optional=True, minimum=0.0)
    s.log_every = _check_type(f"{where}.log_every", s.log_every, int, minimum=1)
    s.eval_every = _check_type(f"{where}.eval_every", s.eval_every, int, minimum=0)
    s.eval_batches = _check_type(f"{where}.eval_batches", s.eval_batches, int, minimum=0)
    s.save_every = _check_type(f"{where}.save_every", s.save_every, int, minimum=0)
    s.gradient_checkpointing = _check_type(f"{where}.gradient_checkpointing", s.gradient_checkpointing, bool)
    s.teacher_forcing = _check_type(f"{where}.teacher_forcing", s.teacher_forcing, bool)
    if s.attention_checkpointing != "auto":
        s.attention_checkpointing = _check_type(f"{where}.attention_checkpointing", s.attention_checkpointing, bool)
    s.fused_loss = _check_type(f"{where}.fused_loss", s.fused_loss, bool)
    s.compile = _check_type(f"{where}.compile", s.compile, bool)
    s.max_time_s = _check_type(f"{where}.max_time_s", s.max_time_s, float, optional=True, minimum=0.0)


def recipe_from_dict(raw: dict[str, Any]) -> Recipe:
    """Builds and validates a `Recipe` from a (possibly overridden) mapping."""
    if not isinstance(raw, dict):
        raise ConfigError(f"a recipe must be a YAML mapping at the top level, got {type(raw).__name__}")
    raw = copy.deepcopy(raw)
    stages_raw = raw.pop("stages", None)
    data_raw = raw.pop("data", None)
    out_raw = raw.pop("output", None)
    r = _build(Recipe, raw, "recipe")
    r.data = _build(DataSpec, data_raw, "data")
    r.output = _build(OutputSpec, out_raw, "output")
    if stages_raw is None or stages_raw == []:
        raise ConfigError("recipe has no stages; add a `stages:` list (see recipes/README.md)")
    if not isinstance(stages_raw, list):
        raise ConfigError(f"stages: expected a list of stage mappings, got {type(stages_raw).__name__}")
    r.stages = [_build(Stage, s, f"stages.{i}") for i, s in enumerate(stages_raw)]

    from ..methods import get_method, is_unpatched, list_methods  # method and config checked now, not after the load

    r.model = _check_type("model", r.model, str, optional=True)
    if isinstance(r.method, str) and is_unpatched(r.method):
        r.method = None
    r.method = _check_type("method", r.method, str, optional=True)
    if r.method_config is None:
        r.method_config = {}
    if not isinstance(r.method_config, dict):
        raise ConfigError(f"method_config: expected a mapping of the method's keys, got {r.method_config!r}")
    r.layers = _int_list("layers", r.layers)
    r.rest_method = _check_type("rest_method", r.rest_method, str, optional=True)
    if r.rest_config is None:
        r.rest_config = {}
    if not isinstance(r.rest_config, dict):
        raise ConfigError(f"rest_config: expected a mapping of rest_method's keys, got {r.rest_config!r}")
    if r.rest_method is not None and (r.method is None or r.layers is None):
        raise ConfigError("rest_method patches the layers not in `layers`: set `method:` and a `layers:` list too")
    for key, meth, cfg in (("method", r.method, r.method_config), ("rest_method", r.rest_method, r.rest_config)):
        if meth is not None:
            try:
                get_method(meth).parse_config(dict(cfg))
            except ConfigError as e:
                raise ConfigError(f"{key}: {e}") from None
    r.seed = _check_type("seed", r.seed, int, minimum=0)
    r.dtype = _check_type("dtype", r.dtype, str, choices=DTYPES)
    r.mixed_precision = _check_type("mixed_precision", r.mixed_precision, str, choices=PRECISIONS)
    r.frozen_dtype = _check_type("frozen_dtype", r.frozen_dtype, str, choices=FROZEN_DTYPES)

    d = r.data
    d.text = _check_type("data.text", d.text, str, optional=True)
    d.dataset = _check_type("data.dataset", d.dataset, str, optional=True)
    if d.text and d.dataset:
        raise ConfigError("data.text and data.dataset are both set; give one source (--text or --dataset)")
    d.split = _check_type("data.split", d.split, str)
    d.field = _check_type("data.field", d.field, str)
    d.eval_fraction = _check_type("data.eval_fraction", d.eval_fraction, float, minimum=0.0, maximum=0.5)
    d.max_tokens = _check_type("data.max_tokens", d.max_tokens, int, optional=True, minimum=1, maximum=INDEX_MAX)
    d.add_eos = _check_type("data.add_eos", d.add_eos, bool)
    r.output.dir = _check_type("output.dir", r.output.dir, str, optional=True)
    r.output.lolcats_export = _check_type("output.lolcats_export", r.output.lolcats_export, bool)
    r.output.save_model = _check_type("output.save_model", r.output.save_model, bool)
    r.output.keep_checkpoints = _check_type("output.keep_checkpoints", r.output.keep_checkpoints, int, minimum=0)

    if r.output.lolcats_export and not (r.method is not None and get_method(r.method).lolcats_layout):
        able = " or ".join(m for m in list_methods() if get_method(m).lolcats_layout)
        raise ConfigError(
            f"output.lolcats_export needs method {able} (the recipe's method is {r.method!r}); "
            "set output.lolcats_export=false"
        )
    names = set()
    for i, s in enumerate(r.stages):
        _validate_stage(s, f"stages.{i}")
        if s.name in names:
            raise ConfigError(f"stages.{i}.name: {s.name!r} is used twice; stage names must be unique")
        names.add(s.name)
        if r.method is None and (s.objective == "attention_transfer" or "method" in s.trainable):
            raise ConfigError(
                f"stages.{i} ({s.name}): objective attention_transfer / trainable 'method' need a patched model; "
                "set `method:` in the recipe or with --set method=NAME"
            )
        if s.objective == "attention_transfer" and "method" not in s.trainable:
            raise ConfigError(
                f"stages.{i}.trainable: attention_transfer trains the method's own parameters; include 'method'"
            )
    _check_lora_init(r)
    return r


def _check_lora_init(r: Recipe) -> None:
    """`lora.init: checkpoint`: on a stage that trains LoRA, the first such stage (it adds the adapter, the later
    ones keep training it), with a method whose checkpoint can hold a LoRA adapter (lolcats/lola) and a checkpoint
    that is not `none`. Whether the checkpoint holds an adapter is known once the model is patched (the runner)."""
    from ..methods import get_method, list_methods

    first = next((i for i, s in enumerate(r.stages) if "lora" in s.trainable), None)
    wanted = [i for i, s in enumerate(r.stages) if s.lora is not None and s.lora.init == "checkpoint"]
    for i in wanted:
        s = r.stages[i]
        if "lora" not in s.trainable:
            raise ConfigError(f"stages.{i}.lora.init: checkpoint starts the LoRA adapter a stage trains, but stage "
                              f"{s.name!r} trains {s.trainable}; add lora to its trainable or drop lora.init")
        if i != first and r.stages[first].lora.init != "checkpoint":
            raise ConfigError(f"stages.{i}.lora.init: the adapter is added by the first LoRA stage "
                              f"({r.stages[first].name!r}, fresh) and the later ones keep training it; set "
                              f"stages.{first}.lora.init: checkpoint instead")
    if not wanted:
        return
    where = f"stages.{wanted[0]}.lora.init: checkpoint"
    if r.method is None or not get_method(r.method).lolcats_layout:
        able = " or ".join(m for m in list_methods() if get_method(m).lolcats_layout)
        raise ConfigError(f"{where} continues the LoRA adapter of the method's checkpoint, which method {able} loads "
                          f"(the recipe's method is {r.method!r})")
    ck = get_method(r.method).parse_config(dict(r.method_config)).checkpoint
    if ck is None or str(ck).strip().lower() == "none":
        raise ConfigError(f"{where} continues the LoRA adapter of method_config.checkpoint, which is none (fresh "
                          "feature maps): set it to auto (the packaged asset) or a fine-tune run's trainable/ folder")


def load_recipe(path: str | Path | None, overrides: Sequence[str] = ()) -> Recipe:
    """Reads a recipe YAML file (or starts from an empty mapping when `path` is None) and applies overrides."""
    raw: Any = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"recipe file {str(p)!r} not found; pass the path of a YAML recipe such as recipes/linearize.yaml")
        try:
            reason = binary_reason(p)
            text = p.read_bytes().decode("utf-8")
        except OSError as e:
            raise ConfigError(f"recipe {str(p)!r} cannot be read ({e.strerror or e}); pass a readable YAML recipe") from None
        except UnicodeDecodeError as e:  # past the probe of binary_reason
            reason = f"bytes that are not UTF-8 at offset {e.start}"
        if reason is not None:
            raise ConfigError(f"recipe {str(p)!r} is not text ({reason}); pass a YAML recipe such as "
                              "recipes/linearize.yaml")
        try:
            raw = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"recipe {str(p)!r} is not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"recipe {str(path)!r}: the top level must be a mapping")
    return recipe_from_dict(apply_overrides(raw, overrides))
