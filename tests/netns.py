"""Whether this machine can emulate hosts (root, ``ip``, ``tc``): the namespace tests skip, saying
why, where it cannot."""
import pytest

from benchmarks.netsim.topology import NetsimUnavailable, check_available

try:
    check_available()
    UNAVAILABLE = None
except NetsimUnavailable as e:
    UNAVAILABLE = str(e)

# on a test that creates namespaces (mark it ``netns`` too, so that ``-m "not netns"`` leaves it out)
needs_netns = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"netns test: {UNAVAILABLE}")
