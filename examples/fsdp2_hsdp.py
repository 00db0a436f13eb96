"""1-bit LAMB across the replicas of a model sharded with FSDP2 (HSDP): 2 replicas of 2 shards.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 4 examples/fsdp2_hsdp.py

On a real cluster each replica is a node (``--nnodes 2 --nproc_per_node 2``): FSDP's all-gathers
and reduce-scatters stay on the node's fast link, and all that crosses the slow one is each
shard's exchange with the same shard on the other nodes, which the optimizer sends in 1 bit
after the freeze. Two lines differ from plain FSDP2:

- ``fully_shard(..., mesh=mesh["shard"])``: each module sharded over the ranks of its node (FSDP2's
  own HSDP, on the whole 2-D mesh, would all-reduce every gradient across nodes in full precision);
- ``process_group=mesh["replicate"].get_group()``: the optimizer exchanges over the replicas.
"""
import datetime

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import onebitlamb

STEPS, DIM, CLASSES, SHARDS = 30, 32, 4, 2


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * step + rank)  # each rank its own share of the batch
    x = torch.randn(32, DIM, generator=g)
    y = (x @ torch.randn(DIM, CLASSES, generator=torch.Generator().manual_seed(0))).argmax(dim=1)
    return x, y


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world // SHARDS, SHARDS), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(DIM, 64), torch.nn.GELU(), torch.nn.Linear(64, CLASSES))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    opt = onebitlamb.OneBitLamb(model.parameters(), lr=1e-2, freeze_step=onebitlamb.AutoFreeze(total_steps=STEPS),
                                process_group=mesh["replicate"].get_group())
    for step in range(STEPS):
        stage, across, inside = opt.stage, opt.comm_stats.bytes_sent, opt.shard_comm_stats.bytes_sent
        opt.zero_grad()
        x, y = batch(step, rank)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if rank == 0 and (step % 10 == 0 or step + 1 == STEPS):
            print(f"step {step:3d}  {stage:11s}  loss {loss.item():.4f}  bytes across replicas "
                  f"{opt.comm_stats.bytes_sent - across}  inside the node {opt.shard_comm_stats.bytes_sent - inside}",
                  flush=True)
    whole = [p.full_tensor() for p in model.parameters()]  # every rank: the same whole model
    state = sum(t.numel() for t in opt.state["flat"].values() if isinstance(t, torch.Tensor))
    if rank == 0:
        print(f"parameters {sum(t.numel() for t in whole)}, optimizer state on this rank {state} values",
              flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
