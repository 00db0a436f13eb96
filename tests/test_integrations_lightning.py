"""OneBitDDPStrategy under real Lightning on 2 gloo ranks: DDP averages the warm-up through the
hook and sends nothing after the freeze, a checkpoint taken after the freeze holds both ranks'
compression errors, and a fresh Trainer resumed from it ends where the uninterrupted run ends."""
from __future__ import annotations

import os
import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint

import onebitlamb
from onebitlamb.comm.launch import spawn_local
from onebitlamb.integrations.lightning import RANK_STATES, OneBitDDPStrategy

STEPS, FREEZE, SAVE_AT = 8, 3, 5


class _Net(pl.LightningModule):
    """Each step's batch depends on the step and the rank only, so a resumed run sees the batches
    the uninterrupted one saw, whatever Lightning does with a dataloader resumed mid-epoch."""

    def __init__(self, opt_kind: str = "OneBitLamb") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
        self.opt_kind = opt_kind
        self.backward_calls = []  # per step: (stage, all_reduce calls made from Python in the backward)
        self._real_all_reduce = dist.all_reduce
        self._calls = 0

    def training_step(self, batch, batch_idx):
        g = torch.Generator().manual_seed(1000 * self.global_step + self.global_rank)
        x, y = torch.randn(32, 8, generator=g), torch.randint(0, 3, (32,), generator=g)
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def on_before_backward(self, loss):
        def counting(*args, **kw):
            self._calls += 1
            return self._real_all_reduce(*args, **kw)

        self._calls, dist.all_reduce = 0, counting

    def on_after_backward(self):
        dist.all_reduce = self._real_all_reduce
        self.backward_calls.append((self.trainer.optimizers[0].stage, self._calls))

    def configure_optimizers(self):
        if self.opt_kind == "SGD":
            return torch.optim.SGD(self.parameters(), lr=0.1)
        if self.opt_kind == "partial":  # the last layer's bias left out
            return onebitlamb.OneBitLamb(list(self.net.parameters())[:-1], lr=0.02, freeze_step=FREEZE)
        return onebitlamb.OneBitLamb(self.parameters(), lr=0.02, freeze_step=FREEZE)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(range(1000), batch_size=1)


def _trainer(root: str, max_steps: int, callbacks=()) -> pl.Trainer:
    return pl.Trainer(strategy=OneBitDDPStrategy(), accelerator="cpu", devices=2, max_steps=max_steps,
                      logger=False, enable_progress_bar=False, enable_model_summary=False,
                      enable_checkpointing=bool(callbacks), callbacks=list(callbacks), default_root_dir=root)


def _run(rank, n, root):
    # the process group is spawn_local's (its timeout bounds every collective); LOCAL_RANK tells
    # Lightning's default cluster environment that the processes were started for it
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")
    warnings.filterwarnings("ignore")  # mid-epoch resume, few dataloader workers: beside the point here
    misuse = {}
    for kind in ("SGD", "partial"):
        try:
            _trainer(os.path.join(root, kind), 1).fit(_Net(kind))
        except ValueError as exc:
            misuse[kind] = str(exc)

    whole = _Net()
    saver = ModelCheckpoint(dirpath=os.path.join(root, "ckpt"), filename="at-{step}", every_n_train_steps=SAVE_AT,
                            save_top_k=-1)
    _trainer(os.path.join(root, "whole"), STEPS, [saver]).fit(whole)
    ckpt = os.path.join(root, "ckpt", f"at-step={SAVE_AT}.ckpt")
    resumed = _Net()
    _trainer(os.path.join(root, "resumed"), STEPS).fit(resumed, ckpt_path=ckpt)
    params = lambda m: [p.detach().clone() for p in m.parameters()]  # noqa: E731
    return {"misuse": misuse, "whole": params(whole), "resumed": params(resumed), "ckpt": ckpt,
            "whole_calls": whole.backward_calls, "resumed_calls": resumed.backward_calls}


def test_lightning_hook_silences_ddp_after_the_freeze_and_resume_is_exact(tmp_path):
    out = spawn_local(_run, 2, (str(tmp_path),), timeout_s=150, collective_timeout_s=60)
    for rank in out:
        assert "one onebitlamb optimizer (OneBitLamb, OneBitAdam or Lamb) and no other, got ['SGD']" in \
            rank["misuse"]["SGD"]
        assert "trainable parameters are not OneBitLamb's (net.2.bias)" in rank["misuse"]["partial"]
        # (a) warm-up: DDP averaged through the hook (its built-in all-reduce is C++, uncounted);
        # after the freeze DDP sends nothing
        stages = [stage for stage, _ in rank["whole_calls"]]
        assert stages == ["warmup"] * FREEZE + ["compression"] * (STEPS - FREEZE)
        assert all(calls >= 1 for stage, calls in rank["whole_calls"] if stage == "warmup")
        assert [calls for stage, calls in rank["whole_calls"] if stage == "compression"] == [0] * (STEPS - FREEZE)
        assert rank["resumed_calls"] == [("compression", 0)] * (STEPS - SAVE_AT)
        # (b) the resumed run continues the uninterrupted one exactly
        assert all(torch.equal(a, b) for a, b in zip(rank["whole"], rank["resumed"]))
    assert all(torch.equal(a, b) for a, b in zip(out[0]["whole"], out[1]["whole"]))
    assert not all(torch.equal(a, b) for a, b in zip(out[0]["whole"], _Net().parameters()))  # it trained

    # the one file holds both ranks' states, taken after the freeze (so their compression errors
    # differ); the entry itself is rank 0's, as a plain DDPStrategy would have written it
    entry = torch.load(out[0]["ckpt"], weights_only=False)["optimizer_states"][0]
    ranks = [_tensors(sd) for sd in entry[RANK_STATES]]
    assert len(ranks) == 2 and len(ranks[0]) == len(ranks[1])
    assert not all(torch.equal(a, b) for a, b in zip(*ranks))
    assert all(torch.equal(a, b) for a, b in zip(_tensors({k: v for k, v in entry.items() if k != RANK_STATES}),
                                                 ranks[0]))


def _tensors(obj) -> list:
    """Every tensor in a state dict, in key order: the comparison needs no knowledge of its layout."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for k in sorted(obj, key=str) for t in _tensors(obj[k])]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []

def test_the_strategy_refuses_a_comm_hook_of_its_own():
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    with pytest.raises(ValueError, match="registers its own DDP comm hook .* does not take ddp_comm_hook"):
        OneBitDDPStrategy(ddp_comm_hook=default_hooks.fp16_compress_hook)
