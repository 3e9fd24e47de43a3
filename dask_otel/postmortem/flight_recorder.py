"""The flight recorder: what a worker was doing when it died, kept where its Nanny can read.

A worker supervised by a dask-otel Nanny writes, as it goes, into a file that it maps
into memory (one per worker process, in a directory its Nanny made):

- the task attempts it is executing: key, prefix, trace carrier, run id, start;
- a copy of each span and log record it queues for export (``sdk`` hands them over),
  numbered, with the newest number its exporters have sent;
- its identity and OpenTelemetry resources.

Writing is a store into shared memory, no system call, under the lock that keeps the
copy in the order of the export queue. The pages belong to the file, not to the
process: whatever kills the worker (SIGKILL, the memory monitor, the kernel's OOM
killer, a segfault), its Nanny reads what was written, exports the
records that were queued but never exported (under the worker's own resource) and says
what the worker was running. A worker that closes normally deletes its file.

Here: the file's layout, the worker's end (:class:`FlightRecorder`) and the Nanny's
(:func:`read`). The rings that hold the records are :mod:`dask_otel.postmortem.rings`;
where the files live, :mod:`dask_otel.postmortem.folders`.
"""

from __future__ import annotations

import contextlib
import logging
import marshal
import mmap
import os
import struct
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dask_otel import strings
from dask_otel.postmortem import folders
from dask_otel.postmortem.folders import SUFFIX, directory
from dask_otel.postmortem.rings import Ring, RingContents, read_ring
from dask_otel.runtime import report_once
from dask_otel.spans import ids
from dask_otel.values import base_value

logger = logging.getLogger(__name__)

#: The file format, which includes the layout of the records it copies
#: (:mod:`dask_otel.export.queued_spans`).
MAGIC = b"DOTELFR2"
#: Header: magic, pid, slots, slot size, meta size, then one block per ring.
_HEADER = struct.Struct("<8sIIII")
_RING_BLOCKS = (64, 128)  # header offsets of the span ring's block and the log ring's

HEADER_SIZE = 4096
#: The identity and resources: their length, then their marshalled dict.
META_SIZE = 61440
_META_LENGTH = struct.Struct("<I")
#: An attempt's slot: state, length, then (key, prefix, annotation, run id, start) and,
#: where the key had to be cut to fit, the attempt's span id.
SLOT_SIZE = 512
_SLOT = struct.Struct("<II")
#: Bytes of an attempt's values that its slot holds.
_SLOT_ROOM = SLOT_SIZE - _SLOT.size
_SLOT_STATE = struct.Struct("<I")  # the slot's first field
#: Slot states: free; executing; finished, its span not built yet (in the emitter's queue).
FREE, EXECUTING, FINISHED = 0, 1, 2
#: Attempt slots: tasks executing, and finished ones whose spans wait to be built.
SLOTS = 256
#: Share of the rings' space that holds spans; log records get the rest.
SPAN_SHARE = 0.75
#: The largest file read as a recorder (the recorder's size is a setting: 4 MiB).
MAX_READ = 1 << 30
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


class FlightRecorder:
    """The worker's end: created when a worker of a dask-otel Nanny starts, deleted when
    it closes. Only the worker's process writes; the Nanny reads after it died."""

    def __init__(self, path: Path, size: int, slots: int) -> None:
        self.path = path
        ring_space = size - HEADER_SIZE - META_SIZE - slots * SLOT_SIZE
        if ring_space < 64 * 1024:
            raise ValueError(f"a flight recorder of {size} bytes has no room for its rings")
        # A new file: never one that was there (a link someone planted, say).
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600)
        try:
            _allocate(fd, size)
            self.buffer = mmap.mmap(fd, size)
        except OSError:
            path.unlink()
            raise
        finally:
            os.close(fd)
        self.slots = slots
        _HEADER.pack_into(self.buffer, 0, MAGIC, os.getpid(), slots, SLOT_SIZE, META_SIZE)
        span_size = int(ring_space * SPAN_SHARE)
        first = HEADER_SIZE + META_SIZE + slots * SLOT_SIZE
        self.spans = Ring(self.buffer, _RING_BLOCKS[0], first, span_size)
        self.logs = Ring(self.buffer, _RING_BLOCKS[1], first + span_size, ring_space - span_size)
        #: Keeps the copies in the order of the export queues (see :mod:`dask_otel.distro.sdk`).
        self.lock = threading.Lock()
        self._free = list(range(slots - 1, -1, -1))
        #: Attempts that found no free slot (more tasks executing than slots).
        self.unrecorded = 0
        self._meta: dict[str, Any] = {"identity": {}, "objects": []}
        self._numbers: dict[int, int] = {}
        self._objects: list[Any] = []  # numbered objects stay alive: ids are not reused
        self._pairs: dict[tuple[int, int], tuple[int, int]] = {}

    # -- identity ------------------------------------------------------------------------

    def identify(self, **identity: Any) -> None:
        """Record who this worker is (address, name, cluster id)."""
        self._meta["identity"].update(identity)
        self._write_meta()

    def _number(self, obj: Any, describe: Any) -> int:
        """A number for a resource or instrumentation scope, described in the meta area."""
        number = self._numbers.get(id(obj))
        if number is None:
            number = len(self._objects)
            self._objects.append(obj)
            self._numbers[id(obj)] = number
            self._meta["objects"].append(describe(obj))
            self._write_meta()
        return number

    def _write_meta(self) -> None:
        data = marshal.dumps(self._meta)
        if len(data) > META_SIZE - _META_LENGTH.size:
            logger.warning("dask-otel: flight recorder: identity too large, not recorded")
            return
        start = HEADER_SIZE + _META_LENGTH.size
        self.buffer[start : start + len(data)] = data
        _META_LENGTH.pack_into(self.buffer, HEADER_SIZE, len(data))

    # -- attempts --------------------------------------------------------------------------
    #
    # A slot lives from the attempt's start (event loop) until its span is built (the
    # worker's emitter thread): a worker that dies in between leaves the attempt either
    # executing (lost with the worker) or finished with its span never built.

    def started(
        self, key: str, prefix: str, annotation: str | None, run_id: int, start_ns: int
    ) -> int:
        """Note an attempt that starts executing (``annotation``: its carrier, or None);
        returns its slot (-1: not recorded)."""
        try:
            slot = self._free.pop()
        except IndexError:
            self.unrecorded += 1
            return -1
        data = marshal.dumps((key, prefix, annotation, run_id, start_ns))
        if len(data) > _SLOT_ROOM:
            data = _cut_to_fit(key, prefix, annotation, run_id, start_ns)
        start = self._slot_offset(slot)
        self.buffer[start + _SLOT.size : start + _SLOT.size + len(data)] = data
        _SLOT.pack_into(self.buffer, start, EXECUTING, len(data))
        return slot

    def ended(self, slot: int) -> None:
        """The attempt is over; its span is yet to be built."""
        if slot >= 0:
            _SLOT_STATE.pack_into(self.buffer, self._slot_offset(slot), FINISHED)

    def reported(self, slot: int) -> None:
        """Its span is built (and copied with the span queue): the slot is free again."""
        if slot >= 0:
            _SLOT_STATE.pack_into(self.buffer, self._slot_offset(slot), FREE)
            self._free.append(slot)

    def _slot_offset(self, slot: int) -> int:
        return HEADER_SIZE + META_SIZE + slot * SLOT_SIZE

    # -- telemetry (under self.lock, with the export queue's append) ---------------------

    def span(self, values: tuple, resource: Any, scope: Any) -> int | None:
        """Copy a span as queued for export
        (:func:`dask_otel.export.queued_spans.compact`); its number."""
        return self._copy(self.spans, resource, scope, values)

    def log(self, values: tuple, resource: Any, scope: Any) -> int | None:
        """Copy a log record as queued for export
        (:func:`dask_otel.export.recorder_copy.compact_log`)."""
        return self._copy(self.logs, resource, scope, values)

    def _copy(self, ring: Ring, resource: Any, scope: Any, values: tuple) -> int | None:
        """Append a record; its number (numbered but not kept if marshal cannot write
        it; None if the recorder failed). Never raises into the code that ended a span or
        logged."""
        try:
            numbers = self._pairs.get((id(resource), id(scope)))
            if numbers is None:
                numbers = (self._number(resource, _resource), self._number(scope, _scope))
                self._pairs[id(resource), id(scope)] = numbers
            try:
                payload = marshal.dumps(values)
            except ValueError:  # a subclass of an attribute type (an IntEnum member)
                payload = marshal.dumps(_base_values(values))
            return ring.append(payload, *numbers)
        except ValueError:  # a value marshal cannot write (not an OTel attribute type)
            return ring.skip()
        except Exception:
            report_once(logger, "flight", "dask-otel: the flight recorder failed (said once)")
            return None

    def close(self) -> None:
        """The worker closed normally: nothing for the Nanny to read. The mapping stays
        until nothing refers to it: a thread still ending a span writes into it unharmed."""
        with contextlib.suppress(OSError):
            self.path.unlink()


def _cut_to_fit(key: str, prefix: str, annotation: str | None, run_id: int, start_ns: int) -> bytes:
    """An attempt's values that overflow its slot, made to fit: its carrier without the
    dependencies' links (its ``died`` span needs none), the span id the Nanny could not
    compute from a cut key, and the key and prefix cut at a character boundary."""
    carrier = ids.parse(annotation)
    span_id = None
    if carrier is not None:
        annotation = carrier._replace(links=None).encode()
        span_id = carrier.span_id(key)
    # Room for the two strings: a cut one's marshal header is at most 3 bytes longer.
    room = _SLOT_ROOM - len(marshal.dumps(("", "", annotation, run_id, start_ns, span_id))) - 6
    prefix = strings.cut_to_bytes(prefix, room // 4)
    key = strings.cut_to_bytes(key, room - len(prefix.encode("utf-8", "surrogatepass")))
    return marshal.dumps((key, prefix, annotation, run_id, start_ns, span_id))


def _base_values(values: Any) -> Any:
    """``values`` (a record's tuple) with every subclass of an attribute type as its base
    class's value, as the encoders send it: marshal writes only the base classes."""
    if values.__class__ is tuple:
        return tuple(_base_values(value) for value in values)
    if values.__class__ is list:
        return [_base_values(value) for value in values]
    if values.__class__ is dict:
        return {key: _base_values(value) for key, value in values.items()}
    return base_value(values)


def _allocate(fd: int, size: int) -> None:
    """Give the file its blocks now: a store into a mapped page the file system then had
    no room for (a full disk) would kill the process with SIGBUS. A full disk raises
    OSError here instead, and the worker runs without a recorder."""
    if hasattr(os, "posix_fallocate"):
        os.posix_fallocate(fd, 0, size)
    else:  # macOS, Windows
        os.write(fd, bytes(size))


def _resource(resource: Any) -> tuple:
    return ("resource", dict(resource.attributes), resource.schema_url)


def _scope(scope: Any) -> tuple:
    if scope is None:
        return ("scope", "", None, None, None)
    attributes = getattr(scope, "attributes", None)
    return ("scope", scope.name, scope.version, scope.schema_url, dict(attributes or {}) or None)


# -- the Nanny's end ---------------------------------------------------------------------


@dataclass(frozen=True)
class Attempt:
    """A task attempt the worker was executing when it died (or had finished without
    its span being built yet: ``finished``)."""

    key: str
    prefix: str
    annotation: Any
    run_id: int
    start_ns: int
    #: The attempt's span id, recorded where its key had to be cut (None: from the key).
    span_id: int | None = None
    finished: bool = False


@dataclass
class Wreck:
    """What a dead worker's flight recorder held."""

    pid: int
    identity: dict[str, Any]
    attempts: list[Attempt]
    #: Resources and instrumentation scopes, by the numbers records refer to them with.
    objects: list[tuple]
    spans: RingContents
    logs: RingContents
    #: Records the worker had queued but not exported, decoded: (numbers, values).
    unexported_spans: list[tuple] = field(default_factory=list)
    unexported_logs: list[tuple] = field(default_factory=list)

    def last_logs(self, count: int) -> list[tuple]:
        """The worker's last ``count`` log records, exported or not: (numbers, values)."""
        records = self.logs.records[-count:] if count else []
        return self.logs.decoded(records[0][0]) if records else []


def read(path: Path) -> Wreck | None:
    """The contents of the flight recorder at ``path``, or None if it is none (gone, or
    not what a recorder holds); raises ``folders.Foreign`` for what is not a
    regular file of this user's that it may read."""
    try:
        with os.fdopen(folders.open_own(path), "rb") as file:
            data = file.read(MAX_READ + 1)
    except folders.Foreign:
        raise
    except OSError:
        return None
    if not HEADER_SIZE + META_SIZE <= len(data) <= MAX_READ:
        return None
    try:
        return _parse(data)
    except Exception:  # garbage with a recorder's magic: anything may fail
        return None


def _parse(data: bytes) -> Wreck | None:
    magic, pid, slots, slot_size, meta_size = _HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        return None
    (length,) = _META_LENGTH.unpack_from(data, HEADER_SIZE)
    meta = marshal.loads(data[HEADER_SIZE + 4 : HEADER_SIZE + 4 + length]) if length else {}
    attempts = []
    for slot in range(slots):
        start = HEADER_SIZE + meta_size + slot * slot_size
        state, length = _SLOT.unpack_from(data, start)
        if state in (EXECUTING, FINISHED):
            values = marshal.loads(data[start + _SLOT.size : start + _SLOT.size + length])
            attempt = Attempt(*values, finished=state == FINISHED)
            if not (
                isinstance(attempt.key, str)
                and isinstance(attempt.prefix, str)
                and isinstance(attempt.span_id, int | None)
            ):
                return None
            attempts.append(attempt)
    spans, logs = (read_ring(data, block) for block in _RING_BLOCKS)
    identity, objects = meta.get("identity", {}), meta.get("objects", [])
    if not (isinstance(identity, dict) and isinstance(objects, list)):
        return None
    wreck = Wreck(pid, identity, attempts, objects, spans, logs)
    wreck.unexported_spans = spans.unexported()
    wreck.unexported_logs = logs.unexported()
    return wreck


def open_for(worker: Any, size: int) -> FlightRecorder | None:
    """A flight recorder for ``worker`` if its Nanny runs dask-otel (it made the directory),
    for the worker to copy its export queues to (``dask_otel.export.recorder_copy.mirror``); None
    otherwise."""
    nanny = getattr(worker, "nanny", None)
    if not size or not isinstance(nanny, str):
        return None
    folder = directory(nanny)
    if not folders.private(folder):
        return None
    slots = max(SLOTS, 2 * worker.state.nthreads)
    try:
        recorder = FlightRecorder(folder / f"{os.getpid()}{SUFFIX}", size, slots)
    except (OSError, ValueError) as e:
        logger.warning("dask-otel: no flight recorder for this worker: %r", e)
        return None
    recorder.identify(
        **{"dask.worker.address": worker.address, "dask.worker.name": str(worker.name)}
    )
    return recorder
