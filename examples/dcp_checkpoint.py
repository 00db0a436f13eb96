"""1-bit LAMB checkpointed with torch.distributed.checkpoint (DCP), the way any optimizer is.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 examples/dcp_checkpoint.py

Trains past the freeze, saves model and optimizer with ``dcp.save``, trains on, then builds a new
model and optimizer, loads the checkpoint into them with ``dcp.load`` and trains the same steps
again: the two endings are the same bit for bit, because every rank's compression errors were
saved under their own names and came back to their own rank.
"""
import datetime
import os
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import onebitlamb

STEPS, SAVE_AT, DIM, CLASSES = 20, 10, 32, 4
# the warm-up decides the freeze, by 40% of the run at the latest: before the checkpoint
FREEZE = onebitlamb.AutoFreeze(total_steps=STEPS, max_fraction=0.4)


def train(model, opt, rank, steps) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(10_000 * step + rank)
        x = torch.randn(32, DIM, generator=g)
        y = (x @ torch.randn(DIM, CLASSES, generator=torch.Generator().manual_seed(0))).argmax(dim=1)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def build(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(DIM, 64), torch.nn.GELU(), torch.nn.Linear(64, CLASSES))
    return model, onebitlamb.OneBitLamb(model.parameters(), lr=1e-2, freeze_step=FREEZE)


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    folder = [tempfile.mkdtemp(prefix="dcp-example-") if rank == 0 else None]
    dist.broadcast_object_list(folder)  # one folder for every rank (one machine here)
    model, opt = build(0)
    train(model, opt, rank, range(SAVE_AT))
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=folder[0])
    train(model, opt, rank, range(SAVE_AT, STEPS))
    uninterrupted = [p.detach().clone() for p in model.parameters()]

    model, opt = build(1)  # another start: everything must come from the checkpoint
    model_sd, optim_sd = get_state_dict(model, opt)  # the template DCP loads into
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=folder[0])
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    train(model, opt, rank, range(SAVE_AT, STEPS))
    same = all(torch.equal(a, b) for a, b in zip(uninterrupted, model.parameters()))
    print(f"rank {rank}: stage {opt.stage}, resumed run equals the uninterrupted one: {same}", flush=True)
    dist.barrier()
    if rank == 0:
        for name in os.listdir(folder[0]):
            os.remove(os.path.join(folder[0], name))
        os.rmdir(folder[0])
    dist.destroy_process_group()
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
