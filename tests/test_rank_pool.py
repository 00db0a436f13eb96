"""The persistent ranks of tests/rank_pool.py keep spawn_local's contract: results in rank order, a
worker's exception with its rank, a timeout instead of a hang, a fresh pool after any failure, and
no state carried from one call into the next."""
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from onebitlamb.comm.launch import WorkerError
from rank_pool import pool, run_ranks


@pytest.fixture(autouse=True)
def _the_pool(monkeypatch):
    monkeypatch.delenv("ONEBITLAMB_TEST_FRESH_RANKS", raising=False)  # these tests are the pool's


def _sum_of_ranks(rank, n, extra):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return rank, n, dist.get_rank(), dist.get_world_size(), t.item() + extra, os.getpid()


def _leave_a_mess(rank, n):
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    os.environ["RANK_POOL_LEFTOVER"] = "1"
    del os.environ["OMP_NUM_THREADS"]
    os.chdir("/")
    torch.set_num_threads(2)
    dist.new_group([0, 1])
    import warnings
    warnings.simplefilter("error")
    from onebitlamb.comm import GLOBAL_STATS
    GLOBAL_STATS.record("all_reduce", 10)
    return torch.initial_seed()


def _state(rank, n):
    from onebitlamb.comm import GLOBAL_STATS
    import warnings
    from torch.distributed import distributed_c10d as c10d
    return dict(dtype=torch.get_default_dtype(), seed=torch.initial_seed(),
                leftover=os.environ.get("RANK_POOL_LEFTOVER"), omp=os.environ.get("OMP_NUM_THREADS"),
                cwd=os.getcwd(), threads=torch.get_num_threads(),
                groups=len(c10d._world.pg_map), stats=GLOBAL_STATS.calls,
                error_filter=any(f[0] == "error" for f in warnings.filters))


def test_results_come_in_rank_order_from_the_same_processes_and_each_call_starts_clean():
    first = run_ranks(_sum_of_ranks, 2, (0.5,))
    assert [r[:5] for r in first] == [(0, 2, 0, 2, 1.5), (1, 2, 1, 2, 1.5)]
    seeds = run_ranks(_leave_a_mess, 2)
    again = run_ranks(_sum_of_ranks, 2, (0.0,))
    assert [r[5] for r in again] == [r[5] for r in first]  # reused, not respawned
    for state in run_ranks(_state, 2):
        assert state["dtype"] == torch.float32 and state["seed"] not in seeds
        assert state["leftover"] is None and state["omp"] == os.environ["OMP_NUM_THREADS"]
        assert state["cwd"] == os.getcwd() and state["threads"] == 1
        assert state["groups"] == 1 and state["stats"] == 0 and not state["error_filter"]


def _raise_on(rank, n, bad):
    if rank == bad:
        raise ValueError(f"planted failure on rank {rank}")
    dist.barrier()  # blocked until the failed rank is gone or the collective times out
    return rank


def _sleep(rank, n, seconds):
    time.sleep(seconds)
    return rank


def _kill_myself(rank, n):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)


def test_an_exception_comes_back_with_its_rank_and_the_next_call_gets_a_fresh_pool():
    run_ranks(_sum_of_ranks, 2, (0.0,))
    before = pool(2).pids()
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"rank 1:\n(.|\n)*ValueError: planted failure on rank 1") as info:
        run_ranks(_raise_on, 2, (1,), timeout_s=60)
    assert time.monotonic() - start < 30 and not info.value.killed
    assert not pool(2).procs  # torn down
    out = run_ranks(_sum_of_ranks, 2, (0.0,))
    assert [r[4] for r in out] == [1.0, 1.0]
    assert not set(r[5] for r in out) & set(before)


def test_a_call_past_its_timeout_raises_instead_of_hanging_and_the_pool_recovers():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="did not finish within 2s"):
        run_ranks(_sleep, 2, (60,), timeout_s=2)
    assert time.monotonic() - start < 20
    assert run_ranks(_sleep, 2, (0,)) == [0, 1]


def test_a_collective_past_the_calls_collective_timeout_raises_on_the_waiting_rank():
    start = time.monotonic()
    with pytest.raises(WorkerError, match="rank 1:"):
        run_ranks(_late_barrier, 2, (), timeout_s=60, collective_timeout_s=2)
    assert time.monotonic() - start < 30


def _late_barrier(rank, n):
    if rank == 0:
        time.sleep(30)
    dist.barrier()


def test_a_rank_killed_by_a_signal_is_named_and_the_pool_recovers():
    with pytest.raises(WorkerError, match="rank 1 .*killed by signal SIGKILL") as info:
        run_ranks(_kill_myself, 2, (), timeout_s=60)
    assert info.value.killed
    assert run_ranks(_sleep, 2, (0,)) == [0, 1]
