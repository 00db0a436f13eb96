"""The main job under ``--shard N``: the model sharded with FSDP2 over the N ranks of each replica,
the replicas (``workers / N`` of them) averaging over the optimizer's exchange (HSDP,
``onebitlamb.optim.sharding``). Everything the loop does with the parameters themselves goes
through here, so that the loop reads the same sharded or not.

Ranks ``r * N .. r * N + N - 1`` form replica ``r`` (a node, under torchrun with N ranks a node);
rank ``r * N + s`` holds shard ``s`` and exchanges with shard ``s`` of every other replica.
"""
from __future__ import annotations

import math
import types
from typing import Dict, Optional

import torch
import torch.distributed as dist

from onebitlamb.optim.sharding import is_sharded, local


class Sharding:
    """The mesh of a sharded run: ``replicate_group`` is the optimizer's process group,
    ``shard_group`` the ranks of this replica."""

    def __init__(self, world: int, shard: int, device: torch.device) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        self.mesh = init_device_mesh(device.type, (world // shard, shard), mesh_dim_names=("replicate", "shard"))
        self.replicate_group = self.mesh["replicate"].get_group()
        self.shard_group = self.mesh["shard"].get_group()

    def shard(self, model: torch.nn.Module) -> torch.nn.Module:
        """``fully_shard`` on each transformer layer, then on the rest (embeddings, the tied
        prediction head), over this replica's ranks: the model, its gradients and the optimizer's
        state are then ``1/N`` of the whole on each rank."""
        from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

        from onebitlamb.train.model import masked_lm_loss

        mesh = self.mesh["shard"]
        for layer in getattr(getattr(getattr(model, "bert", None), "encoder", None), "layer", []):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        # the loss runs the encoder and the head without the root's forward: FSDP must see it as one
        model.masked_lm_loss = types.MethodType(masked_lm_loss, model)
        register_fsdp_forward_method(model, "masked_lm_loss")
        return model


def local_tensors(named: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """``{name: this rank's shard}`` (each tensor itself when not sharded)."""
    return {k: local(v) for k, v in named.items()}


def saved_model(model: torch.nn.Module, whole: bool) -> Dict[str, torch.Tensor]:
    """The model's state dict as plain tensors: whole (``full_tensor``: a collective over the shard
    group, every rank calls it), or this rank's shards."""
    return {k: (v.full_tensor() if whole else v.to_local()) if is_sharded(v) else v
            for k, v in model.state_dict().items()}


def load_model(model: torch.nn.Module, state: Dict[str, torch.Tensor]) -> None:
    """``model.load_state_dict`` for a state of plain tensors: a sharded model takes this rank's
    shards (as ``saved_model(model, whole=False)`` wrote them) into its own."""
    if not any(is_sharded(v) for v in model.state_dict().values()):
        model.load_state_dict(state)
        return
    mine = model.state_dict()
    missing = sorted(set(mine) ^ set(state))
    if missing:
        raise ValueError(f"the saved model shards do not fit the model: {missing[:4]} differ")
    with torch.no_grad():
        for k, v in mine.items():
            local(v).copy_(state[k])


def clip_gradients(model: torch.nn.Module, max_norm: float, group: Optional[dist.ProcessGroup]) -> float:
    """``clip_grad_norm_`` over the replica's whole gradient, its shards' squared norms summed over
    ``group`` (one all-reduce inside the node); returns the norm. A gradient whose norm is not
    finite is left as it is, for the optimizer's agreed check to skip the step."""
    grads = [local(p.grad).detach() for p in model.parameters() if p.grad is not None]
    squares = torch.zeros(1, dtype=torch.float32)
    if grads:
        squares = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).reshape(1) ** 2
    dist.all_reduce(squares, group=group)
    norm = float(squares.sqrt())
    if not math.isfinite(norm):
        return math.inf
    coefficient = min(1.0, max_norm / (norm + 1e-6))
    for g in grads:
        g.mul_(coefficient)
    return norm
