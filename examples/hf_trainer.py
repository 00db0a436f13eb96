"""1-bit LAMB under the Hugging Face Trainer: a tiny BERT, masked-LM on synthetic tokens, 2 CPU ranks.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 examples/hf_trainer.py

``OneBitTrainer`` is the ``Trainer`` with the two things a 1-bit optimizer needs on several ranks:
the DDP model averages the warm-up and sends nothing after the freeze, and every rank saves (and
resumes) its own optimizer state. The run saves a checkpoint after the freeze, then a second
Trainer resumes from it and finishes the run.
"""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import BertConfig, BertForMaskedLM, TrainingArguments  # noqa: E402

import onebitlamb  # noqa: E402
from onebitlamb.integrations.transformers import OneBitTrainer  # noqa: E402

STEPS, VOCAB, SEQ = 60, 128, 16
# the warm-up decides the freeze, by 40% of the run at the latest: before the checkpoint at step 30
FREEZE = onebitlamb.AutoFreeze(total_steps=STEPS, max_fraction=0.4)


class RandomTokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 4096

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(i)
        # something to learn in a few dozen steps: 16 of the ids are used, and a masked one is its neighbours'
        ids = torch.randint(4, 20, (1,), generator=g).repeat(SEQ)
        labels = torch.full_like(ids, -100)
        masked = torch.rand(SEQ, generator=g) < 0.25
        labels[masked], ids[masked] = ids[masked], 3  # 3: the [MASK] id of this made-up vocabulary
        return {"input_ids": ids, "labels": labels}


def make_trainer(out: str) -> OneBitTrainer:
    args = TrainingArguments(out, max_steps=STEPS, per_device_train_batch_size=16, save_steps=30, logging_steps=10,
                             report_to="none", disable_tqdm=True, use_cpu=not torch.cuda.is_available(),
                             max_grad_norm=0.0, ddp_find_unused_parameters=False, seed=0)
    torch.manual_seed(0)  # the same initial model on every rank
    config = BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=128, max_position_embeddings=SEQ)
    model = BertForMaskedLM(config)
    opt = onebitlamb.OneBitLamb(model.parameters(), lr=1e-2, freeze_step=FREEZE)
    return OneBitTrainer(model=model, args=args, train_dataset=RandomTokens(), optimizers=(opt, None))


if __name__ == "__main__":
    out = os.path.join("runs", "hf_trainer_example")
    first = make_trainer(out)
    first.train()
    opt = first.onebit_optimizer()
    if first.args.process_index == 0:
        print(f"stage {opt.stage}, {opt.comm_stats.bytes_sent} bytes sent by rank 0 (DDP's warm-up all-reduce "
              f"and the 1-bit exchange)")
    # a fresh Trainer, as after a restart: each rank resumes its own compression errors
    resumed = make_trainer(out)
    resumed.train(resume_from_checkpoint=os.path.join(out, "checkpoint-30"))
    if resumed.args.process_index == 0:
        print(f"resumed from step 30 and finished at step {resumed.state.global_step}")
