import os
import sys

import pytest

# Triton's interpreter for the fused codec's CPU tests (tests/test_triton_codec.py), set before any
# test module imports triton: triton reads it early, and another module (tests/test_cuda.py,
# torch.compile's tests) may import triton first. Only where there is no GPU, so that a GPU machine
# runs the compiled kernels; it changes nothing else, since the library never runs Triton on CPU
# tensors unless asked to (fused=True).
import torch  # noqa: E402

if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "1"

# One intra-op thread per process: the tests start several ranks on a 2-core machine.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# pytest's own process too: torch took its thread count when imported above, before the variable
# was set (2 here), and small in-process runs then crawled (an LSTM's 100 steps in test_zoo.py: 0.2 s
# on one thread, 7 s on two idle cores, 25-66 s on two busy ones)
try:
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
except ValueError:  # a list of nested levels ("4,2"): left to torch
    pass

# The repository root, for the unpackaged benchmarks/ (``import benchmarks``) under a bare `pytest` too.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="session", autouse=True)
def _rank_pools():
    """The persistent ranks of tests/rank_pool.py end with the session (atexit would end them too)."""
    yield
    pools = sys.modules.get("rank_pool")
    if pools is not None:
        pools.shutdown()
