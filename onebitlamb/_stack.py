"""Where a warning points: at the user's line, not at the package or the wrappers around it."""
from __future__ import annotations

import os
import sys
from typing import Tuple

# what calls step() for the user (torch's Optimizer.step wrapper, no_grad's decorator, GradScaler;
# the frameworks' optimizer wrappers and training loops): frames between the user's line and a warning
WRAPPERS = ("torch", "accelerate", "transformers", "lightning", "pytorch_lightning")


def _inside() -> Tuple[str, ...]:
    """The folders of this package and of the wrappers imported so far."""
    files = [__file__] + [getattr(sys.modules.get(name), "__file__", None) or "" for name in WRAPPERS]
    return tuple(os.path.dirname(os.path.abspath(f)) + os.sep for f in files if f)


def user_stacklevel() -> int:
    """The ``stacklevel`` for a ``warnings.warn`` called by this function's caller that names the
    first frame outside onebitlamb and what wraps it: the line that called ``opt.step()`` (or
    ``scaler.step(opt)``, ``trainer.fit(...)``). A fixed number would name torch's wrapper, or another
    frame whenever the path from ``step()`` to the warning changes."""
    inside = _inside()
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(inside):
        frame, level = frame.f_back, level + 1
    return level
