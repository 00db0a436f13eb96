"""1-bit LAMB under Hugging Face accelerate: a small MLP on synthetic data, 2 CPU ranks.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 examples/accelerate_example.py
    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 examples/accelerate_example.py --resume

The one change to an accelerate script is ``prepare(accelerator, ...)`` from
``onebitlamb.integrations.accelerate`` in place of ``accelerator.prepare(...)``: DDP then averages
the warm-up's gradients and sends nothing once the optimizer compresses, and
``save_state``/``load_state`` keep every rank's own compression errors.
The first command saves a checkpoint after the freeze and trains on; the second resumes from it
and prints the same final checksum.
"""
import argparse
import datetime
import os

import torch
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs

import onebitlamb
from onebitlamb.integrations.accelerate import prepare

STEPS, SAVE_AT, DIM, CLASSES = 40, 25, 32, 4
# the warm-up decides the freeze, by half the run at the latest: before the checkpoint
FREEZE = onebitlamb.AutoFreeze(total_steps=STEPS, max_fraction=0.5)
CHECKPOINT = os.path.join("runs", "accelerate_example")


def batch(step: int, rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    # each rank its own share, the same on a resumed run (a real script passes its DataLoader to prepare)
    g = torch.Generator().manual_seed(10_000 * step + rank)
    x = torch.randn(64, DIM, generator=g)
    teacher = torch.Generator().manual_seed(0)
    y = (x @ torch.randn(DIM, CLASSES, generator=teacher)).argmax(dim=1)
    return x.to(device), y.to(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--resume", action="store_true", help=f"continue from {CHECKPOINT} (step {SAVE_AT})")
    resume = parser.parse_args().resume
    # every collective gives up after 2 minutes instead of hanging on a lost rank
    accelerator = Accelerator(cpu=not torch.cuda.is_available(),
                              kwargs_handlers=[InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=120))])
    torch.manual_seed(0)  # the same initial model on every rank
    model = torch.nn.Sequential(torch.nn.Linear(DIM, 64), torch.nn.GELU(), torch.nn.Linear(64, CLASSES))
    optimizer = onebitlamb.OneBitLamb(model.parameters(), lr=1e-2, freeze_step=FREEZE)
    model, optimizer = prepare(accelerator, model, optimizer)
    start = 0
    if resume:
        accelerator.load_state(CHECKPOINT)  # every rank gets back its own compression errors
        start = SAVE_AT
    stats = optimizer.optimizer.comm_stats  # the onebitlamb optimizer inside accelerate's wrapper
    for step in range(start, STEPS):
        stage, sent = optimizer.optimizer.stage, stats.bytes_sent
        x, y = batch(step, accelerator.process_index, accelerator.device)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if step + 1 == SAVE_AT and not resume:
            accelerator.save_state(CHECKPOINT)  # on every rank
        if step % 10 == 0 or step + 1 == STEPS:
            accelerator.print(f"step {step:3d}  {stage:11s}  loss {loss.item():.4f}  "
                              f"bytes sent this step {stats.bytes_sent - sent}")
    checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
    accelerator.print(f"final parameter checksum {checksum:.12f}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
