"""What a fine-tune run does differently under several processes (DDP through accelerate, FSDP2)."""

from __future__ import annotations

import contextlib
import os

import torch
from torch import nn

from ..errors import ConfigError
from .params import method_parameters


def _env_flag(name: str) -> bool:
    from accelerate.utils import parse_flag_from_env

    return parse_flag_from_env(name, default=False)


@contextlib.contextmanager
def _env_set(name: str, value: str | None):
    """Sets an environment variable for the duration of the block (None: leaves it alone)."""
    if value is None:
        yield
        return
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


class DistributedMixin:
    """The parts of a `Finetuner` run that differ under several processes: the FSDP2 plugin and sharding, the
    method parameters' replicated gradients."""

    def _fsdp_plugin(self):
        """The accelerate FSDP2 settings of the launch (wrap policy, reshard_after_forward); the ones this runner
        cannot honour are refused."""
        from accelerate import FullyShardedDataParallelPlugin
        from torch.distributed.fsdp import CPUOffloadPolicy

        plugin = getattr(self.accelerator.state, "fsdp_plugin", None)
        if plugin is None:  # CPU: accelerate ran as MULTI_CPU; read the same settings from the environment
            plugin = FullyShardedDataParallelPlugin()
        if isinstance(plugin.cpu_offload, CPUOffloadPolicy):
            raise ConfigError("--fsdp_offload_params true is not supported by longctx finetune; leave it false")
        if plugin.activation_checkpointing:
            raise ConfigError(
                "--fsdp_activation_checkpointing is not supported by longctx finetune; leave it false and set "
                "stages.N.gradient_checkpointing: true instead (it works under FSDP)"
            )
        return plugin

    # ------------------------------------------------------------------------------------------- setup
    def _shard(self, root: nn.Module, keep_gathered: bool = False) -> nn.Module:
        """FSDP2 (`fully_shard`) in place: one unit per decoder layer (plus the modules the accelerate wrap policy
        names), the rest (embeddings, final norm, head) in the root unit. Frozen and trainable parameters (the
        base model, LoRA) share a unit. Returns `root` (now an FSDPModule).

        The method's own parameters (feature maps, window factors, ...; small) are left out of the units and
        replicated, their gradients averaged by `_average_replicated_grads`: the attention-transfer loss reaches
        them only through per-layer side losses, not through the layers' outputs (teacher forcing detaches them),
        so FSDP's backward hooks, which hang on those outputs, would never reduce their gradients.

        `keep_gathered`: every unit keeps its gathered parameters from forward until `_reshard_all` (after the
        optimizer step). For attention transfer whose backward needs the frozen weights (no teacher forcing:
        gradients cross the layers; gradient checkpointing: layers are recomputed): FSDP would re-gather them
        only through the same output hooks."""
        import torch.distributed as dist
        from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from ..architectures import get_adapter

        plugin = self.fsdp
        # every process must shard the same values; a LoRA adapter is initialised from each process's own RNG
        # stream (DDP broadcasts rank 0's module states at wrapping; fully_shard does not)
        with torch.no_grad():
            for p in root.parameters():
                if p.requires_grad:
                    dist.broadcast(p.data, src=0)
        units = {id(m) for m in get_adapter(self.model).decoder_layers(self.model)}
        policy = fsdp2_prepare_auto_wrap_policy(plugin, root) if plugin.auto_wrap_policy is not None else None
        mesh = init_device_mesh(self.accelerator.device.type, (self.world,))
        replicated = {p for _, p in method_parameters(self.model)}
        trained = {n for n, p in root.named_parameters() if id(p) in self.trained}
        reshard = bool(plugin.reshard_after_forward) and not keep_gathered
        for m in reversed(list(root.modules())):  # children before their parents
            if m is not root and (id(m) in units or (policy is not None and policy(m))):
                fully_shard(m, mesh=mesh, reshard_after_forward=reshard, ignored_params=replicated)
        fully_shard(root, mesh=mesh, ignored_params=replicated, **({"reshard_after_forward": False} if keep_gathered else {}))
        if keep_gathered:
            root.set_reshard_after_backward(False)
        # the parameters are new (sharded) objects now; keep the bookkeeping by identity
        self.trained = {id(p): p for n, p in root.named_parameters() if n in trained}
        return root

    @staticmethod
    def _reshard_all(root: nn.Module) -> None:
        """Frees every FSDP unit's gathered parameters. A unit left gathered (after a forward without backward,
        e.g. evaluation, the root unit keeps them; `keep_gathered`) has them as the module's parameters, and
        they go stale once the optimizer steps the shards."""
        from torch.distributed.fsdp import FSDPModule

        for m in root.modules():
            if isinstance(m, FSDPModule):
                m.reshard()

    def _average_replicated_grads(self, params: list[nn.Parameter]) -> None:
        """FSDP: the mean over processes of the gradients of the unsharded (method) parameters, as DDP takes it."""
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor

        groups: dict[tuple, list[torch.Tensor]] = {}
        for p in params:
            if p.grad is not None and not isinstance(p, DTensor):
                groups.setdefault((p.grad.dtype, p.grad.device), []).append(p.grad)
        for grads in groups.values():
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat)
            flat /= self.world
            for g, v in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(v.view_as(g))

