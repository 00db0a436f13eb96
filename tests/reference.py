"""A reference of docs/algorithm.md written for the tests, sharing no code with the library.

Deliberately plain: per-layer Python lists, the formulas in the order the spec states them, and
every worker of a data-parallel run simulated in one process (including the 1-bit all-reduce),
so the optimizers can be checked against it step by step.
"""
from __future__ import annotations

import math
from typing import List, Optional

import torch


def sign(t: torch.Tensor) -> torch.Tensor:
    return torch.where(t < 0, -torch.ones_like(t), torch.ones_like(t))


def shard_of(t: torch.Tensor, j: int, shards: int) -> torch.Tensor:
    """Piece ``j`` of ``t`` cut in ``shards`` along its first dimension as ``torch.chunk`` cuts it
    (empty where it gives fewer pieces)."""
    if shards == 1:
        return t
    pieces = torch.chunk(t, shards, dim=0)
    return pieces[j] if j < len(pieces) else t.new_empty((0,) + tuple(t.shape[1:]))


class OneBitAllReduceSim:
    """Steps 1-5 of "The error-compensated 1-bit all-reduce" for n simulated workers."""

    def __init__(self, n: int, D: int):
        self.n, self.D = n, D
        self.worker_errors = [torch.zeros(D) for _ in range(n)]
        self.server_errors = [torch.zeros(D // n) for _ in range(n)]

    def __call__(self, buffers: List[torch.Tensor]) -> torch.Tensor:
        n, D = self.n, self.D
        c = D // n
        signs, scales = [], []
        for i in range(n):
            y = buffers[i] + self.worker_errors[i]
            s = torch.linalg.vector_norm(y) / math.sqrt(D)
            q = sign(y)
            self.worker_errors[i] = y - s * q
            signs.append(q)
            scales.append(s)
        out = torch.empty(D)
        for j in range(n):
            z = self.server_errors[j].clone()
            for i in range(n):
                z = z + (scales[i] / n) * signs[i][j * c:(j + 1) * c]
            s2 = torch.linalg.vector_norm(z) / math.sqrt(c)
            q2 = sign(z)
            self.server_errors[j] = z - s2 * q2
            out[j * c:(j + 1) * c] = s2 * q2
        return out


def adam_bound(t: int, betas, bias_correction: bool) -> float:
    """The largest ``|m_hat / sqrt(v_hat)|`` Adam can reach at step ``t`` (docs/algorithm.md, "A
    bounded stage 2"), summed term by term: ``m_t / sqrt(v_t) <= (1-b1) / sqrt(1-b2) *
    sqrt(sum_k (b1^2/b2)^k)`` over ``k < t``, times ``sqrt(1-b2^t) / (1-b1^t)`` when corrected."""
    b1, b2 = betas
    total = sum((b1 * b1 / b2) ** k for k in range(t))
    bound = (1 - b1) / math.sqrt(1 - b2) * math.sqrt(total)
    if bias_correction:
        bound = bound * math.sqrt(1 - b2 ** t) / (1 - b1 ** t)
    return bound


class Reference:
    """kind: "lamb" (never freezes), "onebitlamb" or "onebitadam". ``warmup_average``: how the
    warm-up averages the workers' gradients (a function of the per-worker lists of layers; default
    the exact mean), for a warm-up whose average is quantised."""

    def __init__(self, init: List[torch.Tensor], kind: str, lr: List[float], wd: List[float], *,
                 freeze_step: Optional[int] = None, n: int = 1, bias_correction: bool = True,
                 betas=(0.9, 0.999), eps=1e-8, min_coeff=0.01, max_coeff=10.0, coeff_beta=0.9,
                 factor_min=0.5, factor_max=4.0, factor_threshold=0.1, compression_space="momentum",
                 trust_ratio_after_freeze="frozen", bound_direction=False, warmup_average=None, shards=1):
        self.x = [t.detach().clone().float() for t in init]
        self.kind, self.lr, self.wd, self.T = kind, lr, wd, freeze_step
        self.n, self.bc = n, bias_correction
        self.b1, self.b2 = betas
        self.eps, self.min_c, self.max_c, self.cb = eps, min_coeff, max_coeff, coeff_beta
        self.fmin, self.fmax, self.fthr = factor_min, factor_max, factor_threshold
        self.space, self.live = compression_space, trust_ratio_after_freeze == "live"
        self.bounded = bound_direction
        L = len(self.x)
        self.m = [torch.zeros_like(t) for t in self.x]
        self.v = [torch.zeros_like(t) for t in self.x]
        self.c_avg = [0.0] * L
        self.c_count = [0] * L
        self.t = 0
        self.sims = []
        self.warmup_average = warmup_average
        # sharded parameters (HSDP): each layer cut in ``shards`` pieces along its first dimension
        # (torch.chunk's cut, FSDP2's), and stage 2's 1-bit all-reduce run per shard, over the
        # pieces that shard holds; every per-layer statistic stays that of the whole layer
        self.shards = shards

    def _hat(self, beta):
        return (1 - beta ** self.t) if self.bc else 1.0

    def step(self, grads_per_worker: List[List[torch.Tensor]]) -> None:
        self.t += 1
        L = len(self.x)
        layerwise = self.kind in ("lamb", "onebitlamb")
        if self.T is None or self.t <= self.T:
            if self.warmup_average is not None:
                g = self.warmup_average(grads_per_worker)
            else:
                g = [sum(w[l] for w in grads_per_worker) / len(grads_per_worker) for l in range(L)]
            for l in range(L):
                self.m[l] = self.b1 * self.m[l] + (1 - self.b1) * g[l]
                self.v[l] = self.b2 * self.v[l] + (1 - self.b2) * g[l] * g[l]
                u = (self.m[l] / self._hat(self.b1)) / (torch.sqrt(self.v[l] / self._hat(self.b2)) + self.eps)
                u = u + self.wd[l] * self.x[l]
                c = 1.0
                if layerwise:
                    xn, un = float(self.x[l].norm()), float(u.norm())
                    if xn > 0 and un > 0:
                        c = min(max(xn / un, self.min_c), self.max_c)
                        self.c_avg[l] = self.cb * self.c_avg[l] + (1 - self.cb) * c
                        self.c_count[l] += 1
                self.x[l] = self.x[l] - self.lr[l] * c * u
            if self.T is not None and self.t == self.T:
                self._freeze()
            return
        m_prev = [t.clone() for t in self.m]
        # an element without a variance at the freeze is born at the first step where some worker's
        # gradient reaches it: from then on it is sent, received and stepped like the others
        for l in range(L):
            reached = sum((w[l] != 0).float() for w in grads_per_worker) > 0
            self.mask[l] = torch.maximum(self.mask[l], reached.float())
        local = [[self.b1 * self.m[l] + (1 - self.b1) * w[l] for l in range(L)] for w in grads_per_worker]
        if self.n == 1:
            self.m = local[0]
        else:
            sent_by_worker = []
            # what is sent per layer: k_l m, or in the update space k_l m / (sqrt(v_frozen) + eps)
            # (masked: an element without a gradient before the freeze sends nothing; bounded in the
            # update space: what stands for the direction clipped like the direction)
            to_sent = [self.k[l] / self._sent_denominator(l) for l in range(L)]
            for w in local:
                sent = []
                for l in range(L):
                    if self.bounded and self.space == "update":
                        limit = adam_bound(self.t, (self.b1, self.b2), self.bc) * self._hat(self.b1)
                        quotient = (w[l] / self._sent_denominator(l)).clamp(-limit, limit)
                        sent.append(self.k[l] * quotient * self.mask[l])
                    else:
                        sent.append(to_sent[l] * w[l] * self.mask[l])
                sent_by_worker.append(sent)
            pieces = [[None] * self.shards for _ in range(L)]  # the average of each layer's pieces
            for j, sim in enumerate(self.sims):
                bufs = []
                for sent in sent_by_worker:
                    b = torch.zeros(sim.D)
                    flat = torch.cat([shard_of(t_, j, self.shards).reshape(-1) for t_ in sent])
                    b[:flat.numel()] = flat
                    bufs.append(b)
                out = sim(bufs)
                off = 0
                for l in range(L):
                    piece = shard_of(self.x[l], j, self.shards)
                    pieces[l][j] = out[off:off + piece.numel()].reshape(piece.shape)
                    off += piece.numel()
            for l in range(L):
                self.m[l] = torch.cat(pieces[l]).reshape(self.x[l].shape) / to_sent[l]
        self.m = [self.m[l] * self.mask[l] for l in range(L)]
        for l in range(L):
            ghat = (self.m[l] - self.b1 * m_prev[l]) / (1 - self.b1)
            self.v_fresh[l] = self.b2 * self.v_fresh[l] + (1 - self.b2) * ghat * ghat
            den = torch.sqrt(self.v_frozen[l]) + self.eps
            # born after the freeze: the element's own variance, kept fresh from the exchanged momenta
            born_late = (self.mask[l] > 0) & (self.v_frozen[l] == 0)
            own = torch.sqrt(self.v_fresh[l] / self._hat(self.b2)) + self.eps
            u0 = (self.m[l] / self._hat(self.b1)) / torch.where(born_late, own, den)
            if self.bounded:
                limit = adam_bound(self.t, (self.b1, self.b2), self.bc)
                u0 = u0.clamp(-limit, limit)
            u = u0 + self.wd[l] * self.x[l]
            coef = 1.0
            if self.kind == "onebitlamb" and self.live:  # LAMB's ratio on the exchanged momentum
                xn, un = float(self.x[l].norm()), float(u.norm())
                if xn > 0 and un > 0:
                    coef = min(max(xn / un, self.min_c), self.max_c)
            elif self.kind == "onebitlamb":
                r = float((den / (torch.sqrt(self.v_fresh[l] / self._hat(self.b2)) + self.eps)).max())
                if self.wd[l] > 0:
                    un = float(u.norm())
                    rho = min(1.0, float(u0.norm()) / un) if un > 0 else 1.0
                    r = r * rho + (1 - rho)
                r = min(max(r, self.fmin), self.fmax)
                r = min(max(r, (1 - self.fthr) * self.r_prev[l]), (1 + self.fthr) * self.r_prev[l])
                self.r_prev[l] = r
                coef = self.c_frz[l] * r
            self.x[l] = self.x[l] - self.lr[l] * coef * u

    def _sent_denominator(self, l: int):
        """In the update space, what layer ``l``'s momentum is divided by before it is sent: the
        frozen denominator, and where the element had no variance at the freeze its layer's RMS
        denominator over the elements that had one (the mean of the other layers' where none had)."""
        if self.space == "update":
            return torch.where(self.v_frozen[l] == 0, self.provisional[l], torch.sqrt(self.v_frozen[l]) + self.eps)
        return 1.0

    def _freeze(self) -> None:
        L = len(self.x)
        self.v_frozen = [v / self._hat(self.b2) for v in self.v]
        self.v_fresh = [v.clone() for v in self.v]
        self.c_frz = [(self.c_avg[l] / (1 - self.cb ** self.c_count[l])) if self.c_count[l] > 0 else 1.0
                      for l in range(L)]
        self.r_prev = [1.0] * L
        rms = []
        for l in range(L):
            had = self.v_frozen[l] != 0
            den = torch.sqrt(self.v_frozen[l][had]) + self.eps
            rms.append(float(torch.sqrt((den * den).mean())) if bool(had.any()) else None)
        defined = [r for r in rms if r is not None]
        fallback = sum(defined) / len(defined) if defined else 1.0
        self.provisional = [fallback if r is None else r for r in rms]
        s = [float((self.m[l] / self._sent_denominator(l)).norm()) / math.sqrt(self.m[l].numel()) for l in range(L)]
        nonzero = [v for v in s if v > 0]
        s_bar = sum(nonzero) / len(nonzero) if nonzero else 0.0
        self.k = [s_bar / v if v > 0 else 1.0 for v in s]
        self.mask = [(v != 0).float() for v in self.v]
        if self.n > 1:
            self.sims = []
            for j in range(self.shards):
                d = sum(shard_of(t, j, self.shards).numel() for t in self.x)
                D = -(-d // (8 * self.n)) * 8 * self.n
                self.sims.append(OneBitAllReduceSim(self.n, D))


class HierarchicalAllReduceSim:
    """The hierarchical 1-bit all-reduce (docs/hierarchy.md) for ``N`` nodes of ``L`` simulated
    workers (worker ``k L + r`` is local rank ``r`` of node ``k``): per node, each chunk ``r`` of
    ``D / L`` elements is summed over the node in local-rank order and divided by ``L``; chunk
    ``r`` of the ``N`` nodes goes through its own ``OneBitAllReduceSim(N, D / L)`` (the ranks of
    local index ``r``); with one node the node average is the result."""

    def __init__(self, N: int, L: int, D: int):
        self.N, self.L, self.D = N, L, D
        self.chunk = D // L
        self.sims = [OneBitAllReduceSim(N, self.chunk) for _ in range(L)] if N > 1 else None

    def __call__(self, buffers: List[torch.Tensor]) -> torch.Tensor:
        N, L, c = self.N, self.L, self.chunk
        out = torch.empty(self.D)
        for r in range(L):
            means = []
            for k in range(N):
                acc = buffers[k * L][r * c:(r + 1) * c].clone()
                for i in range(1, L):
                    acc = acc + buffers[k * L + i][r * c:(r + 1) * c]
                means.append(acc / L)
            out[r * c:(r + 1) * c] = self.sims[r](means) if N > 1 else means[0]
        return out

    def worker_error(self, rank: int) -> torch.Tensor:
        """Rank ``k L + r``'s worker error: ``D / L`` elements, for chunk ``r``."""
        k, r = divmod(rank, self.L)
        return self.sims[r].worker_errors[k] if self.N > 1 else torch.zeros(self.chunk)

    def server_error(self, rank: int) -> torch.Tensor:
        """Rank ``k L + r``'s server error: ``D / n`` elements, piece ``k`` of chunk ``r``."""
        k, r = divmod(rank, self.L)
        return self.sims[r].server_errors[k] if self.N > 1 else torch.zeros(self.chunk)


class ZeroOneReference:
    """0/1 Adam as docs/algorithm.md states it, for ``n`` simulated workers: every worker's
    parameters and momentum are kept (they part between syncs), the variance is shared.

    Steps ``t <= var_freeze_step``: ``t`` a multiple of the variance interval: the mean gradient
    into ``m`` and ``v``; otherwise the 1-bit average of the gradients (each layer scaled by the
    ``k`` of the last variance step, taken from its mean gradient) into ``m``. Then Adam's update.
    After the freeze each worker steps alone and sums ``lr * u``; every ``local interval`` steps
    the sums (times the denominator) go through the 1-bit average, the parameters become the last sync's minus the
    average over the denominator, and the momentum the average over the summed learning rates. An
    element without a variance at the freeze waits (masked) until some worker's gradient reaches
    it; its frozen variance is then the workers' mean square of that step's gradients.

    That is DeepSpeed's rule, ``compression_space="momentum"``. With ``"update"`` (the default) a
    1-bit step averages each worker's momentum ``b1 m + (1-b1) g_i`` instead (``k`` from ``m``),
    and whatever goes through the 1-bit average is also divided by Adam's denominator as it
    stands (and multiplied back after)."""

    def __init__(self, init: List[torch.Tensor], lr: List[float], wd: List[float], *, n: int,
                 var_freeze_step: int, var_update_scaler: int, local_step_scaler: int, local_step_clipper: int,
                 bias_correction: bool = True, betas=(0.9, 0.999), eps=1e-8, compression_space: str = "update"):
        self.n, self.lr, self.wd, self.bc = n, lr, wd, bias_correction
        self.update_space = compression_space == "update"
        self.b1, self.b2 = betas
        self.eps = eps
        self.T, self.kappa, self.scaler, self.clipper = var_freeze_step, var_update_scaler, local_step_scaler, \
            local_step_clipper
        L = len(init)
        self.x = [[t.detach().clone().float() for t in init] for _ in range(n)]
        self.m = [[torch.zeros_like(t) for t in self.x[0]] for _ in range(n)]
        self.v = [torch.zeros_like(t) for t in self.x[0]]
        self.t = self.kv = 0
        self.var_interval, self.var_counter = 1, 0
        self.local_interval, self.local_counter = 1, 0
        self.frozen = False
        self.k = [1.0] * L
        self.mask = [torch.zeros_like(t) for t in self.x[0]]
        d = sum(t.numel() for t in self.x[0])
        self.d, self.D = d, -(-d // (8 * n)) * 8 * n
        self.sim = OneBitAllReduceSim(n, self.D) if n > 1 else None

    def _den(self) -> List[torch.Tensor]:
        """Adam's denominator as the next update uses it: the variance's now, or the frozen one."""
        if self.frozen:
            return self.den
        bc2 = (1 - self.b2 ** self.kv) if self.bc else 1.0
        return [torch.sqrt(v / bc2) + self.eps for v in self.v]

    def _average_1bit(self, per_worker: List[List[torch.Tensor]]) -> List[torch.Tensor]:
        """The 1-bit average of per-layer values, each layer scaled by ``k`` (over the denominator
        in the update space) and masked after."""
        L = len(self.k)
        if self.n == 1:
            out = [t.clone() for t in per_worker[0]]
        else:
            den = self._den()
            scale = [self.k[l] / den[l] if self.update_space else torch.full_like(den[l], self.k[l])
                     for l in range(L)]
            bufs = []
            for w in per_worker:
                b = torch.zeros(self.D)
                b[:self.d] = torch.cat([(scale[l] * w[l]).reshape(-1) for l in range(L)])
                bufs.append(b)
            flat = self.sim(bufs)
            out, off = [], 0
            for l in range(L):
                size = self.x[0][l].numel()
                out.append(flat[off:off + size].reshape(self.x[0][l].shape) / scale[l])
                off += size
        return [out[l] * self.mask[l] for l in range(L)]

    def _norms_sent(self, sent: List[torch.Tensor]) -> List[float]:
        """Each layer's norm of what stands for what is sent, over the denominator in the update space."""
        den = self._den()
        return [float((sent[l] / den[l] if self.update_space else sent[l]).norm()) for l in range(len(den))]

    def _scales(self, values: List[float], numels: List[int]) -> List[float]:
        s = [v / math.sqrt(k) for v, k in zip(values, numels)]
        nonzero = [v for v in s if v > 0]
        s_bar = sum(nonzero) / len(nonzero) if nonzero else 0.0
        return [s_bar / v if v > 0 else 1.0 for v in s]

    def step(self, grads_per_worker: List[List[torch.Tensor]]) -> None:
        self.t += 1
        t, n, L = self.t, self.n, len(self.v)
        b1, b2 = self.b1, self.b2
        bc1 = (1 - b1 ** t) if self.bc else 1.0
        numels = [p.numel() for p in self.x[0]]
        if not self.frozen:
            if t % self.var_interval == 0:
                g = [sum(w[l] for w in grads_per_worker) / n for l in range(L)]
                m = [b1 * self.m[0][l] + (1 - b1) * g[l] for l in range(L)]
                self.v = [b2 * self.v[l] + (1 - b2) * g[l] * g[l] for l in range(L)]
                self.kv += 1
                self.var_counter += 1
                if self.var_counter == self.kappa:
                    self.var_counter, self.var_interval = 0, self.var_interval * 2
                self.k = self._scales(self._norms_sent(m if self.update_space else g), numels)
                self.mask = [(v != 0).float() for v in self.v]
            elif self.update_space:  # each worker's momentum goes through the 1-bit average
                m = self._average_1bit([[b1 * self.m[0][l] + (1 - b1) * w[l] for l in range(L)]
                                        for w in grads_per_worker])
            else:  # DeepSpeed's: the gradients do
                avg = self._average_1bit(grads_per_worker)
                m = [b1 * self.m[0][l] + (1 - b1) * avg[l] for l in range(L)]
            bc2 = (1 - b2 ** self.kv) if self.bc else 1.0
            for i in range(n):
                self.m[i] = [t_.clone() for t_ in m]
                for l in range(L):
                    u = (m[l] / bc1) / (torch.sqrt(self.v[l] / bc2) + self.eps) + self.wd[l] * self.x[i][l]
                    self.x[i][l] = self.x[i][l] - self.lr[l] * u
            if t == self.T:
                self.frozen = True
                self.mask = [(v != 0).float() for v in self.v]
                self.den = [torch.sqrt(v / bc2) + self.eps for v in self.v]
                self.k = self._scales([s * self.lr[l] for l, s in enumerate(self._norms_sent(self.m[0]))], numels)
                if n > 1:
                    self.sim = OneBitAllReduceSim(n, self.D)  # the errors restart
                self.x_sync = [p.clone() for p in self.x[0]]
                self.acc = [[torch.zeros_like(p) for p in self.x[0]] for _ in range(n)]
                self.lrs = [0.0] * L
                self.local_interval, self.local_counter = 1, 0
            return
        for l in range(L):  # elements first reached now: the variance of Adam's first step, the workers' mean square
            reached = sum((w[l] != 0).float() for w in grads_per_worker) > 0
            born = reached & (self.mask[l] == 0)
            if bool(born.any()):
                mean_square = (sum(w[l].double() ** 2 for w in grads_per_worker) / n).float()
                self.den[l] = torch.where(born, torch.sqrt(mean_square) + self.eps, self.den[l])
                self.mask[l] = torch.where(born, torch.ones_like(self.mask[l]), self.mask[l])
        for i in range(n):
            for l in range(L):
                self.m[i][l] = (b1 * self.m[i][l] + (1 - b1) * grads_per_worker[i][l]) * self.mask[l]
                u = (self.m[i][l] / bc1) / self.den[l] + self.wd[l] * self.x[i][l]
                self.acc[i][l] = self.acc[i][l] + self.lr[l] * u
                if t % self.local_interval != 0:
                    self.x[i][l] = self.x[i][l] - self.lr[l] * u
        self.lrs = [self.lrs[l] + self.lr[l] for l in range(L)]
        if t % self.local_interval == 0:
            avg = self._average_1bit([[w[l] * self.den[l] for l in range(L)] for w in self.acc])
            self.x_sync = [self.x_sync[l] - avg[l] / self.den[l] for l in range(L)]
            for i in range(n):
                self.x[i] = [p.clone() for p in self.x_sync]
                self.m[i] = [avg[l] / self.lrs[l] * bc1 for l in range(L)]
            self.acc = [[torch.zeros_like(p) for p in self.x[0]] for _ in range(n)]
            self.lrs = [0.0] * L
        self.local_counter += 1
        if self.local_counter == self.scaler:
            self.local_counter, self.local_interval = 0, min(self.clipper, self.local_interval * 2)


class ZeroOneRescaledReference(ZeroOneReference):
    """``reference.ZeroOneReference`` with the compression errors kept in their unit across a
    variance step (docs/algorithm.md, "Where ZeroOneAdam departs from DeepSpeed's"): a variance step
    changes the scale each element is sent with (``k_l``; over Adam's denominator in the update
    space), and the errors the 1-bit steps left are in the old one. After it each error is
    multiplied by its element's new scale over its old (an element whose scale is 0 or not finite
    keeps its error, as does a masked one: it sends nothing), the padding by the mean of those ratios."""

    def _sent_scale(self) -> torch.Tensor:
        den = self._den()
        return torch.cat([((self.k[l] / den[l] if self.update_space else torch.full_like(den[l], self.k[l]))
                           * self.mask[l]).reshape(-1) for l in range(len(self.k))])

    def step(self, grads_per_worker):
        variance_step = self.n > 1 and not self.frozen and (self.t + 1) % self.var_interval == 0
        before = self._sent_scale() if variance_step else None
        super().step(grads_per_worker)
        if before is None:
            return
        after = self._sent_scale()
        kept = torch.isfinite(before) & torch.isfinite(after) & (before != 0) & (after != 0)
        ratio = torch.where(kept, after / torch.where(kept, before, torch.ones_like(before)), torch.ones_like(after))
        pad = float(ratio[kept].mean()) if bool(kept.any()) else 1.0
        full = torch.cat([ratio, torch.full((self.D - self.d,), pad)])
        chunk = self.D // self.n
        self.sim.worker_errors = [e * full for e in self.sim.worker_errors]
        self.sim.server_errors = [e * full[j * chunk:(j + 1) * chunk] for j, e in enumerate(self.sim.server_errors)]
