"""Left-padded batches under LoLA (lam > 0): each row evicts on the grid of its own real tokens (`RowPhases`), so
a padded row gets the result of its prompt alone; the rows due at a position are evicted apart (`evict_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .state import LolaRun, LolaState, drop_front, ensure_mask, lola_evict

@dataclass(eq=False)
class RowPhases:
    """The eviction grid of each row of a left-padded batch: row r evicts when pos - lead[r] is a positive
    multiple of `chunk` (its own count of real tokens), as the row alone would.

    lead[r]: position of the row's first real token, None while none has been seen (the row never evicts);
    groups: phase -> rows (sorted) of the rows that evict when pos % chunk == phase; index: the same rows as
    LongTensors on the state's device (views of one tensor, made once: no host-to-device copy per step)."""

    lead: tuple
    chunk: int
    groups: dict
    index: dict
    device: torch.device | None = None

    @property
    def pending(self) -> bool:
        return any(l is None for l in self.lead)

    def need(self, pos: int, window: int) -> int:
        """Buffer rows the batch needs at `pos`: per row its undecided real tokens (those since its last
        eviction's window start), at most window + chunk - 1 after an eviction; the most of any row."""
        n = 0
        for l in self.lead:
            if l is not None and pos > l:
                c = pos - l
                n = max(n, min(c, window + c % self.chunk))
        return n

    def next_boundary(self, pos: int) -> int:
        """Tokens until the next position (> pos) at which some row evicts; `chunk` when no row ever does."""
        if not self.groups:
            return self.chunk - pos % self.chunk
        return min((p - pos - 1) % self.chunk + 1 for p in self.groups)

    def select(self, rows) -> "RowPhases | None":
        """The phases of the batch rows `rows` (a list of indices: beam search, batch selection)."""
        return row_phases([self.lead[int(r)] for r in rows], self.chunk, self.device)


def row_phases(lead, chunk: int, device) -> RowPhases | None:
    """The `RowPhases` of rows whose first real tokens sit at `lead` (None: not seen yet); None when every row has
    a first token at a multiple of `chunk` (its padding is whole chunks, neutral: the plain grid is exact)."""
    lead = tuple(None if l is None else int(l) for l in lead)
    if all(l is not None and l % chunk == 0 for l in lead):
        return None
    groups: dict = {}
    for r, l in enumerate(lead):
        if l is not None:
            groups.setdefault(l % chunk, []).append(r)
    index = {}
    if groups:
        order = [r for p in sorted(groups) for r in groups[p]]
        flat = torch.tensor(order, dtype=torch.long, device=device)  # one host-to-device copy
        i = 0
        for p in sorted(groups):
            index[p] = flat[i:i + len(groups[p])]
            i += len(groups[p])
    return RowPhases(lead, chunk, {p: tuple(rs) for p, rs in groups.items()}, index, device)


def left_padding_counts(key_mask: torch.Tensor) -> list[int]:
    """Leading padding columns of each row of a [B, S] bool mask (S for a row of padding only); one host sync."""
    km = key_mask.bool()
    first = km.int().argmax(dim=1)
    return torch.where(km.any(dim=1), first, torch.full_like(first, km.shape[1])).tolist()


def evict_rows(st: LolaState, idx: torch.Tensor, run: LolaRun) -> None:
    """`lola_evict` of the batch rows `idx` only (the rows at their chunk boundary); the other rows' sparse cache
    and state stay as they are. The evicted rows' candidates become decided: masked in the buffer, which keeps
    them while another row still needs those slots."""
    n_ev = st.nb - run.window
    if n_ev <= 0:
        return
    take = lambda t: t.index_select(0, idx)  # noqa: E731
    ensure_mask(st, st.win_k.shape[0], st.win_k.device)
    sub = LolaState(win_k=take(st.win_k[:, :, :n_ev]), win_v=take(st.win_v[:, :, :n_ev]),
                    win_mask=take(st.win_mask[:, :n_ev]), sp_k=take(st.sp_k), sp_v=take(st.sp_v),
                    sp_score=take(st.sp_score), H=take(st.H), s=take(st.s),
                    win_fk=None if st.win_fk is None else take(st.win_fk[:, :, :n_ev]), pos=st.pos, nb=st.nb,
                    inplace=False)
    lola_evict(sub, window=run.window, lam=run.lam, phi_k=run.phi_k, backend=run.backend, tuning=run.tuning)
    for name in ("sp_k", "sp_v", "sp_score", "H", "s"):
        t, new = getattr(st, name), getattr(sub, name)
        if st.inplace:  # same storage (the layer's state)
            t.index_copy_(0, idx, new.to(t.dtype))
        else:
            setattr(st, name, t.index_copy(0, idx, new.to(t.dtype)))
    if not st.inplace:
        st.win_mask = st.win_mask.clone()
    st.win_mask[:, :n_ev].index_fill_(0, idx, False)


def phased_step_end(st: LolaState, run: LolaRun) -> None:
    """After a piece of a batch with `RowPhases`: evict the rows at their boundary, then drop the front buffer
    rows no row needs any more (decided or padding in every row)."""
    ph = st.phases
    rows = ph.groups.get(st.pos % ph.chunk)
    if rows is not None:
        if len(rows) == st.win_k.shape[0]:
            lola_evict(st, window=run.window, lam=run.lam, backend=run.backend, phi_k=run.phi_k, tuning=run.tuning)
        else:
            evict_rows(st, ph.index[st.pos % ph.chunk], run)
    drop = st.nb - ph.need(st.pos, run.window)
    if drop > 0:
        drop_front(st, drop)


def resolve_pending(st: LolaState, key_mask_new, S: int, chunk: int) -> None:
    """Rows with no real token so far get their first one from this call (its mask, or its first column)."""
    ph = st.phases
    pads = left_padding_counts(key_mask_new) if key_mask_new is not None else [0] * len(ph.lead)
    lead = [l if l is not None else (st.pos + p if p < S else None) for l, p in zip(ph.lead, pads)]
    st.phases = row_phases(lead, chunk, st.H.device)
