"""A warning about the user's settings points at the user's line: the one that called
``opt.step()``, not torch's wrapper around ``step()`` or a frame of the package."""
import sys
import warnings

import torch

import onebitlamb
from onebitlamb.optim.freeze import EarlyFreezeWarning


def test_an_early_freeze_warning_names_the_line_that_called_step():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = onebitlamb.OneBitLamb(model.parameters(), lr=1e-2, freeze_step=3)  # a variance still rising
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(4):
            opt.zero_grad()
            (model(torch.randn(16, 8) * 10 ** step) ** 2).mean().backward()
            line = sys._getframe().f_lineno + 1
            opt.step()
    (early,) = [w for w in caught if issubclass(w.category, EarlyFreezeWarning)]
    assert (early.filename, early.lineno) == (__file__, line), (early.filename, early.lineno)
