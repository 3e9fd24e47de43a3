"""Numbered records in a ring of shared memory, which a reader can take back after the
writer died, or follow while it writes.

A flight recorder holds two rings (spans and log records). The writer keeps its head and
tail in the ring's block of the file's header, so that whoever maps the file after the
writer was killed finds every record still intact, and which of them were exported. A
reader that exports what the writer hands over (a Nanny, its worker's spans) follows
the ring while it is written (:class:`RingFollower`) and moves ``exported`` itself.
"""

from __future__ import annotations

import marshal
import mmap
import struct
from dataclasses import dataclass
from typing import Any

#: A ring's block in the header: offset, size, head, tail, appended, exported.
_RING = struct.Struct("<6Q")
_RING_STATE = struct.Struct("<3Q")  # head, tail, appended (written after each record)
_COUNT = struct.Struct("<Q")
_LENGTH = struct.Struct("<I")
#: Before each record: payload length, number (0, 1, ... per ring), the numbers of its
#: resource and instrumentation scope, and a check of those (see :func:`_check`).
_RECORD = struct.Struct("<IQHHI")
#: Where a record did not fit before the end of the ring: the next one is at its start.
_WRAP = 0xFFFFFFFF


class Ring:
    """Length-prefixed records in a region of the file, the oldest overwritten first.

    Records are numbered 0, 1, ... as appended; ``exported`` is the count of those known
    to have left the export queue (all up to the newest one exported). A record's bytes
    are written before the head that makes it visible moves past them: a writer killed
    in the middle leaves the previous records intact.
    """

    def __init__(self, buffer: mmap.mmap, block: int, offset: int, size: int) -> None:
        self.buffer = buffer
        self.block = block
        self.offset = offset
        self.size = size
        #: Bytes ever written (wrapping padding included) and where the oldest record
        #: still intact starts, both as positions in that endless stream.
        self.head = 0
        self.tail = 0
        self.appended = 0
        #: Records too large for the ring, not kept.
        self.skipped = 0
        #: Records overwritten before they were exported (a reader that fell behind).
        self.overwritten = 0
        _RING.pack_into(buffer, block, offset, size, 0, 0, 0, 0)

    def append(self, payload: bytes, resource: int = 0, scope: int = 0) -> int | None:
        """Append a record (with the numbers of its resource and scope); returns its
        number (None: too large, not kept)."""
        n = _RECORD.size + len(payload)
        size = self.size
        if n > size:
            self.skipped += 1
            return None
        buffer, offset, head, tail = self.buffer, self.offset, self.head, self.tail
        at = head % size
        pad = size - at if at + n > size else 0
        end = head + pad + n
        if tail < end - size:
            exported = _stable(buffer, self.block + 40)  # a follower may be moving it
            while tail < end - size:  # make room: forget the oldest records
                position = tail % size
                room = size - position
                if room < _RECORD.size:
                    tail += room
                    continue
                length, forgotten, _, _, _ = _RECORD.unpack_from(buffer, offset + position)
                if length == _WRAP:
                    tail += room
                    continue
                tail += _RECORD.size + length
                self.overwritten += forgotten >= exported
            self.tail = tail
            _store(buffer, self.block + 24, _COUNT.pack(tail))  # before overwriting them
        if pad:
            if pad >= _LENGTH.size:
                _store(buffer, offset + at, _LENGTH.pack(_WRAP))
            at = 0
        number = self.appended
        start = offset + at
        header = _RECORD.pack(
            len(payload), number, resource, scope, _check(len(payload), number, resource, scope)
        )
        buffer[start : start + n] = header + payload
        self.head = end
        self.appended = number + 1
        _store(buffer, self.block + 16, _RING_STATE.pack(end, tail, number + 1))
        return number

    def note_exported(self, count: int) -> None:
        """Records numbered below ``count`` have left the export queue."""
        _store(self.buffer, self.block + 40, _COUNT.pack(count))


class RingFollower:
    """The reader's end of a ring its writer is still appending to: :meth:`take` returns
    the records appended since the last call (from the first not exported, at the
    start) and notes them as exported, for whoever reads the ring after the writer died.

    A writer that laps the reader overwrites records before they are taken: the writer
    counts them (:attr:`Ring.overwritten`); a take the writer overran while it read is
    discarded and read again from the new tail. The writer moves the tail before it
    overwrites, so a record that still starts at or after the tail read after copying it
    is intact.
    """

    def __init__(self, buffer: mmap.mmap, block: int) -> None:
        self.buffer = buffer
        self.block = block
        self.offset, self.size, _, _, _, exported = _RING.unpack_from(buffer, block)
        #: The number of the next record to take, and where it starts (None: not known).
        self.next = exported
        self.position: int | None = None

    def take(self) -> list[tuple[int, tuple[int, int], bytes]]:
        """(number, (resource, scope), payload) of the records appended since the last
        call, oldest first."""
        buffer, offset, size, block = self.buffer, self.offset, self.size, self.block
        head, tail = _stable(buffer, block + 16), _stable(buffer, block + 24)
        self.next = max(self.next, _stable(buffer, block + 40))  # another reader took some
        position = self.position if self.position is not None and self.position >= tail else tail
        visited = []  # (position, record or None)
        expected = None  # records are numbered one after the other
        while position < head:
            at = position % size
            room = size - at
            record = None
            if room < _RECORD.size:
                step = room
            else:
                length, number, resource, scope, check = _RECORD.unpack_from(buffer, offset + at)
                if length == _WRAP:
                    step = room
                else:
                    if check != _check(length, number, resource, scope) or (
                        expected is not None and number != expected
                    ):
                        break  # read while the writer overwrote it (seen below)
                    expected = number + 1
                    step = _RECORD.size + length
                    if number >= self.next:
                        first = offset + at + _RECORD.size
                        payload = bytes(buffer[first : first + length])
                        record = (number, (resource, scope), payload)
            visited.append((position, record))
            position += step
        tail = _stable(buffer, block + 24)
        if visited and visited[0][0] < tail:
            # Overrun while reading: what starts before the tail may be torn, and so may
            # the lengths the walk followed, unless it passed through the tail itself.
            kept = [i for i, (at, _) in enumerate(visited) if at == tail]
            if not kept:
                self.position = None
                return []
            visited = visited[kept[0] :]
        self.position = position
        records = [record for _, record in visited if record is not None]
        if records:
            self.next = records[-1][0] + 1
            _store(buffer, block + 40, _COUNT.pack(self.next))
        return records


def _store(buffer: mmap.mmap, at: int, data: bytes) -> None:
    """Write ``data`` as one copy: ``pack_into`` zeroes the bytes before it writes them,
    and a reader in another process could read those zeroes."""
    buffer[at : at + len(data)] = data


def _check(length: int, number: int, resource: int, scope: int) -> int:
    """What a record's header holds to tell it from bytes being overwritten."""
    return (length ^ number ^ (number >> 32) ^ (resource << 16 | scope) ^ 0x5A17C0DE) & 0xFFFFFFFF


def _stable(buffer: mmap.mmap, at: int) -> int:
    """An 8-byte field of the ring's block that the writer may be storing meanwhile:
    ``struct`` reads it byte by byte, so a read is kept once two agree."""
    (value,) = _COUNT.unpack_from(buffer, at)
    while True:
        (again,) = _COUNT.unpack_from(buffer, at)
        if again == value:
            return value  # type: ignore[no-any-return]
        value = again


@dataclass(frozen=True)
class RingContents:
    """What a ring held when its writer stopped."""

    #: (number, (resource, scope), payload), oldest first.
    records: list[tuple[int, tuple[int, int], bytes]]
    appended: int
    #: Records numbered below this left the export queue (exported, or dropped).
    gone: int

    def decoded(self, first: int = 0) -> list[tuple[tuple[int, int], Any]]:
        """((resource, scope), values) of the records numbered ``first`` and later."""
        return [(objects, marshal.loads(p)) for n, objects, p in self.records if n >= first]

    def unexported(self) -> list[tuple[tuple[int, int], Any]]:
        return self.decoded(self.gone)

    def lost(self) -> int:
        """Records still queued for export that the ring no longer held (overwritten)."""
        oldest = self.records[0][0] if self.records else self.appended
        return max(0, oldest - self.gone)


def read_ring(buffer: bytes | mmap.mmap, block: int) -> RingContents:
    offset, size, head, tail, appended, gone = _RING.unpack_from(buffer, block)
    records = []
    position = tail
    while position < head:
        at = position % size
        room = size - at
        if room < _RECORD.size:
            position += room
            continue
        length, number, resource, scope, _ = _RECORD.unpack_from(buffer, offset + at)
        if length == _WRAP:
            position += room
            continue
        start = offset + at + _RECORD.size
        records.append((number, (resource, scope), bytes(buffer[start : start + length])))
        position += _RECORD.size + length
    return RingContents(records, appended, gone)
