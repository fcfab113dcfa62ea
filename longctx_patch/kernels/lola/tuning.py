"""How the LoLA / LoLCATs kernels run, never what they compute: `LolaTuning`, one frozen object passed down to every
host function that launches them (`tuning=`; a patched layer's `HybridAttention.tuning`). Its defaults are what the
product runs; benchmarks and tests pass other values (benchmarks/ops/bench_lola.py sweeps them) instead of changing
anything inside the package. No Triton import: `state.py` and `prefill.py` read it on any install."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class LolaTuning:
    """The paths of a Triton prefill and the kernels' launch settings. The paths give the same result as the ones they
    replace (tests/test_lola_kernels.py, tests/test_lola_continued_prefill.py); a launch setting None is the default
    written at its launch."""

    # the paths of a Triton prefill
    parallel_prefill: bool = True  # a prefill of >= 2 chunks takes `prefill.lola_parallel` (two passes)
    graph_prefill: bool = True  # the evictions of that prefill, or full chunks of the chunk loop, replayed from a graph
    # the whole-sequence hybrid forward (triton_hybrid.hybrid_fwd)
    hybrid_num_warps: int | None = None
    hybrid_num_stages: int | None = None
    # the linear state's fold (triton_state.fold_into_state) and the attention of a chunk loop's piece (state.py)
    fold_block: int | None = None
    piece_block_m: int | None = None
    # the evictions of the two-pass prefill (triton_evict.PrefillEvictions)
    score_prec: str | None = None
    ev_score_bn: int | None = None
    ev_score_warps: int | None = None
    ev_score_stages: int | None = None
    ev_select_bits: int | None = None
    ev_fold_block: int | None = None
    ev_fold_bn: int | None = None
    ev_fold_warps: int | None = None
    ev_select_warps: int | None = None
    # decode (one token): the step kernel's key/feature tiles and warps; the feature map's row tile and warps
    decode_bn: int | None = None
    decode_bk: int | None = None
    decode_warps: int | None = None
    fmap_bm: int | None = None
    fmap_warps: int | None = None
    # the feature map's projection with fp32 weights, forward and the backward's recomputation: "ieee" or "tf32x3"
    # (three tf32 tensor-core products, fp32's accuracy); None: triton_hybrid.fmap_precision's choice
    fmap_prec: str | None = None
    # the whole-sequence hybrid's backward (triton_hybrid_bwd.py): warps of its dq and dkv kernels, their stages
    bwd_dq_warps: int | None = None
    bwd_dkv_warps: int | None = None
    bwd_stages: int | None = None
    # the training pass (ops.HybridAttentionFn): keys per prefix state and the forward/backward tiles
    train_state_chunk: int | None = None
    train_block_m: int | None = None
    train_block_n: int | None = None

    def replace(self, **changes) -> "LolaTuning":
        """This tuning with `changes`; a ValueError names a key that is not a setting."""
        unknown = sorted(set(changes) - set(self.names()))
        if unknown:
            raise ValueError(f"not LoLA kernel settings: {', '.join(unknown)}; the settings: {', '.join(self.names())}")
        return dataclasses.replace(self, **changes)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    def launch_settings(self) -> dict[str, int | str | None]:
        """The launch settings (the prefill's paths aside), by name."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in ("parallel_prefill", "graph_prefill")}


DEFAULT_TUNING = LolaTuning()

__all__ = ["DEFAULT_TUNING", "LolaTuning"]
