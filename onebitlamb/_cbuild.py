"""Plain C files of the package, compiled with gcc on first use and loaded through ctypes.

Why this way: a C file that needs no Python or torch headers builds with any gcc, at run time,
with no build step at install; a machine without a compiler keeps the torch/numpy path, which
computes the same values. Used by the codec (``compression/_native.c``) and by 1-bit LAMB's
stage-2 loop (``optim/_native.c``).

Each library is built with ``gcc -O3`` into ``$ONEBITLAMB_CACHE`` (default ``~/.cache/onebitlamb``)
under a name that holds the machine type and a hash of the source and flags, and is renamed into
place atomically, so concurrent workers never load a half-written file. ``ONEBITLAMB_NATIVE=0``
turns every library off; a failed build (no compiler, a read-only cache) leaves the fallback.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path
from typing import Callable, Optional

# -fno-math-errno lets sqrtf vectorise; -ffp-contract=off keeps a*b+c two roundings everywhere,
# so a build with FMA instructions (the avx2 clones) computes the same bits as one without: ranks
# on different machines must not drift apart.
FLAGS = ("-O3", "-shared", "-fPIC", "-fno-math-errno", "-ffp-contract=off")

F32P = ctypes.POINTER(ctypes.c_float)
F64P = ctypes.POINTER(ctypes.c_double)
U8P = ctypes.POINTER(ctypes.c_uint8)
I64P = ctypes.POINTER(ctypes.c_int64)
I64 = ctypes.c_int64


def cache_dir() -> Path:
    return Path(os.environ.get("ONEBITLAMB_CACHE") or Path.home() / ".cache" / "onebitlamb")


def _build(source: Path, target: Path) -> None:
    compiler = shutil.which(os.environ.get("CC", "gcc")) or shutil.which("cc")
    if compiler is None:
        raise OSError("no C compiler (gcc or cc) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *FLAGS, "-o", tmp, str(source), "-lm"],
                       check=True, capture_output=True, text=True, timeout=120)
        os.replace(tmp, target)  # atomic: a concurrent worker sees the old name or the whole file
    except subprocess.CalledProcessError as exc:
        raise OSError(f"{compiler} failed: {exc.stderr.strip()[-500:]}") from exc
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


class CLibrary:
    """One C source of the package: ``load()`` builds it once per process (and once per machine
    and source version in the cache) and returns the library with its signatures declared by
    ``declare``, or None, with ``unavailable_reason`` saying why."""

    def __init__(self, source: Path, declare: Callable[[ctypes.CDLL], None]) -> None:
        self.source = source
        self.declare = declare
        self.unavailable_reason: Optional[str] = None
        self._lib: Optional[ctypes.CDLL] = None
        self._tried = False

    def forget(self) -> None:
        """Try again at the next ``load()`` (the environment may have changed)."""
        self._lib, self._tried, self.unavailable_reason = None, False, None

    def load(self) -> Optional[ctypes.CDLL]:
        if self._tried:
            return self._lib
        self._tried = True
        if os.environ.get("ONEBITLAMB_NATIVE", "1") == "0":
            self.unavailable_reason = "turned off by ONEBITLAMB_NATIVE=0"
            return None
        digest = hashlib.sha256(self.source.read_bytes() + " ".join(FLAGS).encode()).hexdigest()[:16]
        # a home folder shared by machines of different kinds must not hand one the other's build
        target = cache_dir() / f"onebitlamb_{self.source.parent.name}_{platform.machine()}_{digest}.so"
        try:
            if not target.exists():
                _build(self.source, target)
            lib = ctypes.CDLL(str(target))
            self.declare(lib)
        except (OSError, AttributeError, subprocess.SubprocessError) as exc:
            self.unavailable_reason = f"not built: {exc}"
            # once per library and process: the fallback is correct but slower, and the reason fixable
            warnings.warn(f"onebitlamb: the compiled loops of {self.source.parent.name}/{self.source.name} are not "
                          f"available ({self.unavailable_reason}); the torch/numpy path computes the same values, "
                          f"more slowly (ONEBITLAMB_NATIVE=0 chooses it without this warning)", RuntimeWarning)
            return None
        self._lib = lib
        return lib
