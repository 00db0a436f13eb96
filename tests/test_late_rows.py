"""Elements born after the freeze (docs/algorithm.md, "Elements born after the freeze"): rows of an
embedding whose ids first appear in stage 2, on 2 real gloo ranks, against the independent
reference (tests/reference.py), bit for bit on every rank, through a checkpoint; a row no rank ever
meets (a padding row) stays where it was."""
from __future__ import annotations

import functools

import pytest
import torch

import onebitlamb
from rank_pool import run_ranks
from reference import Reference, ZeroOneRescaledReference
from toy import initial_params, grads_for, through_a_checkpoint

ROWS, DIM = 12, 4
FREEZE, STEPS = 8, 22
# the step at which each late row is first met, and the rank that meets it (None: both)
BIRTHS = {6: (11, 0), 7: (11, None), 8: (13, 1), 9: (16, None), 10: (19, 1)}
PADDING = 11  # never met
LRS = [0.02, 0.01, 0.05]
WDS = [0.01, 0.0, 0.0]


def _init():
    g = torch.Generator().manual_seed(3)
    return initial_params()[:2] + [torch.randn(ROWS, DIM, generator=g)]


def _grads(params, rank: int, step: int):
    """The toy's gradients for the first two layers; for the table, rows met at this step: every
    early row on every rank, a late row from its birth on (by one rank at its birth), and then on
    alternate steps, as a rare id is."""
    dense = grads_for(params[:2], rank, step)
    g = torch.Generator().manual_seed(7000 + 100 * step + rank)
    table = params[2].detach() - 0.5 + torch.randn(ROWS, DIM, generator=g)
    met = torch.zeros(ROWS, 1)
    met[:6] = 1.0
    for row, (born, by) in BIRTHS.items():
        if step == born and by in (None, rank) or step > born and (step - born) % 2 == 0:
            met[row] = 1.0
    return dense + [table * met]


def _made(kind, options, init):
    """The parameters ``init`` and an optimizer ``onebitlamb.<kind>`` over them, one group a layer."""
    params = [torch.nn.Parameter(t.clone()) for t in init]
    groups = [{"params": [p], "lr": lr, "weight_decay": wd} for p, lr, wd in zip(params, LRS, WDS)]
    return params, getattr(onebitlamb, kind)(groups, lr=LRS[0], **options)


def _step(params, opt, rank, t):
    for p, g in zip(params, _grads(params, rank, t)):
        p.grad = g
    opt.step()


def _run(rank, n, kind, options, resume_at):
    """Each rank: the run's parameters after every step (with whether the ranks agree then), the
    runs stopped after each ``resume_at`` step and finished through a checkpoint, and the final
    counts of waiting and born elements."""
    fresh = functools.partial(_made, kind, options)

    def run(params, opt, start, stop):
        history = []
        for t in range(start, stop + 1):
            _step(params, opt, rank, t)
            history.append(([p.detach().clone() for p in params], opt.parameters_synchronized))
        return history

    params, opt = fresh(_init())
    history = run(params, opt, 1, STEPS)
    stats = opt.stats()
    resumed = {}
    for stop in resume_at:
        params, opt = fresh(_init())
        run(params, opt, 1, stop)
        params, opt = through_a_checkpoint(params, opt, fresh)
        resumed[stop] = run(params, opt, stop + 1, STEPS)[-1][0]
    return {"history": [h for h, _ in history], "synchronized": [s for _, s in history], "resumed": resumed,
            "counts": (stats["elements_waiting"], stats["elements_born_after_freeze"])}


CASES = [("OneBitLamb", "onebitlamb", dict(compression_space="update", trust_ratio_after_freeze="frozen")),
         ("OneBitLamb", "onebitlamb", dict(compression_space="momentum", trust_ratio_after_freeze="frozen",
                                           bound_direction=False)),
         ("OneBitLamb", "onebitlamb", dict(compression_space="update", trust_ratio_after_freeze="live")),
         ("OneBitAdam", "onebitadam", dict())]


@pytest.mark.parametrize("kind,ref_kind,options", CASES, ids=["update-frozen", "momentum-unbounded", "live", "adam"])
def test_rows_born_after_the_freeze_learn_as_the_reference_says(kind, ref_kind, options):
    n = 2
    out = run_ranks(_run, n, (kind, {"freeze_step": FREEZE, **options}, (12, 15)), timeout_s=180)
    for t in range(STEPS):
        for a, b in zip(out[0]["history"][t], out[1]["history"][t]):
            assert torch.equal(a, b), f"rank 1 differs from rank 0 at step {t + 1}"
    for stop, final in out[0]["resumed"].items():
        for a, b in zip(final, out[0]["history"][-1]):
            assert torch.equal(a, b), f"resumed after step {stop}"
    defaults = {"OneBitLamb": dict(compression_space="update", bound_direction=True),
                "OneBitAdam": dict(compression_space="momentum", bound_direction=True)}[kind]
    ref = Reference(_init(), ref_kind, LRS, WDS, freeze_step=FREEZE, n=n, **{**defaults, **options})
    init_table = _init()[2]
    for t in range(1, STEPS + 1):
        ref.step([_grads(ref.x, r, t) for r in range(n)])
        for layer, (a, x) in enumerate(zip(out[0]["history"][t - 1], ref.x)):
            assert float((a - x).norm() / x.norm()) < 1e-5, f"layer {layer}, step {t}"
    final = out[0]["history"][-1][2]
    # each late row moved from its start, as under LAMB; the padding row did not move at all
    for row in BIRTHS:
        assert float((final[row] - init_table[row]).norm()) > 1e-3, f"row {row} never moved"
    assert torch.equal(final[PADDING], init_table[PADDING])


ZERO_ONE = dict(var_freeze_step=FREEZE, var_update_scaler=2, local_step_scaler=4, local_step_clipper=4)


@pytest.mark.parametrize("space", ["update", "momentum"])
def test_zero_one_adams_rows_born_after_its_freeze_learn_as_the_reference_says(space):
    """0/1 Adam: a row first met after the variance froze, at a local step or a sync, takes the
    ranks' mean squared gradient of that step as its variance and learns from then on, as the
    reference says; the ranks agree at every sync, resumed runs are the run bit for bit."""
    n = 2
    options = dict(compression_space=space, bound_direction=False, **ZERO_ONE)  # the reference is unbounded
    out = run_ranks(_run, n, ("ZeroOneAdam", options, (12, 15)), timeout_s=180)
    syncs = 0
    for t in range(STEPS):
        if out[0]["synchronized"][t]:
            syncs += t + 1 > FREEZE
            for a, b in zip(out[0]["history"][t], out[1]["history"][t]):
                assert torch.equal(a, b), f"rank 1 differs from rank 0 after the sync of step {t + 1}"
    assert syncs >= 3
    for rank in range(n):
        for stop, final in out[rank]["resumed"].items():
            for a, b in zip(final, out[rank]["history"][-1]):
                assert torch.equal(a, b), f"rank {rank} resumed after step {stop}"
    ref = ZeroOneRescaledReference(_init(), LRS, WDS, n=n, compression_space=space, **ZERO_ONE)
    for t in range(1, STEPS + 1):
        ref.step([_grads(ref.x[r], r, t) for r in range(n)])
        for rank in range(n):
            for layer, (a, x) in enumerate(zip(out[rank]["history"][t - 1], ref.x[rank])):
                assert float((a - x).norm() / x.norm()) < 1e-5, f"rank {rank}, layer {layer}, step {t}"
    init_table, final = _init()[2], out[0]["history"][-1][2]
    for row in BIRTHS:
        assert float((final[row] - init_table[row]).norm()) > 1e-3, f"row {row} never moved"
    assert torch.equal(final[PADDING], init_table[PADDING])
    assert out[0]["counts"] == out[1]["counts"] == (DIM, DIM * len(BIRTHS))  # the padding row waits


def _counts(rank, n):
    params = [torch.nn.Parameter(t.clone()) for t in _init()]
    opt = onebitlamb.OneBitLamb(params, lr=0.01, freeze_step=FREEZE)
    seen = []
    for t in range(1, STEPS + 1):
        _step(params, opt, rank, t)
        stats = opt.stats()
        seen.append((stats["elements_waiting"], stats["elements_born_after_freeze"]))
    return seen


def test_stats_count_the_waiting_and_the_born_elements():
    """``stats()`` says how many elements wait for their first gradient and how many were born
    after the freeze: counted here from the schedule of births the data follows."""
    seen = run_ranks(_counts, 2, (), timeout_s=120)[0]
    assert seen[FREEZE - 2] == (None, None)  # before the freeze
    for t in range(FREEZE, STEPS + 1):
        born = sum(DIM for born, _ in BIRTHS.values() if born <= t)
        assert seen[t - 1] == (DIM * (len(BIRTHS) + 1) - born, born), f"after step {t}"


def _embedding_run(rank, n, overlap):
    """An embedding whose ids 5-7 first appear after the freeze, trained through backward() so that
    ``overlap_with_backward`` starts the buckets (one per parameter) in the backward."""
    torch.manual_seed(0)
    embed, head = torch.nn.Embedding(8, 4), torch.nn.Linear(4, 2)
    params = [*embed.parameters(), *head.parameters()]
    opt = onebitlamb.OneBitLamb(params, lr=0.02, freeze_step=4, bucket_cap_mb=1e-5, overlap_with_backward=overlap)
    started = 0
    for step in range(12):
        g = torch.Generator().manual_seed(100 * step + rank)
        ids = torch.randint(0, 5 if step < 7 else 8, (16,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(head(embed(ids)), torch.randint(0, 2, (16,), generator=g)).backward()
        started += opt.exchange.started_in_backward
        opt.step()
    return [p.detach().clone() for p in params], opt.stats()["elements_born_after_freeze"], started


def test_births_behind_the_backward_redo_their_buckets_as_the_serial_step_sends_them():
    """With ``overlap_with_backward`` a bucket left before the step agreed on its births, masked:
    it is sent again, so the run is the serial one bit for bit."""
    serial = run_ranks(_embedding_run, 2, (False,), timeout_s=120)
    overlapped = run_ranks(_embedding_run, 2, (True,), timeout_s=120)
    assert serial[0][1] == overlapped[0][1] > 0  # rows 5-7 born after the freeze
    assert overlapped[0][2] > 0 and serial[0][2] == 0
    for rank in range(2):
        assert all(torch.equal(a, b) for a, b in zip(serial[rank][0], overlapped[rank][0])), f"rank {rank}"


def test_a_refused_step_takes_back_zero_one_adams_births():
    """A step refused after its births were agreed (here: a learning rate past float32's range, as
    a bad schedule gives) leaves no variance behind: the state is the one before it, and the run
    that goes on is, bit for bit, the run that never took it."""
    first_birth = min(born for born, _ in BIRTHS.values())
    runs = []
    for refuse in (False, True):
        params, opt = _made("ZeroOneAdam", ZERO_ONE, _init())
        for t in range(1, first_birth):
            _step(params, opt, 0, t)
        if refuse:
            before = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in opt.state["flat"].items()}
            opt.param_groups[2]["lr"] = 1e30
            with pytest.raises(FloatingPointError):
                _step(params, opt, 0, first_birth)
            opt.param_groups[2]["lr"] = LRS[2]
            for key, value in opt.state["flat"].items():
                same = torch.equal(value, before[key]) if isinstance(value, torch.Tensor) else value == before[key]
                assert same, f"{key} changed by the refused step"
        for t in range(first_birth, STEPS + 1):
            _step(params, opt, 0, t)
        assert opt.stats()["elements_born_after_freeze"] == DIM * len(BIRTHS)
        runs.append([p.detach().clone() for p in params])
    assert all(torch.equal(a, b) for a, b in zip(*runs))
