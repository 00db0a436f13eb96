import os
import sys

# One intra-op thread per process: the tests start several ranks on a 2-core machine.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# The repository root, for the unpackaged benchmarks/ (``import benchmarks``) under a bare `pytest` too.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
