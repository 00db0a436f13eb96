"""How the main job writes into OUT: every file of a run is created anew, never opened through a
link, and OUT is locked for the run's life.

- ``create(path)``: a new file, opened with ``O_CREAT | O_EXCL | O_NOFOLLOW``. A regular file
  already there under that name (the run's own, from an earlier step or an interrupted write) is
  removed first; a link or a folder there is refused, naming it. So no file outside OUT is written
  through a link planted inside it, and what the run replaces it has written itself.
- ``write_json`` and ``data.atomic_save``: a temporary name made by ``create``, then a rename, which
  replaces a link rather than following it. The temporary name carries the run's mark
  (``temporary_name``: ``NAME.onebitlamb-tmp.PID``), which no file of a user's has: a file left
  under it by a write cut short is the run's own, and removed as such (a ``NAME.tmp`` is not). A
  write that fails (a full disk) removes its temporary file and raises ``WriteError``, one
  sentence naming the file and what is missing (``writing``).
- ``make_folder(path)``: a folder of the run (a checkpoint's): made, or reused when it is a real
  folder; a link or a file there is refused.
- ``RunLock(out)``: ``fcntl.flock`` on ``OUT/.onebitlamb.lock``, held by the launcher (rank 0 under
  torchrun) until the run ends, then removed: a second run on the same OUT is refused at its
  start, naming the first one's pid. The kernel drops the lock when that process dies, however it
  dies (the file then stays, and the next run takes it).

Only the last part of a path is checked: OUT itself, and the folders above it, are the user's.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import stat
from typing import IO, Iterator, Optional

LOCK_FILE = ".onebitlamb.lock"
# the mark of a file the run is writing (temporary_name): what carries it at the end of its name is
# the run's own, whoever finds it
TEMPORARY_MARK = ".onebitlamb-tmp"
TEMPORARY = re.compile(re.escape(TEMPORARY_MARK) + r"(\.[0-9]+)?$")


def temporary_name(path: str, unique: bool = True) -> str:
    """The name ``path`` is written under before its rename: this process's own (``unique``, the
    pid in it), or the one a checkpoint's file waits under until rank 0 commits the checkpoint
    (each rank writes its own file, and one run holds OUT)."""
    return f"{path}{TEMPORARY_MARK}.{os.getpid()}" if unique else path + TEMPORARY_MARK


class OutError(ValueError):
    """OUT, or a name the run writes in it, cannot be used safely: a link or a folder where a file
    of the run goes, another run holding OUT, a folder that cannot be written. The command prints
    the message alone."""


class WriteError(OutError):
    """A file of the run could not be written (a full disk, a quota, an I/O error): its message
    names the file and what is missing; the temporary file was removed."""


# what an OSError of a write means for the user, by errno
_WRITE_FAILURES = {errno.ENOSPC: "no space left on the disk that holds it",
                   errno.EDQUOT: "the disk quota of this user is used up",
                   errno.EFBIG: "the file would be larger than this file system allows",
                   errno.EROFS: "the file system is read-only",
                   errno.EIO: "an I/O error of the disk"}


def write_failed(path: str, exc: OSError) -> WriteError:
    """The one sentence for an OSError raised while writing ``path``."""
    what = _WRITE_FAILURES.get(exc.errno, exc.strerror or str(exc))
    return WriteError(f"{path} could not be written: {what}")


@contextlib.contextmanager
def writing(path: str, tmp: str) -> Iterator[None]:
    """Around the write of ``tmp`` and its rename to ``path``: an OSError (a full disk) removes
    ``tmp`` and becomes a ``WriteError`` naming ``path``, so nothing half-written is left behind."""
    try:
        yield
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise write_failed(path, exc) from None


def create(path: str, binary: bool = True, newline: Optional[str] = None) -> IO:
    """A new file at ``path`` for writing, never through a link (see the module's docstring);
    ``newline`` as ``open``'s (text files)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISREG(st.st_mode):
            kind = "a link" if stat.S_ISLNK(st.st_mode) else "not a regular file"
            raise OutError(f"{path} is {kind}, where this run writes its own file: not following or replacing "
                           f"it; remove it (nothing of it was written or removed)")
        os.remove(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    except FileExistsError:
        raise OutError(f"{path} appeared while this run was about to create it (another process is writing "
                       f"into this folder?): not touching it") from None
    return os.fdopen(fd, "wb") if binary else os.fdopen(fd, "w", newline=newline)


def write_json(path: str, obj, indent: Optional[int] = None) -> None:
    """``obj`` as JSON at ``path``: a temporary file made by ``create``, flushed, then renamed."""
    tmp = temporary_name(path)
    with writing(path, tmp):
        with create(tmp, binary=False) as f:
            json.dump(obj, f, indent=indent)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)


def write_text(path: str, text: str) -> None:
    with writing(path, path):
        with create(path, binary=False) as f:
            f.write(text)


def save_figure(fig, path: str, **kwargs) -> None:
    """``fig.savefig`` into a file made by ``create`` (matplotlib would follow a link)."""
    with create(path) as f:
        fig.savefig(f, format="png", **kwargs)


def make_folder(path: str) -> None:
    """A folder of the run at ``path``: made, or kept when it is already a real folder (an
    interrupted save of the same step); a link or a file there is refused."""
    try:
        os.mkdir(path)
        return
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        kind = "a link" if stat.S_ISLNK(st.st_mode) else "a file"
        raise OutError(f"{path} is {kind}, where this run makes its own folder: not following or removing it")


def usable_out(out: str, resume: bool) -> None:
    """OUT must be a folder this process can write (made here for a new run): checked before
    anything starts, so that a typo or a read-only disk is one sentence, not a worker's traceback."""
    if os.path.lexists(out) and not os.path.isdir(out):
        raise OutError(f"--out {out} is a file, not a folder: choose a folder (it is made if missing)")
    if not os.path.isdir(out):
        if resume:
            raise OutError(f"--resume: {out} does not exist, so there is nothing to continue; check --out, or "
                           f"start a new run without --resume")
        try:
            os.makedirs(out, exist_ok=True)  # torchrun's ranks may race to make it
        except OSError as exc:
            raise OutError(f"--out {out} cannot be made ({exc.strerror or exc}): choose a folder this user can "
                           f"write") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise OutError(f"--out {out} cannot be written by this user (read-only): choose a folder this user can "
                       f"write, or fix its permissions")


class RunLock:
    """``fcntl.flock`` on ``OUT/.onebitlamb.lock`` while the run lasts (a context manager; also
    ``acquire()`` / ``release()``). The file holds the pid of the process that holds it, and is
    removed when the lock is released (a lock taken on a file removed meanwhile is taken again)."""

    def __init__(self, out: str) -> None:
        self.path = os.path.join(out, LOCK_FILE)
        self.fd: Optional[int] = None

    def acquire(self) -> "RunLock":
        try:
            import fcntl
        except ImportError:  # not POSIX: runs are not kept apart there
            return self
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise OutError(f"{self.path} is a link: not following it; remove it") from None
                raise OutError(f"{self.path} cannot be made ({exc.strerror or exc}): --out must be a folder "
                               f"this user can write") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise OutError(f"{os.path.dirname(self.path)} is in use by another run (pid {holder}, which holds "
                               f"{LOCK_FILE}): wait for it to end or stop it, or choose another --out") from None
            try:
                same = os.stat(self.path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # the holder removed the file between our open and our lock: again
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            try:
                os.remove(self.path)  # while still holding it, so that no one locks the old file
            except FileNotFoundError:
                pass
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> bool:
        self.release()
        return False
