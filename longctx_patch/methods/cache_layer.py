"""`LongctxLayer`: the base of the methods' own transformers cache layers (a rolling window, a linear state,
a dictionary ...). It tracks how many tokens it has seen (what transformers reads for position ids and masks)
independently of how many it stores. `LongctxCache` (cache.py) holds one per patched layer.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin


class LongctxLayer(CacheLayerMixin):
    """Base of stateful cache layers. Subclasses list their batch-first state tensors in `state_names`."""

    is_sliding = False
    is_compileable = False
    is_croppable = False
    # why a layer that is not croppable cannot take tokens back (assisted decoding's refusal names it: cache.py)
    crop_refusal = "its state is not a list of tokens"
    state_names: tuple[str, ...] = ()
    # host-side fields a decode step moves on (decode_graphs.py replays a step and moves them as it did)
    host_fields: tuple[str, ...] = ("seen",)

    def __init__(self) -> None:
        super().__init__()
        self.seen = 0  # tokens processed so far (including left padding)
        for n in self.state_names:
            if not hasattr(self, n):
                setattr(self, n, None)

    # -- what transformers asks ---------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor | None = None) -> None:
        self.device = key_states.device
        self.dtype = key_states.dtype
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        raise TypeError(
            f"{type(self).__name__} keeps method-specific state; its attention module updates it. "
            "Do not call Cache.update() on a layer patched by longctx-patch."
        )

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # The model builds its 4-D mask from the first layer; report full length so that unpatched layers
        # (full KV) get the right mask. Patched modules ignore that mask.
        return self.seen + query_length, 0

    def get_max_length(self) -> int:
        return -1

    # -- decode steps replayed from CUDA graphs (decode_graphs.py) ---------------------------------------
    def graph_key(self):
        """What a one-token decode step of this layer reads from the host (the sizes and branches of its launches),
        hashable; equal keys mean the same launches on the same state tensors, updated in place. None: this
        layer's step cannot be replayed (the default: the state is replaced, not updated in place)."""
        return None

    def graph_variants(self) -> list[dict]:
        """Host states (values of `host_fields`) under which a later decode step of this cache will take another
        `graph_key()` than the next one (e.g. the step that ends a chunk), so that its graph can be captured ahead
        of the decode (decode_graphs.py); the default: none."""
        return []

    def host_state(self) -> dict:
        return {f: getattr(self, f) for f in self.host_fields}

    def set_host_state(self, values: dict) -> None:
        for f, v in values.items():
            setattr(self, f, v)

    # -- state management ---------------------------------------------------------------------------
    def state_tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for n in self.state_names:
            t = getattr(self, n, None)
            if isinstance(t, torch.Tensor):
                out[n] = t
        return out

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state_tensors().values())

    def _map(self, fn) -> None:
        for n, t in self.state_tensors().items():
            setattr(self, n, fn(t))

    def reset(self) -> None:
        for n in self.state_names:
            setattr(self, n, None)
        self.seen = 0
        self.is_initialized = False

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map(lambda t: t[indices, ...])

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def offload(self):
        self._map(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self):
        if self.is_initialized:
            self._map(lambda t: t.to(self.device, non_blocking=True))

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} cannot drop tokens (its state is not a list of tokens)")
