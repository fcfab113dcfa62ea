"""Decode steps replayed from CUDA graphs: `model.generate()` after `patch()` without the host's per-step cost.

An eager decode step of a 16-layer model issues a few hundred small launches from Python: 13-35 ms of host work
for about 1 ms of GPU work at batch 16 (docs/PERFORMANCE.md, "Decode"). `patch()` routes the top model's forward
through `DecodeGraphs`: a one-token step (no gradients, no padding) continuing a `LongctxCache` whose every layer
can be replayed (`LongctxLayer.graph_key()` is not None) runs the model's whole forward from a CUDA graph.

Why graphs per key: a method's decode step is not always the same launch. A LoLA step reads its position in the
window buffer from the device (one launch for every position), but every `chunk`-th step evicts, sized by the
host. Each layer says what its step depends on (`graph_key()`); the model's key is the tuple of its layers' keys
plus the batch shape, so a LoLA model has two graphs (a step, and the step that evicts). Everything else a step
reads must be device state updated in place (a graph keeps the addresses it was captured with).

Captured ahead: when `generate()`'s prefill ends (`PrefillThenCapture`, installed on the model as its `_prefill`),
the first decode step's graph and those of the keys the layers will need later (`graph_variants()`, e.g. LoLA's
evicting step) are captured at once, so that no decode step pays a capture. Only where a step of that shape and
key ran in this process before (a capture cannot compile kernels); otherwise the first decode step runs eagerly
and the next one captures, as for decode steps outside `generate()`.

The host side of a replayed step: each layer's host fields (`host_fields`, e.g. `seen`, `nb`) are moved on as the
captured step moved them (integers by the same difference, others to the value after the capture). State tensors
replaced outside a step (beam reordering, `batch_select_indices`) drop every graph of that cache.

The default: on for CUDA (`patch(..., decode_graphs=False)`, `set_decode_graphs(model, False)` or, where a call passes
no `decode_graphs`, the environment's `LONGCTX_DECODE_GRAPHS=0` at patch time turn it off: `default_enabled`); a
capture that fails runs the step eagerly (twice for one key, then that key stays eager). `LONGCTX_DECODE_GRAPHS=simulate` at patch time (the tests' `simulate` fixture;
`DecodeGraphs.simulate`) replays on the CPU by re-running the step with the layers' host fields as they were at the
capture (what a graph bakes in): the tests check with it that the keys cover everything a step reads from the host.
"""

from __future__ import annotations

import inspect
import os
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from transformers.cache_utils import Cache

from .cache import cache_argument
from .kernels.graphs import simulated_capture
from .methods.cache_layer import LongctxLayer

MAX_GRAPHS = 512  # per cache: a model whose keys never repeat stops capturing here
MAX_FAILURES = 2  # failed captures of one key before that key stays eager
_PASSED = {"input_ids", "attention_mask", "position_ids", "cache_position", "past_key_values", "cache", "use_cache",
           "return_dict", "logits_to_keep", "output_attentions", "output_hidden_states"}


def default_enabled() -> bool:
    """Whether decode graphs are on where `patch()` (or the speed runner) is passed no `decode_graphs`: the user's
    switch `LONGCTX_DECODE_GRAPHS` ("0": off; unset, "1" or "simulate": on)."""
    return _env_mode() != "0"


def _env_mode() -> str:
    return os.environ.get("LONGCTX_DECODE_GRAPHS", "1")


@dataclass
class _Entry:
    graph: Any  # torch.cuda.CUDAGraph, or _SimGraph
    out: Any  # the model output whose logits the replays overwrite (its cache field emptied: see _capture)
    cache_field: str | None  # the name of that field (`past_key_values` or `cache`), given the cache back per step
    before: list[dict]
    after: list[dict]


@dataclass
class _Store:
    """Per cache: static inputs, graphs by key, the state tensors they were captured against."""
    ids: torch.Tensor
    pos: torch.Tensor
    cpos: torch.Tensor | None
    state_sig: tuple
    graphs: dict = field(default_factory=dict)
    failures: dict = field(default_factory=dict)
    pool: Any = None
    eager_steps: int = 0
    captures: int = 0
    replays: int = 0
    one_device: bool = True  # a model split over devices (device_map) is never captured: a graph is one device's


def _state_sig(cache) -> tuple:
    """Which memory the layers' state tensors are (names, addresses, shapes, strides): equal before and after a step
    when it wrote into the tensors it found, allocating none; changed when something replaced them."""
    return tuple((n, t.data_ptr(), tuple(t.shape), t.stride()) for layer in cache.layers
                 for n, t in layer.state_tensors().items())


def model_key(cache) -> tuple | None:
    """The tuple of every layer's `graph_key()`, or None when some layer cannot be replayed."""
    keys = []
    for layer in cache.layers:
        k = layer.graph_key() if isinstance(layer, LongctxLayer) else None
        if k is None:
            return None
        keys.append(k)
    return tuple(keys)


def _advance(before: dict, after: dict, now: dict) -> dict:
    out = {}
    for f, a in after.items():
        b = before[f]
        out[f] = now[f] + (a - b) if isinstance(a, int) and not isinstance(a, bool) else a
    return out


class _SimGraph:
    """CPU stand-in for a CUDA graph: a replay re-runs the step with the host fields of the capture."""

    def __init__(self, run, layers, before, out):
        self.run, self.layers, self.before, self.out = run, layers, before, out

    def replay(self):
        for layer, h in zip(self.layers, self.before):
            layer.set_host_state(dict(h))
        with simulated_capture():
            self.out.logits.copy_(self.run().logits)


class DecodeGraphs:
    """The forward `patch()` installs on the top model: graph replay where it applies, the original elsewhere."""

    def __init__(self, model, orig_forward):
        self.model = model
        self.orig = orig_forward
        # what generate() and others read off `model.forward` (its parameters decide e.g. whether generate() passes
        # logits_to_keep=1 to the prefill, without which a 32k x 128k-vocab prefill computes every position's logits)
        self.__signature__ = inspect.signature(orig_forward)
        self._cache_arg = cache_argument(orig_forward)
        self.__doc__ = getattr(orig_forward, "__doc__", None)
        self.__name__ = getattr(orig_forward, "__name__", "forward")
        mode = _env_mode()
        self.enabled = default_enabled()  # `patch(..., decode_graphs=...)` / set_decode_graphs decide over it
        # "simulate" (tests): CPU replay by re-execution with capture-time host fields (`_SimGraph`); never on in use
        self.simulate = mode == "simulate"
        # (batch shape, logits_to_keep, model key, cache_position passed, device) of the decode steps that ran
        # (eagerly or captured) in this process: their kernels are compiled, so a graph of them can be captured
        # before any step runs (`after_prefill`)
        self._warm: set = set()

    # -- eligibility ------------------------------------------------------------------------------------
    def _cache(self, args, kwargs):
        from .cache import LongctxCache

        if args or not self.enabled or self.model.training or torch.is_grad_enabled():
            return None
        ids = kwargs.get("input_ids")
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[1] != 1:
            return None
        if not (ids.is_cuda or self.simulate) or (ids.is_cuda and torch.cuda.is_current_stream_capturing()):
            return None
        if any(v is not None and v is not False for k, v in kwargs.items() if k not in _PASSED):
            return None
        if kwargs.get("output_attentions") or kwargs.get("output_hidden_states") or kwargs.get("return_dict") is False:
            return None
        cache = kwargs.get("past_key_values", kwargs.get("cache"))
        if not isinstance(cache, LongctxCache) or cache.get_seq_length() == 0:
            return None
        facts = cache.padding_facts
        am = kwargs.get("attention_mask")
        if (facts is not None and facts[0]) or (am is not None and (facts is None or am.dim() != 2)):
            return None  # padded rows: the eager step (the mask tensor changes every step)
        if kwargs.get("use_cache") is False:
            return None
        return cache

    def __call__(self, *args, **kwargs):
        if args and args[0] is self.model:
            # re-bound as a method of the model: accelerate's `unwrap_model` (after its mixed-precision wrapper)
            # sets `model.forward = MethodType(<the forward it found>, model)`, which passes the model first
            args = args[1:]
        if self._cache_arg != "past_key_values" and "past_key_values" in kwargs and self._cache_arg not in kwargs:
            kwargs[self._cache_arg] = kwargs.pop("past_key_values")  # the name this transformers takes (5.24+: `cache`)
        cache = self._cache(args, kwargs)
        if cache is None:
            return self.orig(*args, **kwargs)
        key = model_key(cache)
        if key is None:
            return self.orig(*args, **kwargs)
        return self._step(cache, key, kwargs)

    # -- a step ---------------------------------------------------------------------------------------
    def _step(self, cache, key, kwargs):
        ids = kwargs["input_ids"]
        keep = kwargs.get("logits_to_keep", 0)
        if isinstance(keep, torch.Tensor):
            return self.orig(**kwargs)
        store: _Store | None = getattr(cache, "_decode_graphs", None)
        if store is None or store.ids.shape != ids.shape or store.state_sig != _state_sig(cache):
            # first step of this cache (it compiles the step's kernels before any capture), or state replaced
            out = self.orig(**kwargs)
            has_cpos = isinstance(kwargs.get("cache_position"), torch.Tensor)
            cache._decode_graphs = self._new_store(cache, ids, has_cpos)
            cache._decode_graphs.eager_steps = 1
            self._warm.add((tuple(ids.shape), keep, key, has_cpos, str(ids.device)))
            return out
        if not store.one_device:
            store.eager_steps += 1
            return self.orig(**kwargs)
        full_key = (tuple(ids.shape), keep, key)
        entry = store.graphs.get(full_key)
        if entry is None:
            if store.failures.get(full_key, 0) >= MAX_FAILURES or len(store.graphs) >= MAX_GRAPHS:
                store.eager_steps += 1
                return self.orig(**kwargs)
            self._load_inputs(store, cache, kwargs)
            entry = self._capture(store, cache, keep)
            if entry is None:
                store.failures[full_key] = store.failures.get(full_key, 0) + 1
                store.eager_steps += 1
                return self.orig(**kwargs)
            store.graphs[full_key] = entry
            store.captures += 1
            self._warm.add((*full_key, store.cpos is not None, str(ids.device)))
        else:
            self._load_inputs(store, cache, kwargs)
        now = [layer.host_state() for layer in cache.layers]
        entry.graph.replay()
        for layer, b, a, n in zip(cache.layers, entry.before, entry.after, now):
            layer.set_host_state(_advance(b, a, n))
        store.replays += 1
        out = entry.out  # its fields as the model names them, logits copied
        fields = {k: (v.clone() if k == "logits" else v) for k, v in out.items()}
        if entry.cache_field is not None:
            fields[entry.cache_field] = cache
        return type(out)(**fields)

    def _new_store(self, cache, ids, cpos: bool) -> _Store:
        return _Store(ids=ids.clone(), pos=ids.clone(), cpos=ids.new_zeros(1) if cpos else None,
                      state_sig=_state_sig(cache),
                      one_device=len({t.device for t in self.model.parameters()}) <= 1)

    # -- captured ahead ------------------------------------------------------------------------------------
    def after_prefill(self, cache, batch: int) -> None:
        """After generate()'s prefill (its last chunk, with `prefill_chunk_size`): the next forwards are decode steps
        of one token per row on `cache`. Capture their graphs now: the first step's, and those of the keys the layers
        name in `graph_variants()` (LoLA's evicting step), where a step of that shape and key ran in this process
        before (its kernels are compiled: a capture cannot compile them, nor tell which logits_to_keep generate()
        passes)."""
        from .cache import LongctxCache

        if (not isinstance(cache, LongctxCache) or not self.enabled or self.model.training or torch.is_grad_enabled()
                or cache.get_seq_length() == 0):
            return
        facts = cache.padding_facts
        if facts is not None and facts[0]:
            return  # padded rows: eager steps
        store = getattr(cache, "_decode_graphs", None)
        if store is not None and store.state_sig == _state_sig(cache):
            return  # a continued cache whose graphs still hold
        key = model_key(cache)
        shape = (batch, 1)
        # a copy: another thread's generate() may add to the set meanwhile
        warm = next((w for w in tuple(self._warm) if w[0] == shape and w[2] == key), None)
        if key is None or warm is None:
            return
        _, keep, _, has_cpos, device = warm
        if not (torch.device(device).type == "cuda" or self.simulate):
            return
        if torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing():
            return
        store = self._new_store(cache, torch.zeros(shape, dtype=torch.long, device=device), has_cpos)
        if not store.one_device:
            return
        layers = cache.layers
        now = [layer.host_state() for layer in layers]
        variants = [layer.graph_variants() if isinstance(layer, LongctxLayer) else [] for layer in layers]
        states = [now] + [[v[j] if j < len(v) else h for v, h in zip(variants, now)]
                          for j in range(max((len(v) for v in variants), default=0))]
        try:
            for host in states:
                for layer, h in zip(layers, host):
                    layer.set_host_state(dict(h))
                k = model_key(cache)
                full_key = (shape, keep, k)
                if k is None or full_key in store.graphs:
                    continue
                entry = self._capture(store, cache, keep)
                if entry is None:
                    store.failures[full_key] = store.failures.get(full_key, 0) + 1
                    if host is now:  # the first step cannot be captured now: it runs eagerly, as without this
                        return
                    continue
                store.graphs[full_key] = entry
                store.captures += 1
        finally:
            for layer, h in zip(layers, now):
                layer.set_host_state(dict(h))
        cache._decode_graphs = store

    def _load_inputs(self, store: _Store, cache, kwargs) -> None:
        store.ids.copy_(kwargs["input_ids"])
        pos = kwargs.get("position_ids")
        if isinstance(pos, torch.Tensor) and pos.shape == store.pos.shape:
            store.pos.copy_(pos)
        else:  # no padding: every row is at the cache's length
            store.pos.fill_(cache.get_seq_length())
        if store.cpos is not None:
            cp = kwargs.get("cache_position")
            if isinstance(cp, torch.Tensor) and cp.shape == store.cpos.shape:
                store.cpos.copy_(cp)
            else:
                store.cpos.fill_(cache.get_seq_length())

    def _capture(self, store: _Store, cache, keep) -> _Entry | None:
        layers = cache.layers
        call = {"input_ids": store.ids, "position_ids": store.pos, "use_cache": True, "return_dict": True}
        if keep:
            call["logits_to_keep"] = keep
        if store.cpos is not None:
            call["cache_position"] = store.cpos

        cache_ref = weakref.ref(cache)  # what a graph keeps must not keep the cache alive (a reference cycle
        # through the cache's own graph store would hold its state until the garbage collector runs)

        def run():
            return self.orig(**call, **{self._cache_arg: cache_ref()})

        before = [layer.host_state() for layer in layers]
        sig = _state_sig(cache)
        attrs = [dict(layer.state_tensors()) for layer in layers]
        saved = [{n: t.clone() for n, t in a.items()} for a in attrs] if self.simulate else None
        graph = out = None
        try:
            if self.simulate:
                with simulated_capture():
                    out = run()
            else:
                from .kernels.graphs import capture_graph

                if store.pool is None:
                    store.pool = torch.cuda.graph_pool_handle()
                graph, out = capture_graph(run, store.ids.device, pool=store.pool)
        except Exception:  # noqa: BLE001 - a step that cannot be captured runs eagerly
            out = None
        after = [layer.host_state() for layer in layers]
        same = _state_sig(cache) == sig
        # undo what the capture's Python did to the host side (and, simulated, what its kernels did)
        for layer, a, h in zip(layers, attrs, before):
            for n, t in a.items():
                setattr(layer, n, t)
            layer.set_host_state(dict(h))
        if saved is not None:
            for a, s in zip(attrs, saved):
                for n, t in a.items():
                    t.copy_(s[n])
        if out is None or not same or getattr(out, "logits", None) is None:
            return None
        if self.simulate:
            graph = _SimGraph(run, layers, before, out)
        field_name = next((k for k, v in out.items() if v is cache), None)
        if field_name is not None:
            out[field_name] = None
        return _Entry(graph=graph, out=out, cache_field=field_name, before=before, after=after)


def stats(cache) -> dict | None:
    """{eager_steps, captures, replays, graphs} of a cache's decode so far (None: no decode step went this way)."""
    store = getattr(cache, "_decode_graphs", None)
    if store is None:
        return None
    return {"eager_steps": store.eager_steps, "captures": store.captures, "replays": store.replays,
            "graphs": len(store.graphs)}


class PrefillThenCapture:
    """generate()'s `_prefill`, installed on a patched model (patcher.py): the model's own prefill, a check that its
    last logits are finite (generation.check_prefill_logits: NaN or inf is a NumericalError, not an empty answer),
    then `DecodeGraphs.after_prefill` on the cache it filled. An object holding its model, not a closure, so that deep
    copies and pickles of the model carry it with their own model."""

    def __init__(self, model, previous=None):
        self.model = model
        self.previous = previous  # an override the instance had before the patch (None: the class's method)

    def __call__(self, *args, **kwargs):
        model = self.model
        if self.previous is not None:
            out = self.previous(*args, **kwargs)
        else:
            out = type(model)._prefill(model, *args, **kwargs)
        logits = getattr(out, "logits", None)
        if isinstance(logits, torch.Tensor):  # NaN or inf logits: a named error, not an empty answer
            from .generation import check_prefill_logits

            check_prefill_logits(model, logits)
        fwd = model.__dict__.get("forward")
        fwd = getattr(fwd, "__func__", fwd)  # re-bound as a method (accelerate's unwrap_model)
        if isinstance(fwd, DecodeGraphs):
            cache = next((v for v in out.values() if isinstance(v, Cache)), None) if hasattr(out, "values") else None
            if cache is not None and isinstance(logits, torch.Tensor):
                fwd.after_prefill(cache, logits.shape[0])
        return out
