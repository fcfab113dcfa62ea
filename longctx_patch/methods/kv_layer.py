"""`KVBufferLayer`: the preallocated K/V cache of `exact` and `sliding-window` layers, whose one-token decode steps
write in place and so can be replayed from CUDA graphs (decode_graphs.py).

A cache that grows by concatenation (transformers' DynamicLayer) hands every step new tensors of a new length: no
graph can replay that. Here keys and values live in buffers `[B, Hkv, capacity, D]` with a key-validity mask
`[B, capacity]` and a device write slot `pos` `[B]` (every row equal; batch-first so that beam reordering and batch
selection treat it like the rest). Token t sits in slot `t % capacity`:

- full attention (`window` None): `capacity` > tokens stored; a prefill rounds its length up with headroom, a step
  that would overflow grows the buffer (new tensors: decode_graphs sees the state replaced and captures again);
- a windowed layer: the buffer grows the same way up to `window` slots, then is a ring of the last `window` tokens
  (a decode step overwrites the oldest one, then its query sees exactly the `window` keys its own included).

A decode step (one token, no gradient) writes k/v at `pos` (`scatter_`), marks the slot valid, advances `pos` in
place, and attends over the WHOLE buffer under the validity mask with no causal or window rule (every stored key is
in the query's past and inside its window; softmax does not depend on the order of its keys, and rotary is applied
before caching). Its launches depend only on `capacity` (`graph_key`); `seen` is the one host field it moves.
Multi-token calls (a prefill, a chunk) attend with the causal and window rules over the keys in positional order
(a view of the buffer, or for a full ring the kept past gathered in order plus the new keys), as before.

Gradients: keys are stored detached; a call with gradients attends over its own keys with their history, but not
through the keys of earlier calls (training runs with `use_cache=False`).

Cropping (transformers' assisted generation verifies several candidate tokens in one forward, then `crop`s the
rejected ones): full attention drops the last tokens by their mask. A full ring has overwritten the oldest tokens
with the candidates, so after `activate_past_recording()` (which transformers calls once the prefill is done) each
forward over a full ring keeps what it attended to, the kept past and its new tokens in positional order (a view it
computes anyway, held until the next forward), and `crop` rewrites the ring from it. Such forwards run eagerly
(`graph_key` None), one-token ones through the multi-token path.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..kernels.softmax import key_mask_for
from .cache_layer import LongctxLayer

ALIGN = 256  # capacities are multiples of this
HEADROOM = 256  # free slots at least, after a prefill (decode steps before the first regrow)
GROW = 1024  # a regrow adds at least this many slots (and at least capacity // 8)


def capacity_for(tokens: int, window: int | None = None, current: int = 0) -> int:
    """Slots a buffer holding `current` slots grows to for `tokens` tokens (`current` 0: the first allocation, what a
    prefill of `tokens` allocates); a windowed layer never holds more than `window` slots."""
    want = tokens + HEADROOM
    if current:
        want = max(want, current + max(GROW, current // 8))
    cap = -(-want // ALIGN) * ALIGN
    return cap if window is None else min(cap, window)


def kv_buffer_bytes(tokens: int, batch: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                    window: int | None = None) -> int:
    """Bytes of a `KVBufferLayer` after a prefill of `tokens` tokens: K and V, the validity mask, the write slots."""
    cap = capacity_for(tokens, window)
    elt = torch.tensor([], dtype=dtype).element_size()
    return 2 * batch * kv_heads * cap * head_dim * elt + batch * cap + 8 * batch


class KVView(NamedTuple):
    """What a query attends to after `KVBufferLayer.extend`: `softmax_attention(q, keys, values, key_mask=key_mask,
    q_offset=q_offset, window=window)`."""

    keys: torch.Tensor
    values: torch.Tensor
    key_mask: torch.Tensor | None
    q_offset: int | None
    window: int | None


class Undo(NamedTuple):
    """What a forward over a full ring attended to (kept while past recording is on): `crop` rewinds the ring from
    it to any length from `start` (the forward's first token) on."""

    start: int
    first: int  # the token of keys[:, :, 0]
    keys: torch.Tensor  # [B, Hkv, L, D]: tokens first .. first + L - 1 in positional order
    values: torch.Tensor
    valid: torch.Tensor | None  # [B, L] (True = real token), None: every token real


class KVBufferLayer(LongctxLayer):
    """Preallocated K/V of an exact layer (window None) or a windowed one (a ring of `window` slots once full)."""

    state_names = ("keys", "values", "mask", "pos")
    host_fields = ("seen",)
    is_croppable = True

    def __init__(self, window: int | None = None):
        super().__init__()
        self.window = window
        self.record_past = False  # transformers' flag: crop() must be able to take back the last forward's tokens
        self._undo: Undo | None = None  # what the last forward over a full ring attended to, while recording

    def activate_past_recording(self, **kwargs) -> None:
        """transformers calls this before a generation that crops (assisted generation): from now on a forward over
        a full ring keeps what `crop` needs to take its tokens back."""
        self.record_past = True

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    @property
    def ring(self) -> bool:
        """Slots are reused (token t in slot t % window): the buffer reached the window."""
        return self.window is not None and self.capacity == self.window

    # -- decode graphs -------------------------------------------------------------------------------------
    def graph_key(self):
        # a step's launches are sized by the capacity; a step that would overflow grows the buffer (eagerly)
        if self.keys is None or (not self.ring and self.seen + 1 > self.capacity):
            return None
        if self.record_past and self.ring:  # the step keeps what crop needs: eagerly, through the multi-token path
            return None
        return ("kv", self.capacity)

    # -- the attention module's entry point -----------------------------------------------------------------
    def extend(self, k: torch.Tensor, v: torch.Tensor, padding: torch.Tensor | None) -> KVView:
        """Stores the new keys/values `[B, Hkv, S, D]` (the last S of `padding` `[B, seen + S]`, True = real token)
        and returns what the S queries attend to."""
        S = k.shape[2]
        grad = torch.is_grad_enabled() and (k.requires_grad or v.requires_grad)
        self._undo = None  # crop takes back the tokens of the last forward only
        self._reserve(self.seen + S, k)
        if S == 1 and not grad and not (self.record_past and self.ring):
            return self._step(k, v, padding)
        start, end = self.seen, self.seen + S
        if end <= self.capacity:  # positional order: the buffer's first `end` slots
            self._write(k, v, padding, start)
            if grad:  # this call's keys with their history
                keys = torch.cat([self.keys[:, :, :start], k], dim=2)
                values = torch.cat([self.values[:, :, :start], v], dim=2)
            else:
                keys, values = self.keys[:, :, :end], self.values[:, :, :end]
            return KVView(keys, values, key_mask_for(padding, end), None, self.window)
        # a full ring: the kept past (the last window - 1 tokens) in positional order, then the new tokens
        n_past = min(start, self.window - 1)
        idx = (torch.arange(start - n_past, start) % self.capacity).to(k.device)
        keys = torch.cat([self.keys.index_select(2, idx), k], dim=2)
        values = torch.cat([self.values.index_select(2, idx), v], dim=2)
        valid = key_mask_for(padding, n_past + S)
        if self.record_past:
            self._undo = Undo(start, start - n_past, keys.detach(), values.detach(), valid)
        m = min(S, self.capacity)
        self._write(k[:, :, S - m:], v[:, :, S - m:], padding, end - m)
        return KVView(keys, values, valid, None, self.window)

    # -- storage -----------------------------------------------------------------------------------------------
    def _reserve(self, tokens: int, like: torch.Tensor) -> None:
        """Allocates, or grows (copying), so that `tokens` tokens fit (a full ring always fits)."""
        if self.keys is not None and (tokens <= self.capacity or self.ring):
            return
        if not self.is_initialized:
            self.lazy_initialization(like)
        cap = capacity_for(tokens, self.window, self.capacity)
        B, H, _, D = like.shape
        keys = torch.zeros(B, H, cap, D, dtype=like.dtype, device=like.device)
        values = torch.zeros_like(keys)
        mask = torch.zeros(B, cap, dtype=torch.bool, device=like.device)
        if self.keys is not None:  # tokens t < old capacity <= window sit in slot t in both
            old = self.capacity
            keys[:, :, :old] = self.keys
            values[:, :, :old] = self.values
            mask[:, :old] = self.mask
        self.keys, self.values, self.mask = keys, values, mask
        self.pos = torch.full((B,), self.seen % cap, dtype=torch.long, device=like.device)

    def _write(self, k, v, padding, first: int) -> None:
        """Tokens first .. first + n - 1 (host-known slots), then `seen` and the device slot move past them."""
        n = k.shape[2]
        cap = self.capacity
        valid = padding[:, padding.shape[1] - n:] if padding is not None else True
        if first % cap + n <= cap:  # contiguous slots
            s = first % cap
            self.keys[:, :, s:s + n] = k.detach()
            self.values[:, :, s:s + n] = v.detach()
            self.mask[:, s:s + n] = valid
        else:
            idx = (torch.arange(first, first + n) % cap).to(k.device)
            self.keys.index_copy_(2, idx, k.detach().to(self.keys.dtype))
            self.values.index_copy_(2, idx, v.detach().to(self.values.dtype))
            if padding is None:
                self.mask.index_fill_(1, idx, True)
            else:
                self.mask.index_copy_(1, idx, valid.bool())
        self.seen = first + n
        self.pos.fill_(self.seen % cap)

    def _step(self, k, v, padding) -> KVView:
        """One decode step on device state only (what a graph replays): write at `pos`, advance it, attend all."""
        B, H, _, D = k.shape
        cap = self.capacity
        slot = self.pos.view(B, 1)
        at = self.pos.view(B, 1, 1, 1).expand(B, H, 1, D)
        self.keys.scatter_(2, at, k.to(self.keys.dtype))
        self.values.scatter_(2, at, v.to(self.values.dtype))
        if padding is None:
            self.mask.scatter_(1, slot, True)
            km = self.mask
        else:  # the token's validity for later queries; its own query always sees it (attention_mask's rule)
            self.mask.scatter_(1, slot, padding[:, -1:].bool())
            km = self.mask.clone().scatter_(1, slot, True)
        self.pos.add_(1)
        if self.ring:
            self.pos.remainder_(cap)
        self.seen += 1
        # q_offset = capacity: past every slot, so no causal rule and no forced "own key" slot (the mask has it)
        return KVView(self.keys, self.values, km, cap, None)

    # -- what transformers asks ---------------------------------------------------------------------------
    def crop(self, tokens_to_remove: int) -> None:
        """Drops the last `-tokens_to_remove` tokens (transformers' convention: a negative count), as DynamicLayer. A
        full ring can drop the tokens of its last forward when past recording is on (`activate_past_recording`,
        which transformers' assisted generation calls); earlier tokens are gone from it."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop({tokens_to_remove}): pass a negative number of tokens to remove")
        undo, self._undo = self._undo, None
        n = -tokens_to_remove
        if n == 0 or self.keys is None:
            return
        n = min(n, self.seen)
        if self.ring and self.seen > self.capacity:  # slots were reused: the dropped tokens overwrote older ones
            if undo is None or self.seen - n < undo.start:
                why = (f"{n} asked, it can drop the {self.seen - undo.start} tokens of its last forward"
                       if undo is not None else "it can drop the tokens of its last forward once past recording is on "
                       "(cache.activate_past_recording(), as transformers' assisted generation does)")
                raise NotImplementedError(f"{type(self).__name__} of a window of {self.window} tokens cannot drop tokens "
                                          f"once it is full (the tokens before its window are gone): {why}")
            self._rewind(undo, self.seen - n)
            return
        self.mask[:, self.seen - n:self.seen] = False
        self.seen -= n
        self.pos.fill_(self.seen % self.capacity)

    def _rewind(self, undo: "Undo", seen: int) -> None:
        """The ring as it was after token `seen - 1` (at least the last forward's first token), from what that forward
        attended to: its last `capacity - 1` tokens in their slots (the slot of the next token holds none of its
        window; it is written before it is read)."""
        cap = self.capacity
        tokens = torch.arange(max(seen - cap + 1, 0), seen)
        slots = (tokens % cap).to(self.keys.device)
        src = (tokens - undo.first).to(self.keys.device)
        self.keys.index_copy_(2, slots, undo.keys.index_select(2, src).to(self.keys.dtype))
        self.values.index_copy_(2, slots, undo.values.index_select(2, src).to(self.values.dtype))
        self.mask.fill_(False)
        if undo.valid is None:
            self.mask.index_fill_(1, slots, True)
        else:
            self.mask.index_copy_(1, slots, undo.valid.index_select(1, src).bool())
        self.seen = seen
        self.pos.fill_(seen % cap)

    def reset(self) -> None:
        super().reset()
        self._undo = None
