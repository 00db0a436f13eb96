"""The phases reach the optimizer through its step context (onebitlamb/optim/context.py) only:
no private member of an optimizer is read outside staged.py, the file of its class; and the
context follows what torch.optim replaces (a load's new param groups)."""
import re
from pathlib import Path

import torch

import onebitlamb
from toy import grads_for, initial_params, through_a_checkpoint

ROOT = Path(__file__).resolve().parents[1]


def _private_members():
    """The underscore members of the optimizers: their classes' and a built optimizer's."""
    params = [torch.nn.Parameter(t.clone()) for t in initial_params()]
    names = set()
    for opt in (onebitlamb.OneBitLamb(params, lr=0.01, freeze_step=2),
                onebitlamb.ZeroOneAdam(params, lr=0.01, var_freeze_step=2)):
        names |= {n for n in dir(opt) if n.startswith("_") and not n.startswith("__")}
    return names - {n for n in dir(torch.optim.Optimizer) if n.startswith("_")}


def test_no_private_member_of_an_optimizer_is_used_outside_its_file():
    names = _private_members()
    assert {"_flat", "_layout", "_context", "_phases"} <= names
    found = []
    for path in [*ROOT.glob("onebitlamb/**/*.py"), *ROOT.glob("tests/*.py"), *ROOT.glob("benchmarks/**/*.py")]:
        if path.name in ("staged.py", "test_step_context.py"):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for match in re.finditer(r"(\w+)\.(_[a-z]\w*)\b", line):
                owner, name = match.groups()
                # a class's own members through self, and other objects' members of the same name
                # (the exchange's own _flat), are not the optimizer's
                if owner not in ("self", "cls") and name in names and "opt" in owner and owner[0].islower():
                    found.append(f"{path.relative_to(ROOT)}:{number}: {match.group(0)}")
    assert found == []


def test_the_context_follows_the_param_groups_a_load_puts_in_place():
    def fresh(init):
        params = [torch.nn.Parameter(t.clone()) for t in init]
        return params, onebitlamb.OneBitLamb(params, lr=0.02, freeze_step=3)

    params, opt = fresh(initial_params())
    for t in range(1, 5):
        for p, g in zip(params, grads_for(params, 0, t)):
            p.grad = g
        opt.step()
    params, opt = through_a_checkpoint(params, opt, fresh)  # torch.optim's load replaces param_groups
    before = [p.detach().clone() for p in params]
    for group in opt.param_groups:
        group["lr"] = 0.0
    for p, g in zip(params, grads_for(params, 0, 5)):
        p.grad = g
    opt.step()
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, params))
