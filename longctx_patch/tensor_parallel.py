"""Tensor parallelism (transformers' `from_pretrained(..., tp_plan="auto")`): a patched module on its rank's heads.

Under transformers' tensor parallelism q_proj / k_proj / v_proj hold their output rows split across the ranks
(DTensor weights, `Shard(0)`) and return this rank's heads as plain tensors; o_proj holds its input columns split
(`Shard(1)`) and all-reduces its output. A patched module shares those projections, so it computes on its rank's
heads alone: `local_spec` gives it the rank's head counts (the config keeps the global ones).

A method's own tensors (feature maps, window factors, OVQ's beta ...) follow their shape: `build_sharded` builds the
module twice, for all heads and for the rank's heads; a tensor whose size differs in one dimension is sharded there
(this rank keeps its contiguous slice, as the projections do), the others are replicated. The full tensors are
broadcast from the group's first rank first, so every rank cuts the same ones. `HeadShard` records the split;
`full_tensor` gathers a sharded tensor back (the saved record is the unsharded one) and `local_part` cuts a full
one (loading a record or a checkpoint).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from .architectures import AttentionSpec, shared_weight
from .errors import UnsupportedModelError


@dataclass(frozen=True)
class HeadShard:
    """This rank's share of one patched layer: rank and size of its tensor-parallel group, and the method tensors
    split across it ({name in method_parameters(): the dimension}; absent names are replicated)."""

    rank: int
    world: int
    group: Any  # torch.distributed ProcessGroup
    dims: dict[str, int] = dataclasses.field(default_factory=dict)


def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return None
    return DTensor


def head_shard(orig: torch.nn.Module) -> HeadShard | None:
    """The tensor-parallel group an attention module's heads are split across (from its q_proj weight), or None
    when the module holds every head (no tensor parallelism, or a plan that leaves attention whole)."""
    DTensor = _dtensor_type()
    proj = getattr(orig, "q_proj", None)
    w = shared_weight(proj) if proj is not None else None
    if DTensor is None or not isinstance(w, DTensor):
        return None
    from torch.distributed.tensor import Shard

    dims = [i for i, p in enumerate(w.placements) if isinstance(p, Shard) and p.dim in (0, -w.dim())]
    if not dims:
        return None
    mesh = w.device_mesh
    if len(dims) > 1:
        _refuse(f"q_proj's weight is split along several mesh dimensions ({w.placements})")
    if mesh.size(dims[0]) == 1:
        return None
    return HeadShard(rank=mesh.get_local_rank(dims[0]), world=mesh.size(dims[0]), group=mesh.get_group(dims[0]))


def _refuse(why: str):
    raise UnsupportedModelError(
        f"tensor parallelism: {why}; longctx_patch supports transformers' tp_plan='auto' layout (q/k/v_proj split by "
        "output rows, o_proj by input columns, whole heads per rank): load the model with that plan, or without "
        "tp_plan")


def local_rows(proj: torch.nn.Module) -> int:
    """Output rows of a projection held on this rank (its local shard's, for a DTensor weight)."""
    w = shared_weight(proj)
    return (w.to_local() if hasattr(w, "to_local") else w).shape[0]


def local_spec(orig: torch.nn.Module, spec: AttentionSpec, shard: HeadShard) -> AttentionSpec:
    """`spec` with this rank's head counts: Hq / world query heads and Hkv / world kv heads (whole GQA groups),
    checked against the rows its q_proj and k_proj hold."""
    Hq, Hkv, world = spec.num_heads, spec.num_kv_heads, shard.world
    if Hq % world or Hkv % world:
        _refuse(f"layer {spec.layer_idx} has {Hq} query heads and {Hkv} kv heads, which {world} ranks cannot share "
                f"evenly (a rank would hold part of a head or of a GQA group); use a tensor-parallel size that "
                f"divides {Hkv}")
    local = dataclasses.replace(spec, num_heads=Hq // world, num_kv_heads=Hkv // world)
    for name, heads in (("q_proj", local.num_heads), ("k_proj", local.num_kv_heads), ("v_proj", local.num_kv_heads)):
        proj = getattr(orig, name, None)
        if proj is not None and local_rows(proj) != heads * spec.head_dim:
            _refuse(f"layer {spec.layer_idx}'s {name} holds {local_rows(proj)} output rows on rank {shard.rank}, not "
                    f"{heads} heads x {spec.head_dim}")
    return local


def build_sharded(build, orig: torch.nn.Module, spec: AttentionSpec, shard: HeadShard):
    """The patched module of this rank: `build(spec)` (the method's constructor) for the rank's heads, its method
    tensors cut from those of `build(spec)` for all heads (broadcast from the group's first rank)."""
    import torch.distributed as dist

    full = build(spec).method_parameters()
    mod = build(local_spec(orig, spec, shard))
    own = mod.method_parameters()
    dims = {}
    for name, t in own.items():
        f = full[name]
        diff = [d for d in range(t.dim()) if t.shape[d] != f.shape[d]]
        if not diff:
            continue
        if len(diff) > 1 or f.shape[diff[0]] != t.shape[diff[0]] * shard.world:
            _refuse(f"{mod.method_name}'s tensor {name} is {tuple(f.shape)} for all heads but {tuple(t.shape)} for a "
                    f"rank's: not one dimension split {shard.world} ways")
        dims[name] = diff[0]
    mod.head_shard = dataclasses.replace(shard, dims=dims)
    src = dist.get_global_rank(shard.group, 0)
    with torch.no_grad():
        for name, f in full.items():
            dist.broadcast(f, src=src, group=shard.group)
            own[name].copy_(local_part(mod, name, f))
    return mod


def local_part(mod, name: str, t: torch.Tensor) -> torch.Tensor:
    """This rank's part of the full (unsharded) method tensor `name` of module `mod`: `t` itself when replicated."""
    shard = getattr(mod, "head_shard", None)
    if shard is None or name not in shard.dims:
        return t
    d = shard.dims[name]
    n = t.shape[d] // shard.world
    return t.narrow(d, shard.rank * n, n)


def full_shape(mod, name: str, t: torch.Tensor) -> tuple[int, ...]:
    """The unsharded shape of `mod`'s method tensor `name` whose local value is `t`."""
    shard = getattr(mod, "head_shard", None)
    shape = list(t.shape)
    if shard is not None and name in shard.dims:
        shape[shard.dims[name]] *= shard.world
    return tuple(shape)


def full_tensor(mod, name: str, t: torch.Tensor) -> torch.Tensor:
    """The unsharded value of `mod`'s method tensor `name` (local value `t`): gathered from every rank of its group
    when it is sharded (a collective: every rank must call it), else `t`."""
    shard = getattr(mod, "head_shard", None)
    if shard is None or name not in shard.dims:
        return t
    import torch.distributed as dist

    t = t.detach().contiguous()
    parts = [torch.empty_like(t) for _ in range(shard.world)]
    dist.all_gather(parts, t, group=shard.group)
    return torch.cat(parts, dim=shard.dims[name])


def writes_files(modules) -> bool:
    """Whether this process writes a patched model's files: True unless the model is tensor-parallel (a module of
    `modules` holds a HeadShard) and this is not global rank 0."""
    if not any(getattr(mod, "head_shard", None) is not None for mod in modules):
        return True
    import torch.distributed as dist

    return dist.get_rank() == 0
