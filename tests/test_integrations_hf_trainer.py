"""OneBitTrainer: the real transformers Trainer on 2 gloo ranks. After the freeze DDP sends nothing,
every rank resumes its own compression errors (bit for bit the uninterrupted run), and the plain
Trainer with a 1-bit optimizer is stopped at its first step."""
from __future__ import annotations

import copy
import os

import pytest
import torch

from onebitlamb.comm.launch import spawn_local
from onebitlamb.integrations.rank_files import rank_state_file

pytest.importorskip("transformers")

STEPS, FREEZE, SAVE = 8, 3, 4  # the checkpoint at step 4 is one compression step past the freeze
VOCAB, SEQ = 32, 8


class _Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 512

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(4, VOCAB, (SEQ,), generator=g)
        labels = torch.where(torch.rand(SEQ, generator=g) < 0.3, ids, torch.full_like(ids, -100))
        return {"input_ids": ids, "labels": labels}


def _trainer(out: str, cls, *, save: bool, optimizer: bool = True):
    from transformers import BertConfig, BertForMaskedLM, TrainingArguments

    import onebitlamb

    args = TrainingArguments(out, max_steps=STEPS, per_device_train_batch_size=4,
                             save_strategy="steps" if save else "no", save_steps=SAVE, report_to="none",
                             disable_tqdm=True, use_cpu=True, ddp_find_unused_parameters=False, seed=0,
                             logging_steps=1000, dataloader_num_workers=0)
    torch.manual_seed(0)  # the same start on every rank
    # no dropout: exactness of the resume is the optimizer's business here, not the Trainer's RNG replay
    config = BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    model = BertForMaskedLM(config)
    opt = onebitlamb.OneBitLamb(model.parameters(), lr=0.02, freeze_step=FREEZE) if optimizer else None
    return cls(model=model, args=args, train_dataset=_Tokens(), optimizers=(opt, None))


def _counting(base):
    """``base`` with each training step's (stage, torch.distributed.all_reduce calls during its
    forward and backward, bytes the optimizer recorded for the step) kept in ``per_step``."""
    import torch.distributed as dist

    class Counting(base):
        per_step: list

        def training_step(self, model, *args, **kwargs):
            opt = self.onebit_optimizer()
            stage, calls, real = opt.stage, [0], dist.all_reduce

            def counting(*a, **kw):
                calls[0] += 1
                return real(*a, **kw)

            dist.all_reduce = counting
            try:
                loss = super().training_step(model, *args, **kwargs)
            finally:
                dist.all_reduce = real
            self.per_step = getattr(self, "per_step", []) + [(stage, calls[0], opt.comm_stats.bytes_sent)]
            return loss

    return Counting


def _same(a, b) -> bool:
    """Nested dicts, lists and tensors, equal bit for bit."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    return a == b


def _params(trainer) -> list:
    return [p.detach().clone() for p in trainer.model.parameters()]


def _run(rank: int, n: int, out: str) -> dict:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(n), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(n),
                      HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    from transformers import Trainer

    from onebitlamb.integrations.transformers import OneBitTrainer

    got = {}
    uninterrupted = _trainer(os.path.join(out, "uninterrupted"), _counting(OneBitTrainer), save=False)
    uninterrupted.train()
    got["uninterrupted"] = _params(uninterrupted)
    got["per_step"] = uninterrupted.per_step

    saving = _trainer(os.path.join(out, "saving"), OneBitTrainer, save=True)
    saving.train()
    got["saving"] = _params(saving)

    resumed = _trainer(os.path.join(out, "saving"), _counting(OneBitTrainer), save=False)
    loaded = {}
    real_load = resumed._load_optimizer_and_scheduler

    def spy(checkpoint):
        real_load(checkpoint)
        loaded.update(copy.deepcopy(resumed.onebit_optimizer().state_dict()))  # not the live tensors

    resumed._load_optimizer_and_scheduler = spy
    resumed.train(resume_from_checkpoint=os.path.join(out, "saving", f"checkpoint-{SAVE}"))
    got["resumed"], got["loaded"], got["resumed_steps"] = _params(resumed), loaded, resumed.per_step

    for name, make in (("plain", lambda: _trainer(os.path.join(out, "plain"), Trainer, save=False)),
                       ("no optimizer", lambda: _trainer(os.path.join(out, "none"), OneBitTrainer, save=False,
                                                         optimizer=False))):
        try:
            make().train()
            got[name] = None
        except ValueError as exc:
            got[name] = str(exc)
    return got


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("hf_trainer"))
    return out, spawn_local(_run, 2, (out,), timeout_s=240, collective_timeout_s=60)


def test_ddp_averages_the_warmup_and_sends_nothing_after_the_freeze(ranks):
    _, got = ranks
    for r in got:
        stages = [stage for stage, _, _ in r["per_step"]]
        assert stages == ["warmup"] * FREEZE + ["compression"] * (STEPS - FREEZE)
        assert all(calls >= 1 for stage, calls, _ in r["per_step"] if stage == "warmup")  # through the hook
        assert all(calls == 0 for stage, calls, _ in r["per_step"] if stage == "compression")
        assert all(calls == 0 for stage, calls, _ in r["resumed_steps"])
        # bytes the optimizer counted between two steps' backward passes: DDP's full all-reduce in the
        # warm-up, then only the 1-bit exchange (about 1/32 of it)
        totals = [0] + [total for _, _, total in r["per_step"]]
        sent = [b - a for a, b in zip(totals, totals[1:])]
        assert 16 * max(sent[FREEZE:]) < min(sent[:FREEZE])
    assert all(torch.equal(a, b) for a, b in zip(got[0]["uninterrupted"], got[1]["uninterrupted"]))


def test_every_rank_resumes_its_own_state_exactly(ranks):
    out, got = ranks
    folder = os.path.join(out, "saving", f"checkpoint-{SAVE}")
    saved = [torch.load(rank_state_file(folder, r, 2), weights_only=True) for r in range(2)]
    for r, state in enumerate(saved):  # each file says where it belongs: step (taken + skipped) and set
        assert state.pop("onebitlamb_rank_file") == {"steps": SAVE, "rank": r, "world": 2}
    # the compression errors make the ranks' states differ: rank 0's (the Trainer's optimizer.pt) is wrong on 1
    assert not _same(saved[0], saved[1])
    for rank, r in enumerate(got):
        assert _same(r["loaded"], saved[rank])  # after the Trainer's load, each rank holds what it saved
        assert all(torch.equal(a, b) for a, b in zip(r["uninterrupted"], r["saving"]))  # saving changes nothing
        assert all(torch.equal(a, b) for a, b in zip(r["uninterrupted"], r["resumed"]))
    assert all(torch.equal(a, b) for a, b in zip(got[0]["resumed"], got[1]["resumed"]))


def test_misuse_fails_loudly(ranks):
    _, got = ranks
    for r in got:
        assert "onebitlamb.register_ddp(ddp_model, optimizer)" in r["plain"]
        assert "OneBitTrainer needs a onebitlamb optimizer" in r["no optimizer"] and "AdamW" in r["no optimizer"]
