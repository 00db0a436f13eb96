"""overlap_with_backward=True on real gloo ranks: with one bucket the run is the serial one's bit for
bit; with several, each bucket starts during the backward and the run equals a serial run over
the same buckets; accumulation, a non-finite gradient and bad arguments are handled."""
from __future__ import annotations

import warnings
import weakref

import pytest
import torch

import onebitlamb
from rank_pool import run_ranks

STEPS, FREEZE = 10, 4
ONE_BUCKET, PER_LAYER = 1000.0, 1e-4  # MiB: the whole model; 26 elements (each parameter alone)


def _model():
    torch.manual_seed(0)  # the same start on every rank
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _loss(model, rank, step, micro=0):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    x, y = torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)
    return torch.nn.functional.cross_entropy(model(x), y)


def _optimizer(kind, params, group=None, cap=None, overlap=False):
    exchange = dict(process_group=group, bucket_cap_mb=cap, overlap_with_backward=overlap)
    if kind == "Lamb":
        return onebitlamb.Lamb(params, lr=0.02, **exchange)
    return getattr(onebitlamb, kind)(params, lr=0.02, freeze_step=FREEZE, **exchange)


def _run(rank, n, kind, cap, accumulate="one", nan_at=None, switch_at=None, local_size=None, resume_overlap=False,
         edit_at=None):
    """Train STEPS steps; ``cap``: bucket_cap_mb, with overlap_with_backward=True (None: serial, one bucket).
    ``accumulate``: "one" micro-batch, "no_sync" (two, the first under no_sync), "forgot" (two,
    without it), "clip" (one, its gradient clipped after the backward). ``nan_at``: rank 1's
    gradient is NaN at that step. ``switch_at``: at that step the state moves, through
    state_dict(), into a new optimizer with the same buckets (overlapped if ``resume_overlap``).
    ``accumulate`` "unscale" / "scaler": a GradScaler loop, with ``scaler.unscale_(opt)`` before
    ``scaler.step(opt)`` or without it; "data": at step ``edit_at`` the gradients are halved
    through ``p.grad.data``, which no version counter sees."""
    group = onebitlamb.comm.node_groups(local_size) if local_size else None
    model = _model()
    opt = _optimizer(kind, model.parameters(), group, cap, overlap=cap is not None)
    started, caught = [], []
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8) if accumulate in ("unscale", "scaler") else None
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for step in range(STEPS):
            if step == switch_at:
                state, old = opt.state_dict(), weakref.ref(opt)
                opt = _optimizer(kind, model.parameters(), group, cap, overlap=resume_overlap)
                opt.load_state_dict(state)
                assert old() is None  # dropped at once: its hooks start nothing more
            opt.zero_grad()
            if accumulate in ("no_sync", "forgot"):
                with opt.no_sync() if accumulate == "no_sync" else torch.enable_grad():
                    _loss(model, rank, step, micro=1).backward()
            loss = _loss(model, rank, step)
            if step == nan_at and rank == 1:  # during the backward: w[0, 0]'s gradient alone is NaN
                loss = loss + model[0].weight[0, 0] * (0 * float("nan"))
            (loss if scaler is None else scaler.scale(loss)).backward()
            if accumulate == "clip":
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            if accumulate == "data" and step == edit_at:
                for p in model.parameters():
                    p.grad.data.mul_(0.5)
            if accumulate == "unscale":
                scaler.unscale_(opt)
            started.append(opt.exchange.started_in_backward)
            if scaler is None:
                opt.step()
            else:
                scaler.step(opt)
                scaler.update()
            caught.append(opt.last_step_skipped)
        messages = [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)]
    flat = opt.state["flat"]
    errors = [flat[k].clone() for k in ("worker_error", "server_error") if k in flat]
    return ([p.detach().clone() for p in model.parameters()], [flat["exp_avg"].clone(), *errors],
            opt.comm_stats.bytes_sent, started, caught, messages, flat["buckets"])


def _equal(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _spawn(n, *args):
    return run_ranks(_run, n, args, timeout_s=180, collective_timeout_s=60)


# the overlap belongs to the exchange, the same for every optimizer: OneBitLamb's run goes through
# both stages; the other two classes only in the slow run
@pytest.mark.parametrize("kind", ["OneBitLamb", pytest.param("OneBitAdam", marks=pytest.mark.slow),
                                  pytest.param("Lamb", marks=pytest.mark.slow)])
def test_one_bucket_is_the_serial_run_bit_for_bit_and_starts_in_the_backward(kind):
    serial = _spawn(3, kind, None)
    overlapped = _spawn(3, kind, ONE_BUCKET)
    for s, o in zip(serial, overlapped):
        assert _equal(s[0], o[0]) and _equal(s[1], o[1])
        assert o[2] > s[2]  # the same exchanges plus one flag per warm-up step...
        assert s[3] == [0] * STEPS and o[3] == [0] + [1] * (STEPS - 1)  # ...started before step()
        assert o[6] == [[0, 8 * 16 + 16 + 16 * 3 + 3]]


def test_several_buckets_start_in_the_backward_and_equal_a_serial_run_over_them():
    overlapped = _spawn(2, "OneBitLamb", PER_LAYER)
    switched = _spawn(2, "OneBitLamb", PER_LAYER, "one", None, FREEZE + 2)  # serial from the 7th step on
    serial = _spawn(2, "OneBitLamb", None)
    for o, w, s in zip(overlapped, switched, serial):
        assert o[6] == [[192, 195], [144, 192], [128, 144], [0, 128]]  # last parameters first
        assert o[3] == [0] + [4] * (STEPS - 1)
        assert w[3] == [0] + [4] * (FREEZE + 1) + [0] * (STEPS - FREEZE - 2)
        assert _equal(o[0], w[0]) and _equal(o[1], w[1])  # the serial step over the saved buckets
        assert not _equal(o[0], s[0])  # four scales are not one
        assert all(torch.allclose(a, b, atol=0.05) for a, b in zip(o[0], s[0]))


def test_a_resumed_overlapped_run_is_the_uninterrupted_one():
    straight = _spawn(2, "OneBitAdam", PER_LAYER)
    resumed = _spawn(2, "OneBitAdam", PER_LAYER, "one", None, FREEZE + 2, None, True)
    for s, r in zip(straight, resumed):
        assert _equal(s[0], r[0]) and _equal(s[1], r[1]) and r[6] == s[6]
        assert r[3][FREEZE + 3:] == [4] * (STEPS - FREEZE - 3)  # the first step after a load runs in step()


def test_accumulation_under_no_sync_starts_once_and_a_forgotten_no_sync_is_redone():
    serial = _spawn(2, "OneBitLamb", None, "forgot")
    with_no_sync = _spawn(2, "OneBitLamb", ONE_BUCKET, "no_sync")
    for s, o in zip(serial, with_no_sync):
        assert _equal(s[0], o[0]) and _equal(s[1], o[1]) and not o[5]
    # forgotten in the warm-up: each stale bucket averaged again (2 ranks: a sum per bucket is exact)
    lamb_serial, lamb_forgot = _spawn(2, "Lamb", None, "forgot"), _spawn(2, "Lamb", PER_LAYER, "forgot")
    # and after the freeze: each stale bucket's errors restored and exchanged again
    forgot = _spawn(2, "OneBitLamb", PER_LAYER, "forgot")
    forgot_serial = _spawn(2, "OneBitLamb", PER_LAYER, "forgot", None, FREEZE + 1)  # serial after the freeze
    for ls, lf, f, fs in zip(lamb_serial, lamb_forgot, forgot, forgot_serial):
        assert _equal(ls[0], lf[0]) and _equal(ls[1], lf[1])
        assert _equal(f[0], fs[0]) and _equal(f[1], fs[1])
        assert len(f[5]) == 1 and "no_sync" in f[5][0]  # warned once,
        assert f[3] == [0, 4] + [0] * (STEPS - 2)  # and from then on nothing starts early to be sent twice


def test_gradients_clipped_after_the_backward_are_exchanged_as_clipped():
    serial, overlapped = _spawn(2, "OneBitLamb", None, "clip"), _spawn(2, "OneBitLamb", ONE_BUCKET, "clip")
    for s, o in zip(serial, overlapped):
        assert _equal(s[0], o[0]) and _equal(s[1], o[1])
        assert len(o[5]) == 1 and "clipping" in o[5][0]
        assert o[3] == [0, 1] + [0] * (STEPS - 2)  # from the redo on, nothing starts early to be sent twice:
        # beyond the serial bytes only step 2's average of 195 floats again, 2 (n-1)/n 4 d = 780 bytes, and
        # an 8-byte agreement (finite, stale) per step
        assert o[2] - s[2] <= 780 + STEPS * 8


@pytest.mark.parametrize("loop", ["unscale", "scaler"])
def test_a_grad_scalers_unscaling_is_seen(loop):
    """GradScaler's unscaling changes the gradients in place without a version bump, after the
    buckets went out with the scaled gradients (``scaler.unscale_(opt)`` before ``scaler.step``,
    or inside ``step(grad_scaler=...)``): the step must still be the serial one, bit for bit."""
    serial, overlapped = _spawn(2, "OneBitLamb", None, loop), _spawn(2, "OneBitLamb", ONE_BUCKET, loop)
    for s, o in zip(serial, overlapped):
        assert _equal(s[0], o[0]) and _equal(s[1], o[1])
        assert o[3][1] == 1 and len(o[5]) == 1 and "unscaling" in o[5][0]  # started early, redone, warned once


@pytest.mark.parametrize("edit_at", [2, FREEZE + 2])
def test_gradients_edited_through_data_are_seen(edit_at):
    """``p.grad.data.mul_(0.5)`` after the backward, in the warm-up and after the freeze."""
    serial = _spawn(2, "OneBitLamb", None, "data", None, None, None, False, edit_at)
    overlapped = _spawn(2, "OneBitLamb", ONE_BUCKET, "data", None, None, None, False, edit_at)
    for s, o in zip(serial, overlapped):
        assert _equal(s[0], o[0]) and _equal(s[1], o[1])
        assert o[3][edit_at] == 1 and len(o[5]) == 1


@pytest.mark.parametrize("nan_at", [2, FREEZE + 2])
def test_a_non_finite_gradient_skips_the_step_as_the_serial_run_does(nan_at):
    serial = _spawn(2, "OneBitLamb", None, "one", nan_at)
    overlapped = _spawn(2, "OneBitLamb", ONE_BUCKET, "one", nan_at)
    for s, o in zip(serial, overlapped):
        assert o[4] == [step == nan_at for step in range(STEPS)] == s[4]
        assert _equal(s[0], o[0]) and _equal(s[1], o[1])  # the exchange behind the backward was undone


def test_a_hierarchical_group_overlaps_too():
    serial = _spawn(4, "OneBitLamb", None, "one", None, None, 2)
    overlapped = _spawn(4, "OneBitLamb", ONE_BUCKET, "one", None, None, 2)
    for s, o in zip(serial, overlapped):
        assert _equal(s[0], o[0]) and _equal(s[1], o[1])
        assert o[3][-1] == 1


def _refusals(rank, n):
    out = []
    for cap, overlap in ((0, True), (-1.0, True), (float("nan"), False), (True, True), ("25", True), (1.0, "yes")):
        try:
            _optimizer("OneBitLamb", _model().parameters(), cap=cap, overlap=overlap)
        except ValueError as e:
            out.append(str(e))
    model = _model()
    overlapped = _optimizer("OneBitLamb", model.parameters(), cap=1.0, overlap=True)
    try:
        onebitlamb.register_ddp(torch.nn.parallel.DistributedDataParallel(model), overlapped)
    except ValueError as e:
        out.append(str(e))
    return out


def test_bad_arguments_are_refused_on_every_rank():
    for messages in run_ranks(_refusals, 2, timeout_s=120, collective_timeout_s=60):
        assert len(messages) == 7
        for bad, message in zip(("0", "-1.0", "nan", "True", "'25'"), messages):
            assert f"bucket_cap_mb: {bad}" in message
        assert "overlap_with_backward: 'yes'" in messages[5]
        assert "register_ddp" in messages[6] and "not both" in messages[6]


def test_one_process_has_nothing_to_overlap():
    model = _model()
    opt = _optimizer("OneBitLamb", model.parameters(), cap=PER_LAYER, overlap=True)
    for step in range(STEPS):
        opt.zero_grad()
        _loss(model, 0, step).backward()
        opt.step()
        assert opt.exchange.started_in_backward == 0
    assert opt.state["flat"]["buckets"] == [[192, 195], [144, 192], [128, 144], [0, 128]]


def test_a_state_whose_buckets_do_not_tile_the_model_is_refused():
    model = _model()
    opt = _optimizer("OneBitLamb", model.parameters())
    _loss(model, 0, 0).backward()
    opt.step()
    state = opt.state_dict()
    entry = next(e for e in state["state"].values() if e)
    entry["buckets"] = [[0, 100], [120, 195]]
    with pytest.raises(ValueError, match=r"buckets \[\[0, 100\], \[120, 195\]\] do not tile"):
        opt.load_state_dict(state)


def test_the_main_job_exchanges_behind_its_last_micro_batch_unless_it_clips(tmp_path):
    """The main job's setting bucket_cap_mb (the study in docs/lab/retired_benchmarks.md): 2 workers, 2 micro-batches each;
    the first runs under no_sync(), so without clipping no bucket is redone; clipping the local
    gradient after the backward changes every bucket's gradient, which the optimizer notices. (The
    main job's loop on the persistent ranks, tests/pretrain_pool.py: its ranks' warnings come back.)"""
    import email
    import os

    from onebitlamb.train.config import PRESETS, TrainConfig
    from pretrain_pool import train_on_ranks

    for clip in (0.0, 1.0):
        cfg = TrainConfig(**{**PRESETS["tiny"], "out": str(tmp_path / f"clip{clip}"), "progress": False,
                             "corpus": [os.path.dirname(email.__file__)], "cache_dir": str(tmp_path / "cache"),
                             "freeze": 0.35, "clip": clip, "bucket_cap_mb": 1e-3})
        assert cfg.global_batch // (cfg.workers * cfg.micro_batch) == 2
        run = train_on_ranks(cfg)
        assert run.summary["completed"]
        redone = any("changed after their exchange had started" in w for w in run.warnings)
        assert redone == (clip > 0)
