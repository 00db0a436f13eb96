"""How fast the 1-bit compression kernels are, measured against a memory copy; and what the
compressed all-reduce saves against a plain fp32 all-reduce on local gloo ranks.

    python -m benchmarks.kernels [--quick] [--results PATH]      # from the repository root

Part 1, kernels, one thread (``torch.set_num_threads(1)``), fp32, best of several repeats. The
yardstick is ``out.copy_(src)`` into a preallocated ``out`` (one read and one write of the
buffer): every kernel here is memory bound, so its cost is best read as a multiple of a copy.

- compress: ``compression.onebit.compress_(error, buffer, packed, workspace)``, the worker's whole compression
  step (error add, scale, sign, error update, pack);
- decompress: ``unpack_signs(packed, numel, scale, out=out)`` into a preallocated ``out``;
- whole compute of one rank for n = 4: everything ``compressed_allreduce`` computes, without the
  collectives, composed from the same internal functions in the same order: compress the buffer
  (``D`` elements); decode the ``n`` received ``D/(8n)``-byte chunks, each scaled by ``s_i/n``, and
  add them to the server error (``D/n``); compress the server error; expand the ``n`` gathered
  chunks into the buffer. The packed signs this rank sent stand in for the bytes it would have
  received (same sizes, same kind of content), so no collective runs.

Targets at 32M elements: compress within 4x, decompress within 1.5x, the whole compute within
6x of the copy.

Part 2, the compressed all-reduce (``compressed_allreduce``) against the fp32 all-reduce
(``allreduce_mean_``: one ``dist.all_reduce`` and a division) on 4 local gloo ranks (spawned by
``spawn_local``, one thread each): median wall time per call, each call's time being the slowest
rank's, and the bytes each rank sends per call as recorded by ``CommStats``. On loopback the
network is a memory copy, so the time ratio here says little about a real network; the bytes
ratio is the point.

The results go to the ``kernels`` section of BENCHMARKS.md (``report.write_section``).

With ``--device cuda``: part 1 only, on the GPU, timed with a device synchronisation after each
call, at 64M to 1G elements, for each codec: the plain-torch path of the same functions
(``fused=False``) and the fused Triton kernels (``fused=True``, where Triton imports), into the
``kernels-cuda`` section, with the targets of the fused codec (compress <= 2 copies, decompress
<= 1, whole <= 5) and the floors its memory traffic sets (``compression.triton_codec``).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
import traceback
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import torch

from benchmarks.report import command_line, heading, table_row, write_section

MB = 1 << 20
FULL_SIZES = [1 * MB, 4 * MB, 16 * MB, 32 * MB, 64 * MB]
QUICK_SIZES = [64 * 1024, 256 * 1024]
FULL_ALLREDUCE_SIZES = [1 * MB, 16 * MB]
QUICK_ALLREDUCE_SIZES = [64 * 1024]
CUDA_SIZES = [64 * MB, 256 * MB, 1024 * MB]
WORLD_SIZE = 4
TARGET_SIZE = 32 * MB
TARGETS = {"compress": 4.0, "decompress": 1.5, "whole": 6.0}
# The fused codec's targets on an H200 and the floors of its memory traffic, in copies (8 bytes
# an element): compress reads error and buffer twice and writes the error once (20 bytes); the
# expansion writes 4 bytes and reads 1/8; the whole, for n = 4: 20 + the server's sum (8/n + 1/8)
# and compress (8/n + 1/8) + the expansion (4 + 1/8).
FUSED_TARGETS = {"compress": 2.0, "decompress": 1.0, "whole": 5.0}
FUSED_FLOORS = {"compress": 20 / 8, "decompress": 4.125 / 8, "whole": (20 + 2 * (8 / WORLD_SIZE + 0.125) + 4.125) / 8}


def best_times(fns: Dict[str, Callable[[], object]], repeats: int, min_total_s: float,
               sync: Callable[[], None] = lambda: None) -> Dict[str, float]:
    """The fastest run of each function, over at least ``repeats`` rounds (more while a round's
    runs total under ``min_total_s`` in all, up to 100 rounds), after one warm-up round. Each round
    runs every function once, so a burst of load from other processes hits all of them alike and
    their ratios stay fair. ``sync`` waits for queued device work (CUDA runs asynchronously)."""
    for fn in fns.values():
        fn()
    sync()
    times: Dict[str, List[float]] = {name: [] for name in fns}
    total, rounds = 0.0, 0
    while rounds < repeats or (total < min_total_s and rounds < 100):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            sync()
            elapsed = time.perf_counter() - t0
            times[name].append(elapsed)
            total += elapsed
        rounds += 1
    return {name: min(t) for name, t in times.items()}


def kernel_times(numel: int, n: int, repeats: int, min_total_s: float = 2.0,
                 device: str = "cpu", fused: Optional[bool] = None) -> Dict[str, float]:
    """Seconds for the copy, compress, decompress and whole per-rank compute on ``numel`` fp32,
    with the codec ``fused`` picks (as ``compressed_allreduce`` takes it).

    The whole compute follows ``compressed_allreduce`` step by step, message layout included
    (sign rows with a trailing scale), with the packed signs this rank sent standing in for the
    messages it would receive."""
    from onebitlamb.compression.onebit import add_signs_, compress_, read_scales, scale_bytes
    from onebitlamb.compression.packing import fused_codec, unpack_signs

    if numel % (8 * n):
        raise ValueError(f"numel must be a multiple of 8n = {8 * n}, got {numel}")
    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(0)  # drawn where it is used: 1G values on a CPU take seconds
    src = torch.randn(numel, generator=g, device=dev)
    out = torch.empty(numel, device=dev)
    packed = torch.empty(numel // 8, dtype=torch.uint8, device=dev)
    error = torch.zeros(numel, device=dev)
    chunk = numel // n
    row = chunk // 8
    buffer = src.clone()
    worker_error = torch.zeros(numel, device=dev)
    server_error = torch.zeros(chunk, device=dev)
    messages = torch.empty(n, row + 4, dtype=torch.uint8, device=dev)  # stands in for both collectives'
    server = torch.empty(row + 4, dtype=torch.uint8, device=dev)         # received rows
    ws: Dict[str, torch.Tensor] = {}
    codec = fused_codec(buffer, fused)
    fused = codec is not None

    def server_accumulate(scales: torch.Tensor):
        return add_signs_(server_error, messages[:, :row], scales / n, fused)

    def whole() -> None:
        s = compress_(worker_error, buffer, packed, ws, fused=fused)
        messages[:, :row].copy_(packed.view(n, row))
        messages[:, row:].copy_(scale_bytes(s, dev))
        sum_sq = server_accumulate(read_scales(messages, row))
        s_server = compress_(server_error, None, server[:row], ws, sum_sq, fused)
        server[row:].copy_(scale_bytes(s_server, dev))
        scales = read_scales(messages, row)
        if codec is not None:
            codec.expand_(messages, scales, buffer, chunk)
            return
        host_scales = scales.tolist() if dev.type == "cpu" else scales
        for j in range(n):
            unpack_signs(messages[j, :row], chunk, host_scales[j], out=buffer[j * chunk:(j + 1) * chunk])

    fixed_scales = torch.full((n,), 1e-3, device=dev)
    times = best_times({
        "copy": lambda: out.copy_(src),
        "compress": lambda: compress_(error, src, packed, ws, fused=fused),
        "decompress": lambda: unpack_signs(packed, numel, 0.5, out=out, fused=fused),
        "whole": whole,
        "server_accumulate": lambda: server_accumulate(fixed_scales),
    }, repeats, min_total_s, sync=torch.cuda.synchronize if dev.type == "cuda" else (lambda: None))
    del src, out, packed, error, buffer, worker_error
    return times


def _allreduce_worker(rank: int, world_size: int, sizes: Sequence[int], iters: int) -> dict:
    """On each rank: per-call times and bytes of both all-reduces, for every size."""
    import torch.distributed as dist

    from onebitlamb.comm import CommStats, allreduce_mean_, compressed_allreduce

    out = {}
    for numel in sizes:
        g = torch.Generator().manual_seed(rank)
        src = torch.randn(numel, generator=g)
        buf = src.clone()
        worker_error, server_error = torch.zeros(numel), torch.zeros(numel // world_size)
        calls = {
            "fp32": lambda: allreduce_mean_(buf, stats=stats),
            "1bit": lambda: compressed_allreduce(buf, worker_error, server_error, stats=stats),
        }
        for name, call in calls.items():
            stats = CommStats()
            buf.copy_(src)
            call()  # warm-up: connections, workspaces
            stats.reset()
            times = []
            for _ in range(iters):
                buf.copy_(src)
                dist.barrier()
                t0 = time.perf_counter()
                call()
                times.append(time.perf_counter() - t0)
            out[(numel, name)] = dict(times=times, bytes=stats.bytes_sent / iters)
    return out


def allreduce_results(sizes: Sequence[int], iters: int, world_size: int = WORLD_SIZE) -> Dict:
    from onebitlamb.comm.launch import spawn_local

    per_rank = spawn_local(_allreduce_worker, world_size, args=(list(sizes), iters), timeout_s=600)
    results = {}
    for key in per_rank[0]:
        slowest = [max(r[key]["times"][k] for r in per_rank) for k in range(iters)]
        results[key] = dict(median_s=statistics.median(slowest), bytes=per_rank[0][key]["bytes"])
    return results


def _size_label(numel: int) -> str:
    return f"{numel // MB}M" if numel % MB == 0 else f"{numel // 1024}K"


def _progress(label: str, t: Dict[str, float]) -> None:
    print(f"{label}: copy {t['copy'] * 1e3:.3f} ms, compress {t['compress'] / t['copy']:.2f}x, decompress "
          f"{t['decompress'] / t['copy']:.2f}x, whole {t['whole'] / t['copy']:.2f}x", flush=True)


def _verdict(name: str, t: Dict[str, float], target: float) -> str:
    ratio = t[name] / t["copy"]
    return f"{name} {ratio:.2f}x (target <= {target:g}x: {'met' if ratio <= target else 'MISSED'}"


def _ratio_table(kernels: Dict[int, Dict[str, float]], bandwidth: bool = False) -> List[str]:
    """Markdown rows: each kernel's time as a multiple of the copy (and the copy's bandwidth)."""
    columns = ["elements", "copy (ms)"] + (["copy GB/s"] if bandwidth else []) + [
        "compress (x copy)", "decompress (x copy)", "whole, n=4 (x copy)", "of which server decode+add (x copy)"]
    rows = [table_row(columns), "|" + "---:|" * len(columns)]
    for numel, t in kernels.items():
        c = t["copy"]
        cells = [_size_label(numel), f"{c * 1e3:.3f}"] + ([f"{8 * numel / c / 1e9:,.0f}"] if bandwidth else [])
        cells += [f"{t[k] / c:.2f}" for k in ("compress", "decompress", "whole", "server_accumulate")]
        rows.append(table_row(cells))
    return rows


def _cpu_path() -> str:
    from onebitlamb.compression import native

    if native.load() is not None:
        return "the fused C loops of `onebitlamb/compression/_native.c` (built with gcc on first use)"
    return f"numpy, sliced to stay in cache (the compiled loops are {native.LIBRARY.unavailable_reason})"


def render(kernels: Dict[int, Dict[str, float]], allreduce: Dict, command: str, repeats: int,
           iters: int) -> str:
    lines = [
        *heading("Kernels: 1-bit compression against a memory copy", command,
                 f", {os.cpu_count()} cores, load average at the end {os.getloadavg()[0]:.1f} (other work "
                 "shares the cores; best-of timings filter most of it)"),
        f"CPU loops: {_cpu_path()}.",
        "",
        f"One thread, fp32, best of at least {repeats} interleaved rounds. Each kernel's time is given as a "
        "multiple of `out.copy_(src)` on the same number of elements. *Whole* is everything one "
        f"rank of an n = {WORLD_SIZE} compressed all-reduce computes (compress, server decode and "
        "accumulate, server compress, final expansion), without the collectives; the last column "
        "is its server decode-and-accumulate part (for each byte position, the n ranks' bytes "
        "select rows of 8 signed scales from per-rank tables, summed in registers; it also yields "
        "the server compressor's norm).",
        "",
        *_ratio_table(kernels),
        "",
    ]
    if TARGET_SIZE in kernels:
        verdicts = [_verdict(name, kernels[TARGET_SIZE], target) + ")" for name, target in TARGETS.items()]
        lines.append(f"Targets at {_size_label(TARGET_SIZE)}: " + "; ".join(verdicts) + ".")
    else:
        lines.append(f"Targets at {_size_label(TARGET_SIZE)} (not measured in this run): "
                     + ", ".join(f"{k} <= {v:g}x" for k, v in TARGETS.items()) + ".")
    lines += [
        "",
        f"### Compressed all-reduce against fp32 all-reduce, {WORLD_SIZE} local gloo ranks",
        "",
        f"Median over {iters} calls of the slowest rank's time per call; bytes this rank sends per "
        "call, from `CommStats`. Loopback makes the network a memory copy, so the time ratio "
        "understates what a real network gains; the bytes ratio is the point.",
        "",
        "| elements | fp32 all-reduce (ms) | fp32 bytes/call | 1-bit (ms) | 1-bit bytes/call "
        "| time fp32/1-bit | bytes fp32/1-bit |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for numel in sorted({k[0] for k in allreduce}):
        f, b = allreduce[(numel, "fp32")], allreduce[(numel, "1bit")]
        lines.append(f"| {_size_label(numel)} | {f['median_s'] * 1e3:.1f} | {f['bytes']:,.0f} | "
                     f"{b['median_s'] * 1e3:.1f} | {b['bytes']:,.0f} | "
                     f"{f['median_s'] / b['median_s']:.2f} | {f['bytes'] / b['bytes']:.2f} |")
    return "\n".join(lines) + "\n"


def render_device(kernels: Dict[str, Dict[int, Dict[str, float]]], command: str, repeats: int,
                  device_name: str, missing: Optional[str]) -> str:
    """The ``kernels-cuda`` section: a table per codec (``kernels[codec][numel]``), the fused
    codec's targets and floors. ``missing``: why the fused codec was not measured, if it was not."""
    lines = [
        *heading("Kernels on a GPU: 1-bit compression against a memory copy", command, f", {device_name}"),
        f"fp32, best of at least {repeats} interleaved rounds, each call followed by a device synchronisation. "
        "Columns as in the CPU table: multiples of `out.copy_(src)` on the same number of elements; the copy's "
        "bandwidth counts the bytes read and written.",
        "",
        "### Plain torch (`fused=False`)",
        "",
        "Eager torch runs each step as its own kernel, a full pass over memory each (`compress_torch_`: add, "
        "norm, compare, pack by weighted sum, error update; expansion and server sum by testing bits and "
        "selecting `±scale`).",
        "",
        *_ratio_table(kernels["torch"], bandwidth=True),
        "",
        "### Fused Triton kernels (`fused=True`, `onebitlamb/compression/triton_codec.py`)",
        "",
    ]
    if "fused" not in kernels:
        lines.append(f"Not measured: {missing}.")
        return "\n".join(lines) + "\n"
    lines += [
        "Compress in two passes (norm, then sign, pack and error update), the server's sum with its norm in "
        "one, every gathered row expanded in one launch. Floors set by the bytes moved, in copies: "
        + ", ".join(f"{k} {v:.2f}x" for k, v in FUSED_FLOORS.items()) + ".",
        "",
        *_ratio_table(kernels["fused"], bandwidth=True),
        "",
    ]
    for numel, t in kernels["fused"].items():
        verdicts = [_verdict(name, t, target) + f"; floor {FUSED_FLOORS[name]:.2f}x)"
                    for name, target in FUSED_TARGETS.items()]
        speedup = kernels["torch"][numel]["whole"] / t["whole"]
        lines.append(f"- {_size_label(numel)}: " + "; ".join(verdicts) + f"; whole {speedup:.1f}x faster than plain torch.")
    return "\n".join(lines) + "\n"


def device_kernels(device: str, sizes: Sequence[int], repeats: int, min_total_s: float):
    """Each codec's kernel times at each size (``{codec: {numel: times}}``), and why the fused one
    is missing when it is."""
    from onebitlamb.compression.packing import fused_codec

    kernels: Dict[str, Dict[int, Dict[str, float]]] = {"torch": {}}
    missing = None
    try:
        fused_codec(torch.empty(0, device=device), True)
        kernels["fused"] = {}
    except ValueError as exc:
        missing = str(exc)
    for numel in sizes:
        for codec in list(kernels):
            try:
                kernels[codec][numel] = t = kernel_times(numel, WORLD_SIZE, repeats, min_total_s, device,
                                                         fused=codec == "fused")
            except Exception as exc:  # noqa: BLE001 (a fused kernel that fails must not cost the torch figures)
                if codec != "fused":
                    raise
                traceback.print_exc()
                missing = f"the fused kernels failed at {_size_label(numel)} elements: {exc!r}"[:400]
                del kernels["fused"]
                continue
            finally:
                if device == "cuda":
                    torch.cuda.empty_cache()
            _progress(f"{_size_label(numel):>5} {codec:>5}", t)
    return kernels, missing


def main(argv: Optional[Sequence[str]] = None) -> str:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kernels", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes, a smoke test")
    parser.add_argument("--results", type=Path, default=None,
                        help="markdown file to write the section into (default: BENCHMARKS.md)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cuda: the kernels on the GPU, into the kernels-cuda section")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here")
    command = command_line(argv, "python -m benchmarks.kernels")

    sizes = QUICK_SIZES if args.quick else FULL_SIZES
    repeats = 3 if args.quick else 9
    iters = 3 if args.quick else 10
    if args.device == "cuda":
        kernels, missing = device_kernels("cuda", QUICK_SIZES if args.quick else CUDA_SIZES, repeats,
                                          0.01 if args.quick else 0.5)
        body = render_device(kernels, command, repeats, torch.cuda.get_device_name(), missing)
        path = write_section("kernels-cuda", body, args.results)
        print(body)
        print(f"written to {path}")
        return body
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        kernels = {}
        for numel in sizes:
            kernels[numel] = kernel_times(numel, WORLD_SIZE, repeats, 0.01 if args.quick else 4.0)
            _progress(f"{_size_label(numel):>5}", kernels[numel])
        allreduce = allreduce_results(QUICK_ALLREDUCE_SIZES if args.quick else FULL_ALLREDUCE_SIZES, iters)
        body = render(kernels, allreduce, command, repeats, iters)
    finally:
        torch.set_num_threads(previous_threads)
    path = write_section("kernels", body, args.results)
    print(body)
    print(f"written to {path}")
    return body


if __name__ == "__main__":
    main()
