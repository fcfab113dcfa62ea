"""Base classes of every method: validated config dataclasses, the patched attention module, the registry.

See docs/ARCHITECTURE.md ("The method contract").
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, fields
from typing import Any, ClassVar, NamedTuple

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..architectures import SHARED_SUBMODULES, ArchAdapter, AttentionSpec
from ..errors import ConfigError, MemoryBudgetError, MissingHookError
from ..kernels.backend import on_device
from ..patch_state import CALL_ARG, CallState, PatchContext


# ----------------------------------------------------------------------------------------------- config
# The largest value of an int option without a `max` of its own: token counts, sizes and offsets reach the kernels as
# 32-bit integers (and a Python int past 2**63 cannot become a tensor at all: window=10**20 overflowed at the forward).
INT_OPTION_MAX = 2**31 - 1


def option(default, help: str, choices=None, min=None, max=None, **kw):
    """A config field with a help text and optional allowed values / range (checked by validate()). Whatever the
    range, a float option must be finite (NaN passes every comparison, so it is refused by name) and an int option
    at most INT_OPTION_MAX in size."""
    meta = {"help": help, "choices": choices, "min": min, "max": max}
    if isinstance(default, (list, dict, set)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=meta, **kw)
    return dataclasses.field(default=default, metadata=meta, **kw)


def _allowed(f: dataclasses.Field) -> str:
    m = f.metadata
    if m.get("choices") is not None:
        return "one of " + ", ".join(repr(c) for c in m["choices"])
    kind = _base_type(f)
    parts = [kind.__name__ if isinstance(kind, type) else str(kind)]
    if m.get("min") is not None and m.get("max") is not None:
        parts.append(f"in {m['min']}..{m['max']}")
    elif m.get("min") is not None:
        parts.append(f">= {m['min']}")
    elif m.get("max") is not None:
        parts.append(f"<= {m['max']}")
    if _optional(f):
        parts.append("or None")
    return " ".join(parts)


def _resolved_type(f: dataclasses.Field):
    t = f.type
    if isinstance(t, str):  # from __future__ annotations
        t = eval(t, {**vars(typing), "Optional": typing.Optional}, {})  # noqa: S307 - our own annotations
    return t


def _optional(f) -> bool:
    t = _resolved_type(f)
    return typing.get_origin(t) in (typing.Union, types.UnionType) and type(None) in typing.get_args(t)


def _base_type(f):
    t = _resolved_type(f)
    if typing.get_origin(t) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(t) if a is not type(None)]
        t = args[0] if len(args) == 1 else str
    return t


def _coerce(f: dataclasses.Field, value, cls_name: str):
    if isinstance(value, (bytes, bytearray, memoryview)):  # int(b"7") would read it: a number or a name is text
        raise ConfigError(f"{cls_name}: {f.name}={bytes(value)!r} is bytes, not a value; allowed: {_allowed(f)} "
                          "(decode bytes first: value.decode())")
    if value is None or (isinstance(value, str) and value.lower() in ("none", "null") and _optional(f)):
        if _optional(f):
            return None
        raise ConfigError(f"{cls_name}: {f.name}=None is not allowed; allowed: {_allowed(f)}")
    t = _base_type(f)
    try:
        if t is bool:
            if isinstance(value, str):
                if value.lower() in ("1", "true", "yes", "on"):
                    return True
                if value.lower() in ("0", "false", "no", "off"):
                    return False
                raise ValueError(value)
            if isinstance(value, (bool, int)) and value in (0, 1):
                return bool(value)
            raise ValueError(value)
        if t is int:
            if isinstance(value, bool):
                raise ValueError(value)
            if isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            if isinstance(value, str):
                value = value.strip().lower()
                mult = 1
                if value.endswith("k"):
                    value, mult = value[:-1], 1024
                return int(value) * mult
            return int(value)
        if t is float:
            if isinstance(value, bool):
                raise ValueError(value)
            return float(value)
        if t is str:
            return str(value)
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(f"{cls_name}: bad value {value!r} for {f.name}; allowed: {_allowed(f)}") from None
    return value


def _check_size(f: dataclasses.Field, v, cls_name: str) -> None:
    """The rule of every numeric option, whatever its range: a float is finite, an int fits INT_OPTION_MAX."""
    if isinstance(v, float) and not math.isfinite(v):
        raise ConfigError(f"{cls_name}: {f.name}={v!r} is not a finite number; allowed: {_allowed(f)}")
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) > INT_OPTION_MAX:
        big = v > 0
        raise ConfigError(f"{cls_name}: {f.name}={v} is too {'large' if big else 'small'}; allowed: {_allowed(f)}, "
                          f"{'at most' if big else 'at least'} {'' if big else '-'}{INT_OPTION_MAX} (2**31 - 1: token "
                          "counts and offsets reach the kernels as 32-bit integers)")


@dataclass
class MethodConfig:
    """Base of every method config. Subclasses are dataclasses whose fields use `option(...)`."""

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None = None) -> "MethodConfig":
        values = dict(values or {})
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ConfigError(
                f"{cls.__name__}: unknown key(s) {', '.join(unknown)}; allowed keys: {', '.join(known) or '(none)'}"
            )
        kwargs = {k: _coerce(known[k], v, cls.__name__) for k, v in values.items()}
        cfg = cls(**kwargs)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Checks every field against its choices/range. Subclasses add cross-field checks in check()."""
        for f in fields(self):
            v = getattr(self, f.name)
            m = f.metadata
            if v is None:
                if not _optional(f):
                    raise ConfigError(f"{type(self).__name__}: {f.name}=None is not allowed; allowed: {_allowed(f)}")
                continue
            v = _coerce(f, v, type(self).__name__)
            _check_size(f, v, type(self).__name__)
            setattr(self, f.name, v)
            bad = (
                (m.get("choices") is not None and v not in m["choices"])
                or (m.get("min") is not None and v < m["min"])
                or (m.get("max") is not None and v > m["max"])
            )
            if bad:
                raise ConfigError(f"{type(self).__name__}: bad value {v!r} for {f.name}; allowed: {_allowed(f)}")
        self.check()

    def check(self) -> None:
        """Cross-field checks; raise ConfigError naming the keys."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def describe(cls) -> list[dict[str, Any]]:
        out = []
        for f in fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            out.append({"name": f.name, "default": default, "allowed": _allowed(f), "help": f.metadata.get("help", "")})
        return out


# ----------------------------------------------------------------------------------------------- module
class PatchedAttention(nn.Module):
    """Replaces one attention module; built from the original, sharing its projections.

    Subclasses implement `attend(q, k, v, cache_layer, padding) -> o [B, S, Hq, D]` and, when they keep
    decode-time state other than a full KV cache, `make_cache_layer()` and `state_bytes()`.
    """

    method_name: ClassVar[str] = ""

    def __init__(self, orig: nn.Module, spec: AttentionSpec, config: MethodConfig, adapter: ArchAdapter):
        super().__init__()
        for name in SHARED_SUBMODULES:
            sub = getattr(orig, name, None)
            if isinstance(sub, nn.Module):
                setattr(self, name, sub)
        self.spec = spec
        self.method_config = config
        self.config = getattr(orig, "config", None)  # the model config, as the original module has it
        self.layer_idx = spec.layer_idx
        self.head_dim = spec.head_dim
        self.num_heads = spec.num_heads
        self.num_key_value_heads = spec.num_kv_heads
        self.num_key_value_groups = spec.num_kv_groups
        self.scaling = getattr(orig, "scaling", spec.scaling)
        self.is_causal = True
        self._adapter = adapter
        adapter.rotary_fn()  # resolved now, outside the forward (see architectures._rotary_fn)
        adapter.standard_rotary()  # idem
        self._ctx: PatchContext | None = None
        # this rank's share of the heads under tensor parallelism (tensor_parallel.HeadShard; None: every head)
        self.head_shard = None

    # -- op level -------------------------------------------------------------------------------------
    @classmethod
    def op(cls, q, k, v, *, scale: float, config: "MethodConfig"):
        """Op-level entry point (`longctx eval speed --op`): the method's attention over one full causal
        sequence, q `[B, Hq, S, D]`, k/v `[B, Hkv, S, D]`, no cache or padding; returns `[B, S, Hq, D]`.

        Generic form: a stand-alone module of this class (fresh method parameters, built once per shape and
        config) runs `attend`. Methods with a pure kernel override this.
        """
        mod = _standalone(cls, q.shape[1], k.shape[1], q.shape[3], config, q.device, q.dtype)
        mod.scaling = scale
        return mod.attend(q, k, v, None, None)

    # -- to implement --------------------------------------------------------------------------------
    def attend(self, q, k, v, cache_layer, padding):  # pragma: no cover - abstract
        raise NotImplementedError

    def attend_call(self, q, k, v, cache_layer, call: CallState | None):
        """`attend` for one forward call, whose state (`call`: its padding, its memo; None outside a patched model's
        forward) the decoder layers pass on. A method that computes something once per call for all its layers
        overrides this to reach `call.memo` (muse's row groups)."""
        return self.attend(q, k, v, cache_layer, call.key_mask if call is not None else None)

    def make_cache_layer(self):
        """The transformers cache layer this module decodes with. Default: a full KV cache."""
        from transformers.cache_utils import DynamicLayer

        return DynamicLayer()

    def state_bytes(self, context_len: int, batch: int = 1, dtype: torch.dtype = torch.bfloat16) -> int:
        """Decode-time state of this layer at `context_len` tokens. Default: full K and V."""
        elt = torch.tensor([], dtype=dtype).element_size()
        return 2 * batch * self.num_key_value_heads * context_len * self.head_dim * elt

    def method_parameters(self) -> dict[str, torch.Tensor]:
        """Parameters and persistent buffers that belong to the method (not the shared projections)."""
        shared = tuple(f"{n}." for n in SHARED_SUBMODULES)
        sd = self.state_dict()
        return {k: v for k, v in sd.items() if not k.startswith(shared)}

    # -- dtype rule ----------------------------------------------------------------------------------
    # A method's own floating-point parameters and buffers (everything outside the shared projections) are
    # float32 whatever the model's dtype, as norms often are: patch() makes them so (`_method_tensors_to_float32`)
    # and module casts (.to(dtype), .half(), .bfloat16() ...) leave them in float32 while moving them to the new
    # device. So `patch` then `.to(bf16)` and `.to(bf16)` then `patch` give the same model, and the methods
    # (which compute with them in float32) keep their precision and small updates under training.
    def _apply(self, fn, recurse=True):
        if recurse:
            for name, child in self.named_children():
                child._apply(fn if name in SHARED_SUBMODULES else _float32_kept(fn))
        return super()._apply(_float32_kept(fn), recurse=False)

    def _method_tensors_to_float32(self) -> None:
        """Casts the method's floating-point parameters and buffers that are not float32 (in place of the
        Parameter objects, so optimisers holding them stay valid)."""
        for name, t in self._method_tensors():
            if t.is_floating_point() and t.dtype != torch.float32:
                t.data = t.data.float()

    def _method_tensors(self):
        shared = tuple(f"{n}." for n in SHARED_SUBMODULES)
        for name, t in [*self.named_parameters(), *self.named_buffers()]:
            if not name.startswith(shared):
                yield name, t

    # -- shared machinery ----------------------------------------------------------------------------
    def project(self, hidden_states, position_embeddings):
        fused = self._ctx.fused_ops if self._ctx is not None else None
        return self._adapter.project(self, hidden_states, position_embeddings, self.head_dim, fused=fused)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings=None,
        attention_mask=None,  # the model's 4-D mask: not used (methods build their own structure)
        past_key_values=None,
        cache=None,
        **kwargs,
    ):
        cache = cache if cache is not None else past_key_values
        call = kwargs.get(CALL_ARG)  # this forward call's own state (patch_state.CallState), never the model's
        with on_device(hidden_states):  # the kernels launch on this layer's GPU in a model split over several
            q, k, v = self.project(hidden_states, position_embeddings)
            layer = cache.layers[self.layer_idx] if cache is not None else None
            padding = call.key_mask if call is not None else None
            if layer is None and self._ctx is not None and self._ctx.recompute and torch.is_grad_enabled():
                o = checkpoint(self.attend_call, q, k, v, None, call, use_reentrant=False)
            else:
                o = self.attend_call(q, k, v, layer, call)
            recorder = self._ctx.recorder if self._ctx is not None else None
            if recorder is not None:
                o = recorder.record(self, q, k, v, padding, o)
            B, S = hidden_states.shape[:2]
            return self.o_proj(o.reshape(B, S, -1).to(hidden_states.dtype)), None

    def extra_repr(self) -> str:
        return f"method={self.method_name!r}, layer={self.layer_idx}, config={self.method_config}"


def _float32_kept(fn):
    """`fn` (a Module._apply conversion) with its dtype change undone on floating-point tensors: they end up
    float32 on the device `fn` chose (a device move, `to_empty` ... still apply)."""

    def apply(t):
        out = fn(t)
        if t.is_floating_point() and out.dtype != torch.float32:
            return t.to(device=out.device, dtype=torch.float32)
        return out

    return apply


_STANDALONE: dict[tuple, "PatchedAttention"] = {}


def _standalone(cls, Hq: int, Hkv: int, D: int, config, device, dtype) -> "PatchedAttention":
    """One module per (class, shape, config, device, dtype), so op-level timing excludes construction."""
    from ..architectures import ADAPTERS

    key = (cls, Hq, Hkv, D, repr(config), str(device), dtype)
    if key in _STANDALONE:
        return _STANDALONE[key]
    if len(_STANDALONE) >= 8:
        _STANDALONE.clear()
    orig = nn.Module()
    orig.o_proj = nn.Linear(1, 1, bias=False).to(device=device, dtype=dtype)  # places the method's parameters
    spec = AttentionSpec(layer_idx=0, num_heads=Hq, num_kv_heads=Hkv, head_dim=D, hidden_size=Hq * D,
                         scaling=D**-0.5, model_type="llama")
    _STANDALONE[key] = cls(orig, spec, config, ADAPTERS["llama"])
    return _STANDALONE[key]


# ----------------------------------------------------------------------------------------------- hooks
class Approximation(NamedTuple):
    """Where a method's approximation starts (`Method.approximation_start`): `start`, the shortest sequence in which
    some query is not attended exactly (None: none ever is); `first`, the first position approximated in such a
    sequence (None with start); `why`, a few words on why (said by `longctx patch`'s fidelity check)."""

    start: int | None
    first: int | None
    why: str


class MethodCalibration:
    """What `longctx_patch.calibrate` (calibration.py) asks of a method whose budgets it calibrates, returned by
    `Method.calibration()`. Every measurement runs on the post-rotary q [B, Hq, S, D], k, v [B, Hkv, S, D] of one
    layer of the unpatched model (docs/muse.md, "Calibration"); `config` is a parsed config of the method."""

    def check_text(self, config, seq_len: int, specs: list[AttentionSpec], device_type: str) -> None:
        """Before measuring: a ConfigError when a text of `seq_len` tokens cannot show the approximation's error (it
        would be exact there), a warning when it shows a shorter prefill's than the layers run."""

    def ladder(self, config, seq_len: int) -> list[dict[str, Any]]:
        """The settings to measure on every layer, as option overrides of `config`, cheapest first."""
        raise NotImplementedError

    def key(self, config) -> str:
        """Two configs with one key compute the same (calibrate measures one of them)."""
        raise NotImplementedError

    def attend(self, q, k, v, *, scale: float, config):
        """The layer's output under `config`, its exact heads aside: [B, S, Hq, D]."""
        raise NotImplementedError

    def with_exact_heads(self, o, q, k, v, heads: list[int], *, scale: float):
        """`o` with the query heads `heads` replaced by exact attention (what `exact_heads` runs)."""
        raise NotImplementedError

    def attended_keys(self, config, seq_len: int) -> tuple[float, float]:
        """(exactly attended keys, super-keys) per query and head under `config` at `seq_len` (cost "keys")."""
        raise NotImplementedError


def _hook_missing(method: "Method", hook: str, needed_by: str, returns: str) -> MissingHookError:
    return MissingHookError(
        f"method {method.name!r} does not implement Method.{hook}, which {needed_by} needs: a method implements it "
        f"in its folder (its Method subclass in methods/<name>/__init__.py), returning {returns} (docs/ARCHITECTURE.md, "
        "\"The method contract\")")


# ----------------------------------------------------------------------------------------------- method
class Method:
    """A named way of patching attention. Subclasses set name, description, config_cls, module_cls, and implement the
    hooks that what the package does with a method asks of it (`approximation_start`, `attention_profile`,
    `calibration`: each refuses by name where a method does not implement it, rather than guess)."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    config_cls: ClassVar[type[MethodConfig]] = MethodConfig
    module_cls: ClassVar[type[PatchedAttention]] = PatchedAttention
    # how the module treats a layer the original model windows (`AttentionSpec.sliding_window`): a method
    # that keeps the window sets this True; otherwise `window_conflict` says what it does instead, and
    # check_layers refuses such layers
    keeps_model_window: ClassVar[bool] = False
    window_conflict: ClassVar[str] = "does not keep a layer's sliding window"
    # its decode state does not grow with the context (a window, a linear state, dictionaries): a model patched with
    # such methods on every layer prefills long prompts in chunks by default (patcher.set_prefill_chunk), so that the
    # prefill's activations, not only the state, stay bounded
    bounded_state: ClassVar[bool] = False
    # the options that size the decode state its cache layers allocate from the first token (a window buffer, a
    # dictionary): patch() checks that one sequence's state fits the device's memory (check_state_memory), and the
    # refusal names these with the largest value of each that fits
    state_options: ClassVar[tuple[str, ...]] = ()
    # its parameters are LoLCATs' (feature maps, window factors): a fine-tune's `output.lolcats_export` can write them
    # in LoLCATs' own model.pt layout (methods/lola/weights.py)
    lolcats_layout: ClassVar[bool] = False
    # its attention is the model's own (softmax over every key the model attends, a layer's own window kept): the
    # evaluations measure the other methods against it as against the unpatched model (speed's speed-ups, ppl's
    # differences, `--baseline`), and the fine-tune plan takes the unpatched model's attention profile from it
    # (`methods.reference_method`); a method is none of that unless it says so
    exact_reference: ClassVar[bool] = False
    # the methods whose patched models `convert.py` turns into this one in place, their parameters kept (the same
    # parameters under another attention): convert_to_lola refuses a model patched with any other
    converts_from: ClassVar[tuple[str, ...]] = ()

    def parse_config(self, values: dict[str, Any] | None) -> MethodConfig:
        return self.config_cls.from_dict(values)

    def model_defaults(self, model: nn.Module, config: MethodConfig, given: dict[str, Any]) -> dict[str, Any]:
        """Option values this method takes for `model` where the caller passed none (`config`: the caller's options
        parsed, `given`: those passed), e.g. those a packaged asset's measurements chose for the model it was trained
        for; patch() applies them under the caller's own. {} (the config's defaults) unless a method says otherwise."""
        return {}

    def check_layers(self, specs: list[AttentionSpec], config: MethodConfig) -> None:
        """Runs before any layer is swapped: ConfigError if a selected layer has a sliding window of the model's
        own that this method would drop (that would change the model silently)."""
        if self.keeps_model_window:
            return
        windowed = [s for s in specs if s.sliding_window is not None]
        if not windowed:
            return
        layers = format_layers([s.layer_idx for s in windowed])
        sizes = sorted({s.sliding_window for s in windowed})
        others = format_layers([s.layer_idx for s in specs if s.sliding_window is None])
        todo = (f"patch only layers='{others}' with {self.name}" if others
                else "patch the windowed layers with exact or sliding-window instead")
        raise ConfigError(
            f"{self.name}: layers {layers} of this {windowed[0].model_type} model attend only to their last "
            f"{'/'.join(map(str, sizes))} tokens (the model config's sliding window), and {self.name} "
            f"{self.window_conflict}; {todo}"
        )

    def build(self, orig: nn.Module, spec: AttentionSpec, config: MethodConfig, adapter: ArchAdapter) -> PatchedAttention:
        mod = self.module_cls(orig, spec, config, adapter)
        mod._method_tensors_to_float32()  # the dtype rule (PatchedAttention._apply); methods create them in float32
        return mod

    def after_patch(self, model: nn.Module, modules: dict[int, PatchedAttention], config: MethodConfig) -> None:
        """Runs once after patch() swapped the modules (not in load_patched): e.g. load a checkpoint."""

    def call_report(self):
        """A context manager around forward calls, yielding a function that returns lines on what this method
        decided inside them (muse: its run-time guard's heads made exact); `longctx patch` prints them under its
        fidelity check. Per thread or task, nothing kept on the model. Default: no lines."""
        import contextlib

        return contextlib.nullcontext(lambda: [])

    # -- hooks: what the package's features ask of a method (each method answers in its own folder) -------------
    def approximation_start(self, config: MethodConfig, device_type: str = "cpu", head_dim: int = 64) -> Approximation:
        """Where the approximation of `config` starts on a `device_type` device at `head_dim`: an `Approximation`
        (`longctx patch`'s fidelity check sizes its sample by it, cli/fidelity.py)."""
        raise _hook_missing(self, "approximation_start", "longctx patch's fidelity check",
                            "Approximation(start, first, why): the shortest sequence with a query not attended exactly "
                            "(None: never), its first such position and why")

    def attention_profile(self, config: MethodConfig, head_dim: int, seq_len: int, kernels: bool
                          ) -> tuple[float, float]:
        """(keys each query attends, for the FLOPs; elements one query token holds per head while the attention runs,
        kept for the backward unless it is recomputed) of `config` in a training sequence of `seq_len` tokens, on the
        Triton kernels (`kernels`) or the PyTorch reference: the fine-tune plan's estimate (train/plan.py)."""
        raise _hook_missing(self, "attention_profile", "the fine-tune's memory and time plan (train/plan.py)",
                            "(keys per query, elements held per query token and head) for a config, head_dim, seq_len "
                            "and kernels (True: the Triton kernels, False: the PyTorch reference)")

    def calibration(self) -> MethodCalibration:
        """What `longctx_patch.calibrate` measures and sets for this method's budgets (a MethodCalibration)."""
        able = sorted(m.name for m in _REGISTRY.values() if type(m).calibration is not Method.calibration)
        raise MissingHookError(
            f"method {self.name!r} has no budgets to calibrate (it implements no Method.calibration, the settings "
            f"calibrate measures per layer: a MethodCalibration, methods/base.py); calibrate takes "
            f"{', '.join(repr(n) for n in able) or 'no registered method'}")

    def check_state_memory(self, modules: list[PatchedAttention], config: MethodConfig, dtype: torch.dtype,
                           available: int | None, device: str, others: int = 0) -> None:
        """Runs before any layer is swapped: MemoryBudgetError when the decode state one sequence allocates from its
        first token (`state_bytes(1)` of `modules`: a window buffer, a dictionary, a sparse cache ... sized by
        options, not by the context), plus `others` bytes of the model's other patched layers, exceeds `available`
        bytes of `device`. A state that does not fit now would fail at the first forward (or be killed once filled).
        The message names the options in `state_options` and the largest value of each that fits, the others as
        they are. `available` None (unknown, e.g. the meta device): no check."""
        if available is None or not modules:
            return
        need = _state_at(modules, config, dtype)
        if need + others <= available:
            return
        from ..memory import gib

        fits = []
        for key in self.state_options:
            now = getattr(config, key)
            if not isinstance(now, int) or isinstance(now, bool):
                continue
            f = next(f for f in fields(config) if f.name == key)
            lo = f.metadata.get("min") or 0
            if _state_at(modules, dataclasses.replace(config, **{key: lo}), dtype) + others > available:
                continue  # no value of this one alone fits
            hi = now  # the largest value that fits lies in [lo, now)
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if _state_at(modules, dataclasses.replace(config, **{key: mid}), dtype) + others <= available:
                    lo = mid
                else:
                    hi = mid
            fits.append(f"{key}={lo} (now {now})")
        where = f" besides the {gib(others)} of the other patched layers" if others else ""
        todo = ("at most " + ", or ".join(fits) + " fits, the other options as they are" if fits else
                "no smaller " + "/".join(self.state_options) + " alone makes it fit" if self.state_options else
                "patch fewer layers")
        raise MemoryBudgetError(
            f"{self.name}: the decode state of one sequence, allocated from its first token, would take {gib(need)} "
            f"over {len(modules)} layer{'s' if len(modules) > 1 else ''}{where}, more than the {gib(available)} "
            f"available on {device}; {todo}"
        )


def _state_at(modules: list[PatchedAttention], config: MethodConfig, dtype: torch.dtype) -> int:
    """The decode state of one sequence after one token over `modules`, were their config `config`."""
    kept = [m.method_config for m in modules]
    try:
        for m in modules:
            m.method_config = config
        return sum(m.state_bytes(1, batch=1, dtype=dtype) for m in modules)
    finally:
        for m, c in zip(modules, kept):
            m.method_config = c


def format_layers(idx) -> str:
    """[0, 1, 2, 5] -> '0-2,5' (the `layers=` / --layers syntax; `patcher.parse_layers` reads it back)."""
    runs: list[list[int]] = []
    for i in sorted(idx):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


_REGISTRY: dict[str, Method] = {}


def register_method(cls: type[Method]) -> type[Method]:
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    _REGISTRY[cls.name] = cls()
    return cls
