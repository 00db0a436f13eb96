"""Clipping before ``step()`` in a plain loop: ``onebitlamb.clip_grad_norm_`` scales every rank's
gradient by one agreed factor, so the average the optimizer steps on keeps its direction and is at
most ``max_norm`` long, where torch's clip scales each rank by its own factor."""
import math

import pytest
import torch

import onebitlamb
from rank_pool import run_ranks

MAX_NORM = 1.0


def _gradients(rank):
    """Rank 0 a large gradient, rank 1 a small one pointing elsewhere."""
    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2, 2))]
    scale = 10.0 if rank == 0 else 0.5
    for k, p in enumerate(params):
        p.grad = scale * torch.arange(1.0, p.numel() + 1).reshape(p.shape) * (1 if rank == 0 else (-1) ** k)
    return params


def _clip(rank, world_size, how):
    params = _gradients(rank)
    before = [p.grad.clone() for p in params]
    if how == "torch":
        torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
        norm = None
    else:
        if how == "inf" and rank == 1:
            params[0].grad[0] = math.inf
            before = [p.grad.clone() for p in params]
        norm = float(onebitlamb.clip_grad_norm_(params, MAX_NORM))
    return before, [p.grad for p in params], norm


def _flat(tensors):
    return torch.cat([t.flatten() for t in tensors])


def test_every_rank_is_scaled_by_one_factor_and_the_average_is_bounded():
    agreed, own = run_ranks(_clip, 2, ("agreed",)), run_ranks(_clip, 2, ("torch",))
    norms = [_flat(before).norm() for before, _, _ in agreed]
    rms = math.sqrt(sum(float(n) ** 2 for n in norms) / 2)
    factors = [float(_flat(after).norm() / _flat(before).norm()) for before, after, _ in agreed]
    assert factors[0] == pytest.approx(factors[1], rel=1e-6)
    assert factors[0] == pytest.approx(MAX_NORM / rms, rel=1e-5)
    assert all(norm == pytest.approx(rms, rel=1e-6) for _, _, norm in agreed)  # float32 norms here
    average_before = (_flat(agreed[0][0]) + _flat(agreed[1][0])) / 2
    average_after = (_flat(agreed[0][1]) + _flat(agreed[1][1])) / 2
    assert float(average_after.norm()) <= MAX_NORM
    assert torch.allclose(average_after, factors[0] * average_before, rtol=1e-6)  # the same direction
    # torch's clip on each rank: each its own factor, the average turned towards the small gradient
    own_factors = [float(_flat(after).norm() / _flat(before).norm()) for before, after, _ in own]
    assert own_factors[0] < 0.5 * own_factors[1]
    own_average = (_flat(own[0][1]) + _flat(own[1][1])) / 2
    assert float(torch.nn.functional.cosine_similarity(own_average, average_before, dim=0)) < 0.99


def test_a_non_finite_norm_on_one_rank_leaves_every_gradient_for_the_optimizer_to_skip():
    for before, after, norm in run_ranks(_clip, 2, ("inf",)):
        assert math.isinf(norm)
        assert all(torch.equal(a, b) for a, b in zip(before, after))


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf, "1"])
def test_a_bad_max_norm_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match=f"Invalid max_norm: {bad!r}"):
        onebitlamb.clip_grad_norm_([torch.nn.Parameter(torch.zeros(2))], bad)


def test_without_a_process_group_it_is_torchs_clip():
    (p,) = _gradients(0)[:1]
    q = torch.nn.Parameter(p.detach().clone())
    q.grad = p.grad.clone()
    expected = float(torch.nn.utils.clip_grad_norm_(q, MAX_NORM))
    assert float(onebitlamb.clip_grad_norm_(p, MAX_NORM)) == pytest.approx(expected)
    assert torch.allclose(p.grad, q.grad, rtol=1e-6)
