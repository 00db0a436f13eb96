"""Why the 1-bit optimizers refuse FSDP2 and ZeRO: the bytes each rank sends per step, counted.

Under FSDP2 (``fully_shard``) the parameters are gathered for the forward and again for the
backward, and the gradients reduce-scattered: the optimizer's exchange could replace the last
only. Under DDP with ``register_ddp`` the 1-bit momentum is, after the freeze, the only traffic.
Two gloo ranks on loopback; FSDP's collectives are counted where it calls them, the optimizer's by
its ``comm_stats``. Per-rank wire bytes use the ring formulas of ``onebitlamb.comm.stats``.

    python -m benchmarks.sharded
"""
from __future__ import annotations

import argparse
from typing import Optional, Sequence

import torch
import torch.distributed as dist

import onebitlamb
from benchmarks import report
from onebitlamb.comm.launch import spawn_local

WIDTH, LAYERS, FREEZE, STEPS = 256, 4, 2, 4


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])


def _step(model, opt, rank, step) -> None:
    x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(100 * step + rank))
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()


def _fsdp_bytes(rank: int, n: int) -> int:
    """One FSDP2 step's bytes sent by this rank (AdamW: its state is sharded, it sends nothing)."""
    from torch.distributed.fsdp import fully_shard

    model = _model()
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sent = [0]
    for name in ("all_gather_single", "reduce_scatter_single", "all_reduce"):
        real = getattr(dist, name)

        def counted(*args, _real=real, **kwargs):
            tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
            whole = max(t.numel() * t.element_size() for t in tensors)  # the gathered / scattered buffer
            sent[0] += (n - 1) * whole // n
            return _real(*args, **kwargs)

        setattr(dist, name, counted)
    _step(model, opt, rank, 0)  # the first step allocates; count the second
    sent[0] = 0
    _step(model, opt, rank, 1)
    return sent[0]


def _ddp_bytes(rank: int, n: int) -> tuple:
    """The warm-up's and the compression stage's bytes per step under DDP + register_ddp."""
    model = torch.nn.parallel.DistributedDataParallel(_model())
    opt = onebitlamb.OneBitLamb(model.parameters(), lr=1e-3, freeze_step=FREEZE)
    onebitlamb.register_ddp(model, opt)
    per_step = []
    for step in range(STEPS):
        before = opt.comm_stats.bytes_sent
        _step(model, opt, rank, step)
        per_step.append(opt.comm_stats.bytes_sent - before)
    return per_step[0], per_step[-1]


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sharded", description=__doc__.splitlines()[0])
    parser.add_argument("--no-write", action="store_true", help="print only; write no file")
    args = parser.parse_args(argv)
    fsdp = spawn_local(_fsdp_bytes, 2, (), timeout_s=300, collective_timeout_s=120)[0]
    warmup, compression = spawn_local(_ddp_bytes, 2, (), timeout_s=300, collective_timeout_s=120)[0]
    params = LAYERS * (WIDTH * WIDTH + WIDTH)
    lines = report.heading("Sharded training", report.command_line(argv),
                           "; 2 gloo ranks on loopback") + [
        f"Bytes one rank sends per step for a model of {params:,} fp32 parameters ({LAYERS} linear layers of "
        f"{WIDTH}), counted: FSDP2's collectives where it calls them, the optimizer's by its `comm_stats`.",
        "",
        report.table_row(["setup", "bytes per step", "against DDP + 1-bit LAMB after the freeze"]),
        report.table_row(["---", "---:", "---:"]),
    ]
    for name, nbytes in (("FSDP2 (`fully_shard`), AdamW", fsdp),
                         ("DDP + `register_ddp`, 1-bit LAMB, warm-up", warmup),
                         ("DDP + `register_ddp`, 1-bit LAMB, after the freeze", compression)):
        lines.append(report.table_row([name, f"{nbytes:,}", f"{nbytes / compression:.1f}x"]))
    lines += ["", "FSDP's parameter all-gathers alone are two thirds of its traffic: a 1-bit exchange in place "
              "of its gradient reduce-scatter would leave them, so the optimizers refuse sharded parameters "
              "(and a ZeroRedundancyOptimizer's share of them) with an error that names DDP + `register_ddp`."]
    body = "\n".join(lines)
    print(body)
    if not args.no_write:
        report.write_section("sharded", body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
