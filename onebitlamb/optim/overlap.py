"""Communication behind the backward: each bucket's exchange starts as its last gradient lands.

In the serial step the exchange waits for the whole backward, and the network idles while the
backward runs. Here the optimizer's flat layout is cut into buckets (``layout.bucket_ranges``,
last parameters first, the order a backward produces their gradients). A post-accumulate-grad
hook on every parameter counts the bucket's gradients; when a bucket is complete, and every bucket
before it has started (so that every rank starts them in the same order, whatever order their
hooks fire in), the optimizer prepares the bucket on the hook's thread (copies its gradients,
forms its momentum) and hands the exchange to one thread of its own, which runs the buckets'
collectives one after another on a process group of its own (``comm.duplicate_group``: the
caller's collectives on its group never interleave with the thread's). ``step()`` starts the
buckets no hook completed (a parameter without a gradient), waits for the thread, and goes on as
the serial step does.

A gradient that lands in a bucket already started (gradient accumulation without ``no_sync()``,
a second backward before the step), or that changes after its bucket started (clipping by the
global norm, unscaling), makes the bucket stale: ``step()`` agrees on the stale buckets with the
other ranks, undoes what their exchange did to the error buffers, and exchanges them again from
the final gradients, so the result is that of the serial step. Such a loop would send every
bucket twice at every step, so after the first stale bucket the hooks start nothing more: the
buckets are exchanged in ``step()``, as without overlap, and a warning says why.
"""
from __future__ import annotations

import contextlib
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Dict, Iterator, List, Optional, Sequence

import torch

# prepare(k) runs on the hook's thread and returns the job the exchange thread runs for bucket k
Prepare = Callable[[int], Callable[[], None]]


class BackwardOverlap:
    """The hooks, the thread and the per-step bookkeeping of ``overlap_with_backward``.

    The optimizer owns the buckets' maths: ``prepare(k)`` copies bucket ``k``'s gradients and
    returns the job (a collective) the thread runs; ``active()`` says whether hooks may start
    buckets now (not before the optimizer's first step has laid out and agreed its state)."""

    def __init__(self, prepare: Prepare, active: Callable[[], bool]) -> None:
        # held weakly (bound methods of the optimizer, which holds this object): an optimizer
        # dropped by its user goes at once, and its hooks fall silent with it
        self._prepare_ref, self._active_ref = weakref.WeakMethod(prepare), weakref.WeakMethod(active)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="onebitlamb-exchange")
        self._handles: list = []
        weakref.finalize(self, _remove_all, self._handles)
        self._bucket_of: Dict[int, int] = {}
        self._sizes: List[int] = []
        self._syncing = True
        self.given_up = False  # set by give_up(): buckets start in finish() only
        self._reset()

    def set_buckets(self, bucket_params: Sequence[Sequence[torch.Tensor]]) -> None:
        """The parameters of each bucket, in the order the buckets are exchanged (hooks on them)."""
        self.abandon()
        _remove_all(self._handles)
        # the hooks hold this object weakly: a dropped optimizer must not go on exchanging
        this = weakref.ref(self)

        def on_gradient(param: torch.Tensor) -> None:
            overlap = this()
            if overlap is not None:
                overlap._on_gradient(param)
        self._handles.extend(p.register_post_accumulate_grad_hook(on_gradient) for ps in bucket_params for p in ps)
        self._bucket_of = {id(p): k for k, ps in enumerate(bucket_params) for p in ps}
        self._sizes = [len(ps) for ps in bucket_params]
        self._reset()

    def _reset(self) -> None:
        self._landed: List[set] = [set() for _ in self._sizes]
        self._futures: List[Optional[Future]] = [None] * len(self._sizes)
        self._stale = [False] * len(self._sizes)
        self._next = 0  # the first bucket not started

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside start no exchange: the micro-batches before the last of an accumulation."""
        previous, self._syncing = self._syncing, False
        try:
            yield
        finally:
            self._syncing = previous

    @property
    def started(self) -> int:
        """Buckets started since the last step."""
        return self._next

    def _on_gradient(self, param: torch.Tensor) -> None:
        k = self._bucket_of.get(id(param))
        active = self._active_ref()
        if k is None or not self._syncing or self.given_up or active is None or not active():
            return
        if self._futures[k] is not None:
            self._stale[k] = True
            return
        self._landed[k].add(id(param))
        while self._next < len(self._sizes) and len(self._landed[self._next]) == self._sizes[self._next]:
            self._start(self._next)

    def _start(self, k: int) -> None:
        self._futures[k] = self._executor.submit(self._prepare_ref()(k))
        self._next = k + 1

    def finish(self) -> List[bool]:
        """Start the buckets not started, in order, wait for every exchange, and return which
        buckets are stale on this rank; the next backward starts afresh."""
        try:
            while self._next < len(self._sizes):
                self._start(self._next)
            for future in self._futures:
                future.result()  # a collective's error (a timeout, a non-finite scale) surfaces here
            return list(self._stale)
        finally:
            self._reset()

    def give_up(self) -> None:
        """From now on start no bucket from the backward: where the gradients change after it every
        step (clipping, unscaling, accumulation without ``no_sync``), each exchange started early
        is one sent twice."""
        self.given_up = True

    def abandon(self) -> None:
        """Wait for what was started (its collectives pair with the other ranks') and forget it:
        the step that follows runs serially (a first step, a step after a load)."""
        for future in self._futures:
            if future is not None:
                future.exception()
        self._reset()


def _remove_all(handles: list) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()
