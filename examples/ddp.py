"""1-bit LAMB with a model wrapped in DistributedDataParallel: a small MLP on synthetic data.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 examples/ddp.py

``onebitlamb.register_ddp(ddp_model, optimizer)`` is the one line a DDP script adds: DDP's
bucketed all-reduce averages the warm-up's gradients (the optimizer does not average them again)
and sends nothing once the optimizer compresses. Gradient accumulation uses DDP's ``no_sync()``
for every micro-batch but the last, as with any optimizer.
"""
import contextlib
import datetime

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import onebitlamb

STEPS, MICRO_BATCHES, DIM, CLASSES = 30, 2, 32, 4


def batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)  # each rank its own share
    x = torch.randn(32, DIM, generator=g)
    y = (x @ torch.randn(DIM, CLASSES, generator=torch.Generator().manual_seed(0))).argmax(dim=1)
    return x, y


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(DIM, 64), torch.nn.GELU(), torch.nn.Linear(64, CLASSES)))
    opt = onebitlamb.OneBitLamb(model.parameters(), lr=1e-2, freeze_step=onebitlamb.AutoFreeze(total_steps=STEPS))
    onebitlamb.register_ddp(model, opt)
    for step in range(STEPS):
        stage, sent = opt.stage, opt.comm_stats.bytes_sent
        opt.zero_grad()
        for micro in range(MICRO_BATCHES):
            x, y = batch(step, micro, rank)
            last = micro == MICRO_BATCHES - 1
            with contextlib.nullcontext() if last else model.no_sync():  # DDP reads no_sync at the forward
                loss = torch.nn.functional.cross_entropy(model(x), y) / MICRO_BATCHES
                loss.backward()
        opt.step()
        if rank == 0 and (step % 10 == 0 or step + 1 == STEPS):
            print(f"step {step:3d}  {stage:11s}  loss {loss.item() * MICRO_BATCHES:.4f}  "
                  f"bytes sent this step {opt.comm_stats.bytes_sent - sent}", flush=True)
    # DDP's reducer goes before the group it uses: torn down the other way round (or left to the
    # interpreter's exit) gloo hung or aborted one rank now and then
    del model, opt
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
