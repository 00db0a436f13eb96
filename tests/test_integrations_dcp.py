"""torch.distributed.checkpoint on 2 real gloo ranks: get_state_dict / dcp.save / dcp.load /
set_state_dict keep every rank's compression errors, and a resume is the uninterrupted run."""
from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import onebitlamb
from rank_pool import run_ranks
from onebitlamb.optim.state_format import flat_of
from toy import classifier, train

STEPS, FREEZE, SAVE_AT = 8, 3, 5


def _optimizer(kind, model, bucket_cap_mb):
    if kind == "ZeroOneAdam":  # variance steps 1 and 2, a 1-bit step 3, syncs 4-6 (saved after 5), 7 local, 8 a sync
        return onebitlamb.ZeroOneAdam(model.parameters(), lr=0.02, var_freeze_step=FREEZE, var_update_scaler=1,
                                      local_step_scaler=2, local_step_clipper=2)
    return getattr(onebitlamb, kind)(model.parameters(), lr=0.02, freeze_step=FREEZE, bucket_cap_mb=bucket_cap_mb,
                                     overlap_with_backward=bucket_cap_mb is not None)


def _run(rank, n, kind, folder, bucket_cap_mb=None):
    model = classifier(0)
    opt = _optimizer(kind, model, bucket_cap_mb)
    train(model, opt, rank, range(SAVE_AT))
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=folder)
    saved = flat_of(opt.state_dict())
    train(model, opt, rank, range(SAVE_AT, STEPS))
    uninterrupted = [p.detach().clone() for p in model.parameters()]

    # a new process would start like this: another initialisation, a new optimizer as template
    model = classifier(rank + 7)
    opt = _optimizer(kind, model, bucket_cap_mb)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=folder)
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    loaded = flat_of(opt.state_dict())
    same_state = all(torch.equal(loaded[k], v) if isinstance(v, torch.Tensor) else loaded[k] == v
                      for k, v in saved.items()) and loaded.keys() == saved.keys()
    train(model, opt, rank, range(SAVE_AT, STEPS))
    resumed = [p.detach().clone() for p in model.parameters()]
    return saved["worker_error"], same_state, uninterrupted, resumed


# OneBitLamb also with overlap_with_backward's buckets (each parameter alone): the new optimizer's
# template has the same per-bucket error regions
@pytest.mark.parametrize("kind,bucket_cap_mb", [("OneBitLamb", None), ("OneBitAdam", None), ("OneBitLamb", 1e-4),
                                                ("ZeroOneAdam", None)])
def test_dcp_keeps_every_ranks_errors_and_resumes_exactly(kind, bucket_cap_mb, tmp_path):
    out = run_ranks(_run, 2, (kind, str(tmp_path / "ckpt"), bucket_cap_mb), timeout_s=120, collective_timeout_s=60)
    (error0, same0, full0, resumed0), (error1, same1, full1, resumed1) = out
    assert error0.abs().max() > 0 and not torch.equal(error0, error1)  # the ranks' errors differ
    assert same0 and same1  # each rank got its own state back, not rank 0's
    for full, resumed in ((full0, resumed0), (full1, resumed1)):
        assert all(torch.equal(a, b) for a, b in zip(full, resumed))
    assert all(torch.equal(a, b) for a, b in zip(resumed0, resumed1))
