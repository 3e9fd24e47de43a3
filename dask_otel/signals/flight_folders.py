"""Where flight recorders live: a private directory per Nanny, which its workers find.

A Nanny makes and marks its directory; its workers put their recorders there (one file
per worker process, named by pid); after a death the Nanny claims the dead worker's file.
A Nanny killed outright leaves its directory behind: the next Nanny on the machine finds
it by its mark (an owner that is gone) and cleans up after it.
"""

from __future__ import annotations

import contextlib
import getpass
import hashlib
import os
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


def own(folder: Path) -> str:
    """Make ``folder`` (private to this user) and mark it as this Nanny's; the mark."""
    folder.parent.mkdir(mode=0o700, exist_ok=True)
    folder.mkdir(mode=0o700, exist_ok=True)
    mark = f"{os.getpid()} {_started(os.getpid())!r} {uuid.uuid4().hex}"
    (folder / OWNER).write_text(mark)
    return mark


def mark_of(folder: Path) -> str | None:
    try:
        return (folder / OWNER).read_text()
    except OSError:
        return None


def disown(folder: Path, mark: str | None) -> None:
    """Remove the mark and the directory, if no recorder is left in it and the folder
    still holds ``mark`` (None: it holds none)."""
    if mark_of(folder) != mark:
        return
    with contextlib.suppress(OSError):
        (folder / OWNER).unlink()
    with contextlib.suppress(OSError):
        folder.rmdir()


def orphans(mine: Path) -> Iterator[Path]:
    """The other Nannies' directories whose Nanny is gone."""
    with contextlib.suppress(OSError):
        for folder in mine.parent.iterdir():
            if folder != mine and folder.is_dir() and not _owner_alive(folder):
                yield folder


def _owner_alive(folder: Path) -> bool:
    try:
        pid, started, _ = (folder / OWNER).read_text().split()
    except (OSError, ValueError):
        try:
            return time.time() - folder.stat().st_mtime < UNMARKED_GRACE
        except OSError:
            return False
    return _started(int(pid)) == float(started)


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
    """(pid, path) of every flight recorder in ``folder``."""
    with contextlib.suppress(OSError):
        for path in folder.iterdir():
            if path.suffix == SUFFIX and path.stem.isdigit():
                yield int(path.stem), path
