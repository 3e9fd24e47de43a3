"""Where flight recorders live: a private directory per Nanny, which its workers find.

A Nanny makes and marks its directory; its workers put their recorders there (one file
per worker process, named by pid); after a death the Nanny claims the dead worker's file.
A Nanny killed outright leaves its directory behind: the next Nanny on the machine finds
it by its mark (an owner that is gone) and cleans up after it, if it may
(:mod:`dask_otel.postmortem.labels`).

Everything here is in a shared temporary directory, where another user may have made
the names first: a directory is used only if it is this user's, not a link, and open to
no one else; a file is written only as a new one (``O_EXCL``, ``O_NOFOLLOW``) and read
only if it is a regular file of this user's. Anything else is foreign: left alone.
"""

from __future__ import annotations

import contextlib
import getpass
import hashlib
import os
import stat
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

#: File name suffix of a flight recorder; the stem is the worker's pid.
SUFFIX = ".flight"


def root() -> Path:
    """The directory of this user's Nannies' directories (one machine-wide, per user)."""
    try:
        user = str(os.getuid())
    except AttributeError:  # Windows
        user = getpass.getuser()
    return Path(tempfile.gettempdir()) / f"dask-otel-{user}"


def directory(nanny_address: str) -> Path:
    """Where the Nanny at ``nanny_address`` and its workers keep flight recorders.

    Both ends derive it from the Nanny's address (the worker knows it from Dask), so
    nothing is passed between them, whichever way dask-otel reached either process.
    """
    digest = hashlib.sha1(nanny_address.encode(), usedforsecurity=False).hexdigest()[:16]
    return root() / digest


def path_of(nanny_address: str, pid: int) -> Path:
    return directory(nanny_address) / f"{pid}{SUFFIX}"


#: In each Nanny's directory: its pid and start time, by which another Nanny tells that
#: it is gone (SIGKILLed, say) and cleans up after it, and a token of the Nanny itself (a
#: new Nanny at a reused address must not lose its directory to the old one's cleanup).
OWNER = "nanny"
#: A directory without its owner's mark is left alone this long (being made, maybe).
UNMARKED_GRACE = 60.0


#: Files in a Nanny's directory besides recorders: its mark, and whose cluster it is
#: (:mod:`dask_otel.postmortem.labels`).
LABEL = "cluster"
#: Longest mark or label read.
SMALL_FILE = 4096
#: Above any pid (a file named so is not a recorder).
_MAX_PID = 1 << 31
#: Opening a link fails (where the system can tell).
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


class Foreign(OSError):
    """A directory or file that is not this user's own private one."""


def _user() -> int:
    return os.geteuid() if hasattr(os, "geteuid") else -1


def private(folder: Path) -> bool:
    """Whether ``folder`` is a directory (not a link) of this user's that no one else
    may enter, and so is the one it is in (see :func:`root`)."""
    return all(_private(path) for path in (folder.parent, folder))


def _private(path: Path) -> bool:
    try:
        info = os.lstat(path)
    except OSError:
        return False
    if not hasattr(os, "geteuid"):  # Windows: no owner and mode to check
        return stat.S_ISDIR(info.st_mode)
    return stat.S_ISDIR(info.st_mode) and info.st_uid == _user() and not info.st_mode & 0o077


def _make_private(path: Path) -> None:
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    if not _private(path):
        raise Foreign(f"{path} is not a private directory of this user's: not used")


def write_new(path: Path, text: str) -> None:
    """Put ``text`` at ``path``: written into a new file (never through a link or into a
    file someone else made), then renamed over whatever was at ``path``."""
    temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w") as file:
            file.write(text)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            temporary.unlink()
        raise


def open_own(path: Path) -> int:
    """A descriptor to read ``path``, if it is a regular file of this user's that this
    user may read (not a link); raises :class:`Foreign` (an OSError) otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise
    except OSError as e:  # a link (ELOOP), a file this user may not read
        raise Foreign(f"{path}: {e.strerror}") from e
    info = os.fstat(fd)
    owner = info.st_uid == _user() or not hasattr(os, "geteuid")
    if not (stat.S_ISREG(info.st_mode) and owner):
        os.close(fd)
        raise Foreign(f"{path} is not a file of this user's")
    return fd


def read_small(path: Path) -> str | None:
    """The text of a mark or label of this user's (None: missing, foreign, unreadable)."""
    try:
        with os.fdopen(open_own(path), "rb") as file:
            return file.read(SMALL_FILE).decode()
    except (OSError, ValueError):
        return None


def own(folder: Path) -> str:
    """Make ``folder`` (private to this user) and mark it as this Nanny's; the mark.
    Raises :class:`Foreign` where it, or the directory it is in, is not this user's
    private one."""
    _make_private(folder.parent)
    _make_private(folder)
    mark = f"{os.getpid()} {_started(os.getpid())!r} {uuid.uuid4().hex}"
    write_new(folder / OWNER, mark)
    return mark


def mark_of(folder: Path) -> str | None:
    return read_small(folder / OWNER)


def set_aside(folder: Path) -> None:
    """Rename ``folder`` (an earlier Nanny's at this address, of another cluster) so that
    this Nanny starts afresh and a Nanny of that cluster can still find it."""
    with contextlib.suppress(OSError):
        folder.rename(folder.with_name(f"{folder.name}-{uuid.uuid4().hex[:8]}"))


def disown(folder: Path, mark: str | None) -> None:
    """Remove the mark, the label and the directory, if no recorder is left in it and
    the folder still holds ``mark`` (None: it holds none)."""
    if mark_of(folder) != mark:
        return
    for name in (OWNER, LABEL):
        with contextlib.suppress(OSError):
            (folder / name).unlink()
    with contextlib.suppress(OSError):
        folder.rmdir()


def orphans(mine: Path) -> Iterator[Path]:
    """The other Nannies' directories whose Nanny is gone (private ones only)."""
    if not private(mine):
        return
    with contextlib.suppress(OSError):
        for folder in mine.parent.iterdir():
            if folder != mine and _private(folder) and not _owner_alive(folder):
                yield folder


def _owner_alive(folder: Path) -> bool:
    try:
        pid, started, _ = (mark_of(folder) or "").split()
        return _started(int(pid)) == float(started)
    except (ValueError, OverflowError):  # no mark (being made, maybe), or not one
        try:
            return time.time() - folder.stat().st_mtime < UNMARKED_GRACE
        except OSError:
            return False


def _started(pid: int) -> float | None:
    """When process ``pid`` started (None: there is none): a pid reused since is not it."""
    import psutil

    try:
        return psutil.Process(pid).create_time()  # type: ignore[no-any-return]
    except psutil.Error:
        return None


def claim(path: Path) -> Path | None:
    """Take the recorder at ``path`` for this process to read (renamed: two Nannies
    cleaning up after a third never both send it); None if another took it first."""
    claimed = path.with_name(f"{path.name}.{os.getpid()}")
    try:
        path.rename(claimed)
    except OSError:
        return None
    return claimed


def recorders(folder: Path) -> Iterator[tuple[int, Path]]:
    """(pid, path) of every flight recorder in ``folder`` (a private one)."""
    if not private(folder):
        return
    with contextlib.suppress(OSError):
        for path in folder.iterdir():
            if path.suffix == SUFFIX and path.stem.isdigit() and int(path.stem) < _MAX_PID:
                yield int(path.stem), path
