"""The sharded benchmark's ``hsdp`` job on 4 gloo ranks on loopback (2 "hosts" of 2 ranks, no root
needed): each row's step kinds and what the optimizer accounted across the hosts and inside one,
against the collectives' own formulas; and the section it writes from them (the wire's counters
need emulated hosts: ``sudo python -m benchmarks.sharded``)."""
import os

import onebitlamb
from benchmarks import sharded
from benchmarks.netsim import worker
from onebitlamb.comm.launch import spawn_local

TINY = {"hidden": 32, "layers": 1, "heads": 2, "intermediate": 64}
SPEC = {"model": TINY, "batch": 2, "warmup_steps": 2, "compression_steps": 2, "skip_steps": 1, "hsdp": sharded.ROWS}


def _rows(rank: int, world: int) -> dict:
    import torch.distributed as dist

    os.environ["LOCAL_WORLD_SIZE"] = "2"  # what the runner sets: 2 ranks a host
    solo = [dist.new_group([r]) for r in range(world)][rank]
    return {"rank": rank, "hsdp": worker.hsdp_rows(rank, world, SPEC, None, solo)}


def test_hsdp_rows_account_each_shards_exchange_and_the_section_reads_them():
    ranks = spawn_local(_rows, 4, (), timeout_s=240, collective_timeout_s=120)
    rows = ranks[0]["hsdp"]
    assert set(rows) == {"lamb-hsdp", "onebitlamb-hsdp", "onebitlamb-int8-hsdp", "lamb-fsdp"}
    assert set(rows["onebitlamb-hsdp"]) >= {"warmup", "compression"} and "compression" not in rows["lamb-hsdp"]
    d = rows["lamb-hsdp"]["params"]
    local = (d + 1) // 2  # about half the model a rank (each tensor cut in two along its first dimension)
    lamb = rows["lamb-hsdp"]["warmup"]["accounted_bytes_per_step"]
    assert abs(lamb - 4 * local) < 0.02 * 4 * local  # a float32 ring all-reduce over 2 replicas: 4 bytes an element
    onebit = rows["onebitlamb-hsdp"]["compression"]["accounted_bytes_per_step"]
    assert onebit >= onebitlamb.padded_size(local, 2) // 8 and lamb / onebit > 25
    assert rows["lamb-fsdp"]["warmup"]["accounted_bytes_per_step"] == 0  # no replicas: FSDP's traffic only
    assert rows["onebitlamb-hsdp"]["compression"]["node_accounted_bytes_per_step"] > 0
    for r in ranks:  # the wire's counters are 0 on loopback; the section is still written from the rest
        for row in r["hsdp"].values():
            for kind in ("warmup", "compression"):
                if kind in row:
                    row[kind]["wire_bytes_per_step"] = 1000.0 if kind == "warmup" else 100.0
    text = sharded.section(sharded.summarise([{"rate_bps": 1e7, "ranks": ranks}]), {"warmup": 100, "compression": 412},
                           "python -m benchmarks.sharded")
    assert "10.0x fewer bytes across the slow link" in text and "LAMB's time over 1-bit LAMB's" in text
