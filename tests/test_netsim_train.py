"""The network benchmark's ``train`` job for the rows that time another kind of step than the
two-stage optimizers' (1-bit LAMB with the int8 warm-up, DiLoCo): on 2 gloo ranks on loopback, no
root needed, the kinds each row times and what the library accounted for each (the wire's own
counters: ``test_netsim_wire.py``, on emulated hosts)."""
import pytest
import torch.distributed as dist

from benchmarks.netsim import worker
from onebitlamb.comm import costmodel
from rank_pool import run_ranks

TINY = {"hidden": 32, "layers": 1, "heads": 2, "intermediate": 64}
SPEC = {"model": TINY, "batch": 2, "warmup_steps": 2, "compression_steps": 3, "skip_steps": 1}


def _train(rank: int, world: int, names) -> dict:
    alone = [dist.new_group([r]) for r in range(world)][rank]
    return {name: worker.train_one(name, SPEC, rank, dist.group.WORLD, None, alone) for name in names}


@pytest.fixture(scope="module")
def trained():
    return run_ranks(_train, 2, (["lamb", "onebitlamb-int8", "diloco"],), timeout_s=120)


def test_each_new_row_times_its_own_kinds(trained):
    for rank in trained:
        assert {k for k in rank["onebitlamb-int8"] if k in worker.KINDS} == {"warmup"}  # compression: 1-bit LAMB's
        assert {k for k in rank["diloco"] if k in worker.KINDS} == {"local", "sync"}
        assert len(rank["onebitlamb-int8"]["warmup"]["step_times"]) == SPEC["warmup_steps"]
        # DiLoCo's syncs are full-precision steps: as many as the warm-up's; its local steps as the compression's
        assert len(rank["diloco"]["sync"]["step_times"]) == SPEC["warmup_steps"]
        assert len(rank["diloco"]["local"]["step_times"]) == SPEC["compression_steps"]


def test_the_new_rows_send_what_their_steps_send(trained):
    d = trained[0]["lamb"]["params"]
    for rank in trained:
        lamb, int8, diloco = (rank[name] for name in ("lamb", "onebitlamb-int8", "diloco"))
        assert lamb["warmup"]["accounted_bytes_per_step"] == costmodel.lamb_collectives(d, 2)[0] == 4 * d
        # the int8 warm-up: the finite flag, an all-to-all and an all-gather of blockwise int8 codes,
        # the cost model's bytes give or take a block's padding per tensor
        predicted = sum(costmodel.warmup_collectives(d, 2, "int8"))
        assert predicted <= int8["warmup"]["accounted_bytes_per_step"] < 1.05 * predicted
        assert int8["warmup"]["accounted_bytes_per_step"] < lamb["warmup"]["accounted_bytes_per_step"] / 3.5
        # DiLoCo: a local step calls no collective; a sync is one float32 all-reduce of the parameters
        assert diloco["local"]["accounted_bytes_per_step"] == 0
        assert diloco["sync"]["accounted_bytes_per_step"] == 4 * d


def test_diloco_H_takes_no_sync_beyond_those_wanted():
    for syncs, local_steps in ((4, 9), (2, 2), (1, 5), (3, 1)):
        H = worker.diloco_H(syncs, local_steps)
        assert H >= 2 and (H - 1) * syncs >= local_steps
        assert (H - 2) * syncs < local_steps or H == 2  # one less would lack local steps
