"""Calibrated per-layer budgets: `calibrate(model, "muse", text, tokenizer=tok, target_error=0.01)`.

Patches `model` with, per layer, the cheapest setting of the method whose attention error on `text` meets the target,
and returns the `Calibration` (what each layer runs, its measured error and cost). docs/muse.md, "Calibration":

1. Measure. One forward over the text with the selected layers `exact` (the model's own attention), so each layer
   sees the post-rotary q, k, v of the unpatched model (handed over by the patch's recorder, `PatchContext.recorder`).
   On them, every setting of the method's ladder (its `Method.calibration()`: a `MethodCalibration`, whose `ladder`,
   plus the config given) runs, and its error is kept per query head: the squared
   difference from exact attention computed in fp32 on the same inputs. So are the error of exact attention in the
   model's dtype (the floor: rounding) and each setting's cost.
2. Choose. A layer's options: every setting, each also with its worst heads exact (`exact_heads`: the heads whose
   error the setting leaves largest, one more at a time), and the layer exact. objective "layer": each layer takes its
   cheapest option whose error is <= the target, exact attention when none is; "mean": the mean error over the layers
   is <= the target, reached from every layer's cheapest option by the steps that remove the most error per unit of
   cost (along the lower convex hull of each layer's options).
3. Verify. A second forward runs each layer's choice as the patched module runs it (the method's output with its exact
   heads) on the same inputs; a choice whose measured error misses is chosen again with the measurement, at most
   MAX_ROUNDS times, then (objective "layer") that layer is exact.
4. Patch. Layers that share a setting are one patch group (`patch(model, method, layers=..., **setting)`), the exact
   layers one `exact` group; the calibration is kept with the patch: `save_patched` writes it into longctx_patch.json
   ("calibration"), `load_patched` reads it back (`calibration_record(model)`).

Costs (`cost=`): "keys": the keys a query attends in the layer, summed over its heads (exactly attended keys and
super-keys, counted from the settings: `MethodCalibration.attended_keys`; an exact head adds a causal row's (S + 1) / 2 keys on
average to the method's, which still runs for it; an exact layer costs (S + 1) / 2 a head): deterministic and the same
on every machine. "time": the layer's op time on the captured inputs (CUDA events, median of 10), for the device it
runs on. "auto": time on CUDA, keys elsewhere.
"""

from __future__ import annotations

import json
import math
import numbers
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch

from .architectures import get_adapter, model_config
from .errors import AlreadyPatchedError, ConfigError, DeviceError
from .methods import get_method
from .patch_state import find_state, patch_context
from .patcher import parse_layers, patch, unpatch
from .timing import cuda_median_ms

OBJECTIVES = ("layer", "mean")
COSTS = ("auto", "keys", "time")
MAX_ROUNDS = 3
RECORD_KEY = "calibration"  # where the patch state and longctx_patch.json keep it
# what a layer runs where no setting of the method met the target: an outcome of calibrate, written into the record
# as `LayerCalibration.method`, and the method patched on those layers (and on every layer of the measuring pass)
EXACT = "exact"


# --------------------------------------------------------------------------------------------- the result
@dataclass
class LayerCalibration:
    """What one layer runs after calibration and what was measured for it on the calibration text."""

    layer: int
    method: str  # the method, or EXACT (no setting met the target)
    overrides: dict[str, Any]  # the options set over the calibration's config ({} for exact)
    error: float  # measured ||o - o_exact|| / ||o_exact|| on the calibration text
    cost: float  # in the calibration's cost unit (keys per query over the heads, or ms)
    keys: float  # keys a query attends over the layer's heads (exact, super-keys, exact heads)
    exact_cost: float  # the same layer exact, in the cost unit
    base_error: float  # the calibration's config as given (before calibration), measured
    base_cost: float
    met: bool  # error <= target (objective "layer"); for "mean", the mean's verdict


@dataclass
class Calibration:
    """The result of `calibrate`: kept with the patch (`to_record`: the JSON longctx_patch.json holds)."""

    method: str
    config: dict[str, Any]
    target_error: float
    objective: str
    cost: str  # "keys" or "time"
    per_head: bool
    tokens: int
    layers: list[LayerCalibration] = field(default_factory=list)

    @property
    def mean_error(self) -> float:
        return sum(x.error for x in self.layers) / len(self.layers)

    @property
    def max_error(self) -> float:
        return max(x.error for x in self.layers)

    @property
    def met(self) -> bool:
        if self.objective == "mean":
            return self.mean_error <= self.target_error
        return all(x.error <= self.target_error for x in self.layers)

    def groups(self) -> list[tuple[str, dict[str, Any], list[int]]]:
        """[(method, options over the config, layers)]: the patch groups, in order of their first layer."""
        out: dict[str, tuple[str, dict[str, Any], list[int]]] = {}
        for x in self.layers:
            key = json.dumps([x.method, x.overrides], sort_keys=True)
            out.setdefault(key, (x.method, x.overrides, []))[2].append(x.layer)
        return sorted(out.values(), key=lambda g: g[2][0])

    def to_record(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_record(cls, rec: dict[str, Any]) -> "Calibration":
        return cls(**{**rec, "layers": [LayerCalibration(**x) for x in rec["layers"]]})

    def table(self) -> str:
        """The per-layer summary and the totals against the config as given and against exact attention."""
        unit = "keys/query" if self.cost == "keys" else "ms"
        head = ["layer", "runs", "error", "before", "cost", "x exact"]
        rows = [[str(x.layer), _describe(x), f"{100 * x.error:.3f}%", f"{100 * x.base_error:.3f}%",
                 f"{x.cost:,.1f}" if self.cost == "keys" else f"{x.cost:.3f}", f"{x.cost / x.exact_cost:.3f}"]
                for x in self.layers]
        widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
        lines = ["  ".join(c.ljust(w) if i == 1 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                 for r in [head, *rows]]
        cost, base, exact = (sum(getattr(x, a) for x in self.layers) for a in ("cost", "base_cost", "exact_cost"))
        mean_base = sum(x.base_error for x in self.layers) / len(self.layers)
        verdict = "met" if self.met else "MISSED"
        what = "mean error" if self.objective == "mean" else "every layer's error"
        lines += [
            f"target: {what} <= {100 * self.target_error:g}%: {verdict} (mean {100 * self.mean_error:.3f}%, worst "
            f"{100 * self.max_error:.3f}%; the config as given: mean {100 * mean_base:.3f}%, worst "
            f"{100 * max(x.base_error for x in self.layers):.3f}%)",
            f"cost ({unit}, {len(self.layers)} layers): {cost:,.4g} = {cost / exact:.3f}x exact attention, "
            f"{cost / base:.3f}x the config as given ({self.tokens} tokens)",
        ]
        exact_layers = [x.layer for x in self.layers if x.method == EXACT]
        if exact_layers:
            why = (f"no {self.method} setting met the target there for less" if self.objective == "layer" else
                   "the steps that lower the mean most for their cost")
            lines.append(f"exact attention on layers {exact_layers}: {why}")
        return "\n".join(lines)


def _describe(x: LayerCalibration) -> str:
    if x.method == EXACT:
        return EXACT
    parts = [f"{k}={v}" for k, v in x.overrides.items() if k != "exact_heads"]
    heads = x.overrides.get("exact_heads")
    if heads:
        parts.append(f"exact heads {','.join(map(str, heads))}")
    return f"{x.method} " + (" ".join(parts) if parts else "(as given)")


def calibration_record(model) -> dict[str, Any] | None:
    """The calibration kept with `model`'s patch (what `calibrate` or `load_patched` put there), or None."""
    st = find_state(model)
    return None if st is None else st.calibration


# --------------------------------------------------------------------------------------------- the checks
def check_target(target_error) -> float:
    """target_error as a float, or a ConfigError saying what it should be."""
    ok = isinstance(target_error, numbers.Real) and not isinstance(target_error, bool)
    if not ok or not math.isfinite(float(target_error)) or not 0 < float(target_error) < 1:
        raise ConfigError(f"target_error={target_error!r}: give the relative error each layer's attention output may "
                          "have against exact attention, a number between 0 and 1 (0.01 for 1%)")
    return float(target_error)


def _token_ids(text, tokenizer, length, device) -> torch.Tensor:
    if length is not None and (not isinstance(length, numbers.Integral) or isinstance(length, bool) or length < 1):
        raise ConfigError(f"length={length!r}: give the number of the text's tokens to calibrate on (an int >= 1), "
                          "or None for all of them")
    if text is None:
        raise ConfigError("calibrate needs a text: the model runs on it and each layer's error is measured there "
                          "(text='...' with tokenizer=, or token ids)")
    if isinstance(text, str):
        if tokenizer is None:
            raise ConfigError("calibrate got a text but no tokenizer: pass tokenizer= (load_model returns it), or "
                              "token ids as text=")
        ids = tokenizer(text, return_tensors="pt").input_ids
    else:
        ids = torch.as_tensor(text)
        if ids.is_floating_point() or ids.dim() > 2 or (ids.dim() == 2 and ids.shape[0] != 1):
            raise ConfigError(f"calibrate: text= as token ids must be one row of ints, got {tuple(ids.shape)} "
                              f"{ids.dtype}")
    ids = ids.reshape(1, -1)[:, :length].to(device)
    if ids.shape[1] == 0:
        raise ConfigError("calibrate: the text has no tokens")
    return ids


# --------------------------------------------------------------------------------------------- measuring
@dataclass
class _Stats:
    """One layer's measurements: squared error sums per (setting, head), the exact heads' and the exact layer's."""

    heads: int
    den: float  # ||o_exact||^2 (fp32 reference)
    sq: list[list[float]]  # [setting][head]
    exact_head_sq: list[float]  # [head]: the exact heads' path
    exact_sq: float  # the exact layer (the exact path in the model's dtype)
    cost: list[float]  # [setting], the layer's heads all
    keys: list[float]
    head_cost: float  # one exact head, over the setting's cost
    exact_cost: float
    seq_len: int


def _head_sq(o, ref) -> list[float]:
    return (o.float() - ref).double().pow(2).sum((0, 1, 3)).tolist()


def _rel(sq: float, den: float) -> float:
    if den == 0:
        return 0.0 if sq == 0 else math.inf
    return math.sqrt(max(sq, 0.0) / den)


def _measure(cal, configs, cost: str, mod, q, k, v) -> _Stats:
    """One layer's measurements of every setting `configs` through the method's calibration `cal`."""
    from .kernels.softmax import softmax_attention  # the kernels load with the first calibration, not with the package

    scale, H, S = mod.scaling, q.shape[1], q.shape[2]
    ref = softmax_attention(q.float(), k.float(), v.float(), scale=scale)
    den = float(ref.double().pow(2).sum())
    sq, costs, keys = [], [], []
    o = None
    for cfg in configs:
        run = (lambda cfg=cfg: cal.attend(q, k, v, scale=scale, config=cfg))
        o = run()
        sq.append(_head_sq(o, ref))
        keys.append(H * sum(cal.attended_keys(cfg, S)))
        costs.append(cuda_median_ms(run) if cost == "time" else keys[-1])
    every = list(range(H))
    exact_heads = cal.with_exact_heads(torch.empty_like(o), q, k, v, every, scale=scale)
    exact = softmax_attention(q, k, v, scale=scale)
    row = (S + 1) / 2
    if cost == "time":
        head_cost = cuda_median_ms(lambda: cal.with_exact_heads(o, q, k, v, [0], scale=scale))
        exact_cost = cuda_median_ms(lambda: softmax_attention(q, k, v, scale=scale))
    else:
        head_cost, exact_cost = row, H * row
    return _Stats(H, den, sq, _head_sq(exact_heads, ref), sum(_head_sq(exact, ref)), costs, keys, head_cost,
                  exact_cost, S)


def _verify(cal, config, mod, q, k, v) -> float:
    """The measured error of a layer's choice (None: exact) as the patched module computes it."""
    from .kernels.softmax import softmax_attention

    scale = mod.scaling
    ref = softmax_attention(q.float(), k.float(), v.float(), scale=scale)
    if config is None:
        o = softmax_attention(q, k, v, scale=scale)
    else:
        o = cal.with_exact_heads(cal.attend(q, k, v, scale=scale, config=config), q, k, v, config.exact_heads,
                                 scale=scale)
    return _rel(float((o.float() - ref).double().pow(2).sum()), float(ref.double().pow(2).sum()))


class _LayerRecorder:
    """The patch's recorder (`PatchContext.recorder`) during an exact pass: each exact layer hands it its q, k, v;
    `per_layer(layer, module, q, k, v)` runs on them and the layer's output goes on unchanged."""

    def __init__(self, per_layer: Callable, progress) -> None:
        self.per_layer, self.progress = per_layer, progress
        self.out: dict[int, Any] = {}

    def record(self, module, q, k, v, padding, o):
        idx = module.layer_idx
        self.out[idx] = self.per_layer(idx, module, q, k, v)
        if self.progress is not None:
            self.progress(idx, self.out[idx])
        return o


def _exact_pass(model, ids, layers, per_layer: Callable, progress) -> dict[int, Any]:
    """One forward of `ids` with `layers` exact; per_layer(layer, module, q, k, v) runs on each layer's inputs, in
    order, and its results are returned by layer. The layers pass the exact output on, so every layer sees the
    unpatched model's inputs."""
    patch(model, EXACT, layers=layers)
    rec = _LayerRecorder(per_layer, progress)
    patch_context(model).recorder = rec
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
    finally:
        unpatch(model)
    return rec.out


# --------------------------------------------------------------------------------------------- choosing
@dataclass
class _Option:
    setting: int | None  # index of the configs; None: the layer exact
    heads: tuple[int, ...]
    error: float
    cost: float
    keys: float


def _options(st: _Stats, per_head: bool) -> list[_Option]:
    out = []
    row = (st.seq_len + 1) / 2
    for r, sq in enumerate(st.sq):
        total = sum(sq)
        out.append(_Option(r, (), _rel(total, st.den), st.cost[r], st.keys[r]))
        if not per_head:
            continue
        order = sorted(range(st.heads), key=lambda h: (st.exact_head_sq[h] - sq[h], h))  # largest gain first
        for n, h in enumerate(order[:-1], 1):
            if st.exact_head_sq[h] >= sq[h]:
                break  # an exact head that removes no error
            total += st.exact_head_sq[h] - sq[h]
            out.append(_Option(r, tuple(sorted(order[:n])), _rel(total, st.den), st.cost[r] + n * st.head_cost,
                               st.keys[r] + n * row))
    out.append(_Option(None, (), _rel(st.exact_sq, st.den), st.exact_cost, st.heads * row))
    return out


def _cheapest(options: list[_Option], target: float) -> _Option:
    ok = [o for o in options if o.error <= target]
    if not ok:
        return options[-1]  # exact attention
    return min(ok, key=lambda o: (o.cost, o.error))  # min keeps the first of equals: the ladder's order


def _hull(options: list[_Option]) -> list[_Option]:
    """The options no other beats in both cost and error, on their lower convex hull, cheapest first."""
    pareto: list[_Option] = []
    for o in sorted(options, key=lambda o: (o.cost, o.error)):
        if not pareto or o.error < pareto[-1].error:
            pareto.append(o)
    hull: list[_Option] = []
    for c in pareto:
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            if (a.error - b.error) * (c.cost - b.cost) > (b.error - c.error) * (b.cost - a.cost):
                break
            hull.pop()
        hull.append(c)
    return hull


def _choose_mean(options: dict[int, list[_Option]], target: float) -> dict[int, _Option]:
    hulls = {i: _hull(o) for i, o in options.items()}
    at = {i: 0 for i in hulls}
    n = len(hulls)
    total = sum(h[0].error for h in hulls.values())
    while total / n > target:
        best, gain = None, -1.0
        for i, h in hulls.items():
            if at[i] + 1 < len(h):
                a, b = h[at[i]], h[at[i] + 1]
                g = (a.error - b.error) / (b.cost - a.cost)
                if g > gain:
                    best, gain = i, g
        if best is None:
            break
        h = hulls[best]
        total += h[at[best] + 1].error - h[at[best]].error
        at[best] += 1
    return {i: hulls[i][at[i]] for i in hulls}


# --------------------------------------------------------------------------------------------- calibrate
def calibrate(model, method: str = "muse", text=None, *, tokenizer=None, target_error: float = 0.01, layers=None,
              length: int | None = None, objective: str = "layer", cost: str = "auto", per_head: bool = True,
              ladder: list[dict[str, Any]] | None = None, progress: Callable[[str], None] | None = None,
              **config) -> Calibration:
    """Patch the unpatched `model` with `method` at calibrated per-layer budgets and return the `Calibration`.

    text: the calibration text (a str with `tokenizer=`, or token ids), best at the length the model will run (the
    error grows with it); length: its first this-many tokens (default: all). target_error: the relative error
    ||o - o_exact|| / ||o_exact|| of a layer's attention output allowed, in (0, 1). objective: "layer" (every layer
    meets it) or "mean" (the mean over the layers does). cost: "keys", "time" (CUDA) or "auto" (time on CUDA, keys
    elsewhere). per_head: also make a setting's worst heads exact. ladder: the settings to try, as option overrides
    ({"topk_blocks": 4, "peak_blocks": 4}, ...; default: the method's). config: the method's options every setting
    starts from (the patch's config for the options a setting leaves). progress: called with a line per step.
    Layers: as patch() takes them (default all). The model must be unpatched; patch other layers afterwards."""
    target = check_target(target_error)
    if objective not in OBJECTIVES:
        raise ConfigError(f"objective={objective!r}; allowed: {', '.join(OBJECTIVES)} (every layer meets the target, "
                          "or the mean over the layers does)")
    if cost not in COSTS:
        raise ConfigError(f"cost={cost!r}; allowed: {', '.join(COSTS)}")
    if not isinstance(per_head, bool):
        raise ConfigError(f"per_head={per_head!r}; pass True or False")
    meth = get_method(method)
    cal = meth.calibration()  # MissingHookError (a ConfigError) for a method without budgets to calibrate
    if "exact_heads" in config:
        raise ConfigError("exact_heads is what calibrate chooses per layer; leave it out of the config")
    base = meth.parse_config(config)
    if find_state(model) is not None:
        raise AlreadyPatchedError("calibrate patches an unpatched model; call longctx_patch.unpatch(model) first (patch "
                                  "other layers after calibrating)")
    adapter = get_adapter(model)
    idx = parse_layers(layers, len(adapter.decoder_layers(model)))
    mcfg = model_config(model)
    specs = [adapter.spec(mcfg, i) for i in idx]
    meth.check_layers(specs, base)
    dev = next(model.parameters()).device
    if cost == "auto":
        cost = "time" if dev.type == "cuda" else "keys"
    if cost == "time" and dev.type != "cuda":
        raise DeviceError(f"cost='time' measures op times on CUDA; the model is on {dev.type}: use cost='keys'")
    ids = _token_ids(text, tokenizer, length, dev)
    S = ids.shape[1]
    cal.check_text(base, S, specs, dev.type)
    overrides, configs, seen = [], [], {}
    for over in [*(ladder if ladder is not None else cal.ladder(base, S)), {}]:
        if not isinstance(over, dict) or "exact_heads" in over:
            raise ConfigError(f"ladder: {over!r} is not a dict of {meth.name} options (exact_heads aside), such as "
                              "{'topk_blocks': 4, 'peak_blocks': 4}")
        cfg = meth.parse_config({**config, **over})
        key = cal.key(cfg)
        if key not in seen:
            seen[key] = len(configs)
            overrides.append(dict(over))
            configs.append(cfg)
    given = seen[cal.key(base)]  # the config as given: a setting too
    say = progress or (lambda line: None)
    say(f"calibrating {len(idx)} layers on {S} tokens: {len(configs)} settings each, target {100 * target:g}% "
        f"({objective}), cost: {cost}")
    n_done = [0]

    def measured(i, st):
        n_done[0] += 1
        best = min(_rel(sum(r), st.den) for r in st.sq)
        say(f"  layer {i} ({n_done[0]}/{len(idx)}): the config as given {100 * _rel(sum(st.sq[given]), st.den):.3f}%, "
            f"the best setting {100 * best:.3f}%")

    was_training = model.training
    model.eval()
    try:
        stats = _exact_pass(model, ids, idx, lambda i, mod, q, k, v: _measure(cal, configs, cost, mod, q, k, v),
                            lambda i, st: measured(i, st))
        options = {i: _options(stats[i], per_head) for i in idx}
        chosen = _choose_mean(options, target) if objective == "mean" else {
            i: _cheapest(o, target) for i, o in options.items()}
        measured_err: dict[int, float] = {}
        for rnd in range(MAX_ROUNDS + 1):
            todo = {i: (None if o.setting is None else
                        meth.parse_config({**config, **overrides[o.setting], "exact_heads": list(o.heads)}))
                    for i, o in chosen.items()}
            measured_err = _exact_pass(model, ids, idx, lambda i, mod, q, k, v: _verify(cal, todo[i], mod, q, k, v),
                                       None)
            missed = [i for i in idx if measured_err[i] > chosen[i].error and (
                measured_err[i] > target if objective == "layer" else sum(measured_err.values()) / len(idx) > target)]
            say(f"verified the choices (round {rnd + 1}): {len(missed)} layers measured above their prediction")
            if not missed:
                break
            for i in missed:
                chosen[i].error = measured_err[i]
            if rnd == MAX_ROUNDS:
                if objective == "layer":
                    for i in missed:
                        chosen[i] = options[i][-1]
                        measured_err[i] = chosen[i].error
                break
            chosen = _choose_mean(options, target) if objective == "mean" else {
                i: (_cheapest(options[i], target) if i in missed else o) for i, o in chosen.items()}
    finally:
        model.train(was_training)
    result = Calibration(meth.name, dict(config), target, objective, cost, per_head, S)
    for i in idx:
        o, st = chosen[i], stats[i]
        over = {} if o.setting is None else {**overrides[o.setting], **({"exact_heads": list(o.heads)} if o.heads
                                                                         else {})}
        result.layers.append(LayerCalibration(
            i, EXACT if o.setting is None else meth.name, over, measured_err[i], o.cost, o.keys, st.exact_cost,
            _rel(sum(st.sq[given]), st.den), st.cost[given], False))
    for x in result.layers:
        x.met = x.error <= target if objective == "layer" else result.met
    _apply(model, meth.name, config, result)
    return result


def _apply(model, method: str, config: dict[str, Any], result: Calibration) -> None:
    for name, over, layers in result.groups():  # the method's layers with their settings, the EXACT ones as they are
        patch(model, name, layers=layers, **({**config, **over} if name == method else over))
    find_state(model).calibration = result.to_record()


__all__ = ["COSTS", "Calibration", "LayerCalibration", "MAX_ROUNDS", "OBJECTIVES", "calibrate", "calibration_record",
           "check_target"]
