"""DeepSpeed's own 1-bit optimizers, run unmodified on CPU and gloo (``tests/test_deepspeed_code.py``).

DeepSpeed is not a dependency: ``make`` downloads its pinned sdist (``deepspeed-0.19.6.tar.gz``,
checked here against its sha256) into ``.venv/deepspeed/``, and ``load()`` executes, from that
archive, the text of the files the optimizers need:

- ``deepspeed/runtime/fp16/onebit/zoadam.py``, ``adam.py``, ``lamb.py`` (the optimizers),
- ``deepspeed/runtime/comm/nccl.py`` (``NcclBackend.compressed_allreduce``, their 1-bit all-reduce),
- ``deepspeed/runtime/comm/utils.py``, ``deepspeed/runtime/compression/cupy.py``,
  ``deepspeed/utils/torch.py``, and ``filter_empty_parameters`` of ``deepspeed/runtime/utils.py``.

Nothing of that text is copied here or edited. What this module supplies instead is the smallest
set of stand-ins for what those files import and call on a GPU machine:

- ``deepspeed.comm``: the ``torch.distributed`` functions of the same names (gloo here);
- ``deepspeed.accelerator.get_accelerator()``: a CPU accelerator (``empty_cache`` does nothing,
  every device name is ``"cpu"``);
- ``cupy``: the few calls ``nccl.py`` and ``compression/cupy.py`` make (``packbits``,
  ``unpackbits``, ``split``, ``zeros``, ``from_dlpack``, ``cuda.Device(i).use()``, a stream's
  ``synchronize()``), on numpy arrays that share memory with the torch tensors as cupy's do
  through DLPack (``all_gather`` writes into views of a cupy buffer that is read afterwards);
- ``Engine``: the attributes the optimizers read from the DeepSpeed engine (``mpu``,
  ``local_rank``, ``enable_backward_allreduce``) and the engine's gradient average when that flag
  is set (``allreduce_gradients``: each gradient times ``1/n``, then summed, as
  ``DeepSpeedEngine.allreduce_bucket`` does by default).

``load()`` puts these modules in ``sys.modules``: call it in a worker process, not in pytest's.
"""
from __future__ import annotations

import ast
import contextlib
import hashlib
import io
import os
import sys
import tarfile
import types
from pathlib import Path
from typing import Dict, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

VERSION = "0.19.6"
SDIST = f"deepspeed-{VERSION}.tar.gz"
SHA256 = "31593acffbe4794c74446094122b1bc29d8c73a137e37aff899ca4a6480df2d8"  # PyPI's file
ROOT = Path(__file__).resolve().parent.parent
# where `make` puts it (the Makefile's $(STAMP) recipe); ONEBITLAMB_DEEPSPEED_SDIST names another copy
DEFAULT_PATH = ROOT / ".venv" / "deepspeed" / SDIST

FILES = ("deepspeed/utils/torch.py", "deepspeed/runtime/comm/utils.py", "deepspeed/runtime/compression/cupy.py",
         "deepspeed/runtime/comm/nccl.py", "deepspeed/runtime/fp16/onebit/zoadam.py",
         "deepspeed/runtime/fp16/onebit/adam.py", "deepspeed/runtime/fp16/onebit/lamb.py",
         "deepspeed/runtime/utils.py")


def sdist_path() -> Path:
    return Path(os.environ.get("ONEBITLAMB_DEEPSPEED_SDIST", DEFAULT_PATH))


def availability() -> Tuple[Optional[str], bool]:
    """``(None, False)`` when DeepSpeed's code can run here, else why not and whether that is a
    failure rather than a reason to skip: a file that is not the pinned sdist, or no file where
    ``make`` asked for it (``ONEBITLAMB_REQUIRE_DEEPSPEED=1``, set by ``make test``)."""
    path = sdist_path()
    if not path.is_file():
        return (f"DeepSpeed {VERSION}'s sdist is not at {path}: `make test` downloads it (the Makefile's "
                f"`pip download ... deepspeed=={VERSION}` step); run through make, or set "
                f"ONEBITLAMB_DEEPSPEED_SDIST to a copy", os.environ.get("ONEBITLAMB_REQUIRE_DEEPSPEED") == "1")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != SHA256:
        return f"{path} has sha256 {digest}, not DeepSpeed {VERSION}'s sdist ({SHA256})", True
    return None, False


def read_sources(path: Optional[Path] = None) -> Dict[str, str]:
    """The text of ``FILES`` from the sdist, by their path inside the package."""
    out = {}
    with tarfile.open(path or sdist_path()) as tar:
        for name in FILES:
            member = tar.extractfile(f"deepspeed-{VERSION}/{name}")
            out[name] = member.read().decode()
    return out


# ---------------------------------------------------------------- stand-ins
class _CpuAccelerator:
    """``get_accelerator()`` on a machine whose device is the CPU."""

    def empty_cache(self) -> None:
        pass

    def device_name(self, index=None) -> str:
        return "cpu"

    def current_device_name(self) -> str:
        return "cpu"


def _cupy() -> types.ModuleType:
    """The cupy calls of ``nccl.py`` and ``compression/cupy.py``, on numpy. ``from_dlpack`` is given
    a DLPack capsule made by ``torch.utils.dlpack.to_dlpack`` and returns an array sharing that
    tensor's memory; numpy arrays export DLPack themselves for the way back."""
    cupy = types.ModuleType("cupy")
    cupy.packbits, cupy.unpackbits, cupy.split, cupy.zeros = np.packbits, np.unpackbits, np.split, np.zeros
    cupy.from_dlpack = lambda capsule: torch.utils.dlpack.from_dlpack(capsule).numpy()

    class Device:
        def __init__(self, index=None):
            pass

        def use(self):
            pass

    stream = types.SimpleNamespace(synchronize=lambda: None)
    cupy.cuda = types.SimpleNamespace(Device=Device, get_current_stream=lambda: stream)
    return cupy


def _comm() -> types.ModuleType:
    """``deepspeed.comm`` over ``torch.distributed``: the functions the files call, by the same names."""
    comm = types.ModuleType("deepspeed.comm")
    for name in ("is_initialized", "get_rank", "get_world_size", "new_group", "all_to_all_single", "all_reduce",
                 "barrier", "send", "recv", "isend", "irecv"):
        setattr(comm, name, getattr(dist, name))

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        # NCCL takes outputs of the input's number of elements whatever their shape (``nccl.py`` gathers
        # its 0-d scales into tensors of shape (1,)); gloo wants the input's shape: views of that shape
        views = [t.view(tensor.shape) if t.numel() == tensor.numel() else t for t in tensor_list]
        return dist.all_gather(views, tensor, group=group, async_op=async_op)

    comm.all_gather = all_gather
    return comm


class Engine:
    """What the optimizers read from (and write to) the DeepSpeed engine, and the engine's part of a
    step: the gradients averaged when ``enable_backward_allreduce`` is set (the engine's default,
    and what 0/1 Adam and 1-bit Adam switch off and on)."""

    def __init__(self, local_rank: int = 0) -> None:
        self.mpu = None
        self.local_rank = local_rank
        self.enable_backward_allreduce = True

    def allreduce_gradients(self, params) -> None:
        if not self.enable_backward_allreduce:
            return
        grads = [p.grad for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        flat.mul_(1.0 / dist.get_world_size())
        dist.all_reduce(flat)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def _module(name: str, **attrs) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    return mod


def _exec(name: str, path: str, text: str) -> types.ModuleType:
    """Module ``name`` from the sdist's text, registered before it runs (as an import would)."""
    mod = _module(name, __file__=f"{SDIST}/{path}")
    sys.modules[name] = mod
    exec(compile(text, mod.__file__, "exec"), mod.__dict__)
    return mod


def _function_of(text: str, name: str, path: str) -> types.FunctionType:
    """One top-level function of a module's text, executed on its own (``runtime/utils.py`` imports
    half of DeepSpeed; ``lamb.py`` needs one function of it, which needs nothing)."""
    (node,) = [n for n in ast.parse(text).body if isinstance(n, ast.FunctionDef) and n.name == name]
    source = ast.get_source_segment(text, node)
    namespace: Dict[str, object] = {}
    exec(compile(source, f"{SDIST}/{path}", "exec"), namespace)
    return namespace[name]


def load(path: Optional[Path] = None) -> types.SimpleNamespace:
    """DeepSpeed's ``ZeroOneAdam``, ``OnebitAdam``, ``OnebitLamb`` and ``NcclBackend``, from the
    sdist's text, with the stand-ins above in ``sys.modules``."""
    src = read_sources(path)
    packages = ["deepspeed", "deepspeed.utils", "deepspeed.runtime", "deepspeed.runtime.comm",
                "deepspeed.runtime.compression", "deepspeed.runtime.fp16", "deepspeed.runtime.fp16.onebit"]
    for name in packages:
        sys.modules[name] = _module(name, __path__=[])
    sys.modules["cupy"] = _cupy()
    sys.modules["deepspeed.comm"] = _comm()
    accelerator = _CpuAccelerator()
    sys.modules["deepspeed.accelerator"] = _module("deepspeed.accelerator", get_accelerator=lambda: accelerator)
    rt_utils = "deepspeed/runtime/utils.py"
    sys.modules["deepspeed.runtime.utils"] = _module(
        "deepspeed.runtime.utils",
        filter_empty_parameters=_function_of(src[rt_utils], "filter_empty_parameters", rt_utils))
    mods = {}
    for path_ in FILES:
        if path_ == rt_utils:
            continue
        name = path_[:-3].replace("/", ".")
        mods[name] = _exec(name, path_, src[path_])
    for name, mod in list(sys.modules.items()):  # `from deepspeed import comm`: attributes of the parents
        if name.startswith("deepspeed.") and mod is not None:
            parent, _, leaf = name.rpartition(".")
            if parent in sys.modules:
                setattr(sys.modules[parent], leaf, mod)
    onebit = "deepspeed.runtime.fp16.onebit."
    return types.SimpleNamespace(ZeroOneAdam=mods[onebit + "zoadam"].ZeroOneAdam,
                                 OnebitAdam=mods[onebit + "adam"].OnebitAdam,
                                 OnebitLamb=mods[onebit + "lamb"].OnebitLamb,
                                 NcclBackend=mods["deepspeed.runtime.comm.nccl"].NcclBackend)


@contextlib.contextmanager
def quiet():
    """DeepSpeed's optimizers print at their first steps; keep the workers' output clean."""
    with contextlib.redirect_stdout(io.StringIO()):
        yield
