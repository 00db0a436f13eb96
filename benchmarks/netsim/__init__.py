"""Emulated hosts for the benchmarks: network namespaces on a bridge, links shaped by tbf.

``topology`` makes and removes the namespaces (``Network``), ``runner`` starts one worker per
rank inside them and gathers the results, ``worker`` is what each rank runs. The experiments
that use them are the scripts beside this package (``network``, ``sharded``; what they share is
``benchmarks.emulated``). Needs root and iproute2; not installed
with the package. See docs/netsim.md.
"""
