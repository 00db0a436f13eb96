"""Plain C files of the package, compiled with gcc on first use and loaded through ctypes.

Why this way: a C file that needs no Python or torch headers builds with any gcc, at run time,
with no build step at install; a machine without a compiler keeps the torch/numpy path, which
computes the same values. Used by the codec (``compression/_native.c``) and by 1-bit LAMB's
stage-2 loop (``optim/_native.c``).

Each library is built with ``gcc -O3`` into ``$ONEBITLAMB_CACHE`` (default ``~/.cache/onebitlamb``)
under a name that holds the machine type and a hash of the source and flags, and is renamed into
place atomically, so concurrent workers never load a half-written file. ``ONEBITLAMB_NATIVE=0``
turns every library off; a failed build (no compiler, a read-only cache) leaves the fallback.

Loading a shared library runs its constructors, so only a library this package built is loaded:
the cache folder must belong to the current user and be writable by no one else (it is created
with mode 0700), and each library has a record beside it, written at build time, of its own
sha256 and of the source and flags it was built from. A library without a matching record, or
not owned by the user, is never loaded: it is rebuilt, with a warning; a folder others may write
is not used at all.
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import os
import platform
import shutil
import stat
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

RECORD_SUFFIX = ".sha256"  # beside each library: {"library_sha256": ..., "source_sha256": ...}


class UntrustedCache(OSError):
    """The cache folder, or a file in it, may have been written by someone other than this user."""


def cache_dir() -> Path:
    return Path(os.environ.get("ONEBITLAMB_CACHE") or Path.home() / ".cache" / "onebitlamb")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _check_owned(path: Path, folder: bool = False) -> None:
    """``path`` belongs to this user and no one else may write it: otherwise another user could
    have put code there that loading would run."""
    what = "folder" if folder else "file"
    st = os.stat(path) if folder else os.lstat(path)  # a file in the folder must not be a link
    if not folder and not stat.S_ISREG(st.st_mode):
        raise UntrustedCache(f"{path} is not a regular file")
    if hasattr(os, "geteuid") and st.st_uid != os.geteuid():
        raise UntrustedCache(f"the {what} {path} belongs to user id {st.st_uid}, not to this user ({os.geteuid()})")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UntrustedCache(f"the {what} {path} is writable by others (mode {stat.S_IMODE(st.st_mode):o})")


def private_cache_dir() -> Path:
    """The cache folder, created with mode 0700 if missing; UntrustedCache if it exists and
    someone else owns it or may write it."""
    folder = cache_dir()
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        _check_owned(folder, folder=True)
    except UntrustedCache as exc:
        raise UntrustedCache(f"{exc}, so a library there may hold anyone's code: `chmod go-w {folder}` if it is "
                             f"yours, or set ONEBITLAMB_CACHE to a folder of your own") from None
    return folder


def _trusted(library: Path, source_sha256: str) -> Optional[str]:
    """Why ``library`` must not be loaded, or None: it, and the record written when it was built,
    belong to this user, and the record names this source and the library's own bytes."""
    record = library.with_name(library.name + RECORD_SUFFIX)
    if not library.exists():
        return "not built yet"
    if not record.exists():
        return f"it has no record of its build ({record.name})"
    try:
        _check_owned(library)
        _check_owned(record)
        built = json.loads(record.read_text())
        if built.get("source_sha256") != source_sha256:
            return "its record names another source or other flags"
        if built.get("library_sha256") != _sha256(library):
            return "its bytes are not the ones recorded when it was built"
    except (UntrustedCache, ValueError, AttributeError) as exc:
        return str(exc)
    return None


def _build(source: Path, target: Path, source_sha256: str) -> None:
    """Compile ``source`` to ``target``, with its record beside it: both written under temporary
    names and renamed into place (the record first), so a concurrent worker sees the old names or
    whole files."""
    compiler = shutil.which(os.environ.get("CC", "gcc")) or shutil.which("cc")
    if compiler is None:
        raise OSError("no C compiler (gcc or cc) on PATH")
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    fd, tmp_record = tempfile.mkstemp(suffix=RECORD_SUFFIX, dir=target.parent)  # mode 0600
    try:
        subprocess.run([compiler, *FLAGS, "-o", tmp, str(source), "-lm"],
                       check=True, capture_output=True, text=True, timeout=120)
        os.chmod(tmp, 0o700)  # the linker's mode follows the umask, which may let the group write
        with os.fdopen(fd, "w") as f:
            fd = -1
            json.dump({"library_sha256": _sha256(Path(tmp)), "source_sha256": source_sha256}, f)
        os.replace(tmp_record, target.with_name(target.name + RECORD_SUFFIX))
        os.replace(tmp, target)  # atomic: a concurrent worker sees the old name or the whole file
    except subprocess.CalledProcessError as exc:
        raise OSError(f"{compiler} failed: {exc.stderr.strip()[-500:]}") from exc
    finally:
        if fd >= 0:
            os.close(fd)
        for path in (tmp, tmp_record):
            if os.path.exists(path):
                os.unlink(path)


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
        source_sha256 = hashlib.sha256(self.source.read_bytes() + " ".join(FLAGS).encode()).hexdigest()
        try:
            # a home folder shared by machines of different kinds must not hand one the other's build
            target = private_cache_dir() / (f"onebitlamb_{self.source.parent.name}_{platform.machine()}_"
                                            f"{source_sha256[:16]}.so")
            refused = _trusted(target, source_sha256)
            if refused is not None:
                if target.exists():
                    warnings.warn(f"onebitlamb: not loading {target}: {refused}; building it again", RuntimeWarning)
                _build(self.source, target, source_sha256)
                refused = _trusted(target, source_sha256)  # what is loaded is what was checked
                if refused is not None:
                    raise UntrustedCache(f"{target}, just built: {refused}")
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
