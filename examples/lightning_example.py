"""1-bit LAMB under PyTorch Lightning: a small MLP on synthetic data, 2 CPU ranks.

    OMP_NUM_THREADS=1 python examples/lightning_example.py

Lightning's own launcher starts the second process. The one change to a Lightning script is
``strategy=OneBitDDPStrategy()`` in place of ``strategy="ddp"``: DDP then averages the warm-up's
gradients and sends nothing once the optimizer compresses, and the checkpoints hold every rank's
own compression errors. The run trains 4 epochs with a checkpoint at each epoch's end (the freeze
comes before the end of the second), then a second Trainer resumes from the one after epoch 2 and finishes the
run; both print the same checksum of the weights.
"""
import datetime
import os

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import onebitlamb
from onebitlamb.integrations.lightning import OneBitDDPStrategy

EPOCHS, RESUME_AFTER, DIM, CLASSES, SAMPLES, BATCH, RANKS = 4, 2, 32, 4, 640, 32, 2
STEPS = EPOCHS * SAMPLES // (BATCH * RANKS)
# the warm-up decides the freeze, before 45% of the run: before the checkpoint the second Trainer resumes
FREEZE = onebitlamb.AutoFreeze(total_steps=STEPS, max_fraction=0.45)
ROOT = os.path.join("runs", "lightning_example")


class Classifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(DIM, 64), torch.nn.GELU(), torch.nn.Linear(64, CLASSES))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return onebitlamb.OneBitLamb(self.parameters(), lr=3e-3, freeze_step=FREEZE)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        # Lightning gives each rank its share through a DistributedSampler
        g = torch.Generator().manual_seed(0)
        x = torch.randn(SAMPLES, DIM, generator=g)
        y = (x @ torch.randn(DIM, CLASSES, generator=g)).argmax(dim=1)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH, shuffle=True)


def trainer() -> pl.Trainer:
    # a checkpoint at each epoch's end, written over by a rerun or the resumed run
    saver = ModelCheckpoint(dirpath=ROOT, filename="{epoch}", save_top_k=-1, save_on_train_epoch_end=True,
                            enable_version_counter=False)
    return pl.Trainer(strategy=OneBitDDPStrategy(timeout=datetime.timedelta(seconds=120)), accelerator="cpu",
                      devices=RANKS, max_epochs=EPOCHS, callbacks=[saver], logger=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=ROOT)


def checksum(model: pl.LightningModule) -> float:
    return sum(float(p.detach().double().sum()) for p in model.parameters())


if __name__ == "__main__":
    torch.manual_seed(0)
    whole = Classifier()
    run = trainer()
    run.fit(whole)
    opt = run.optimizers[0]
    if run.is_global_zero:
        print(f"whole run: stage {opt.stage}, {opt.comm_stats.bytes_sent} bytes sent by rank 0, "
              f"checksum {checksum(whole):.10f}")

    resumed = Classifier()
    trainer().fit(resumed, ckpt_path=os.path.join(ROOT, f"epoch={RESUME_AFTER - 1}.ckpt"))
    if run.is_global_zero:
        print(f"resumed after epoch {RESUME_AFTER}: checksum {checksum(resumed):.10f}")
