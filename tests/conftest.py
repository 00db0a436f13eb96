import os

# One intra-op thread per process: the tests start several ranks on a 2-core machine.
os.environ.setdefault("OMP_NUM_THREADS", "1")
