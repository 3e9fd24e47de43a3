"""Numbered records in a ring of shared memory, which a reader can take back after the
writer died.

A flight recorder holds two rings (spans and log records). The writer keeps its head and
tail in the ring's block of the file's header, so that whoever maps the file after the
writer was killed finds every record still intact, and which of them were exported.
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
#: Before each record: payload length, number (0, 1, ... per ring), and the numbers of
#: its resource and instrumentation scope.
_RECORD = struct.Struct("<IQHH")
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
        _RING.pack_into(buffer, block, offset, size, 0, 0, 0, 0)

    def append(self, payload: bytes, resource: int = 0, scope: int = 0) -> int:
        """Append a record (with the numbers of its resource and scope); returns its
        number. One too large for the ring is numbered, not kept (:meth:`skip`)."""
        n = _RECORD.size + len(payload)
        size = self.size
        if n > size:
            return self.skip()
        buffer, offset, head, tail = self.buffer, self.offset, self.head, self.tail
        at = head % size
        pad = size - at if at + n > size else 0
        end = head + pad + n
        if tail < end - size:
            while tail < end - size:  # make room: forget the oldest records
                position = tail % size
                room = size - position
                if room < _RECORD.size:
                    tail += room
                    continue
                (length,) = _LENGTH.unpack_from(buffer, offset + position)
                tail += room if length == _WRAP else _RECORD.size + length
            self.tail = tail
            _COUNT.pack_into(buffer, self.block + 24, tail)  # before overwriting them
        if pad:
            if pad >= _LENGTH.size:
                _LENGTH.pack_into(buffer, offset + at, _WRAP)
            at = 0
        number = self.appended
        start = offset + at
        buffer[start : start + n] = _RECORD.pack(len(payload), number, resource, scope) + payload
        self.head = end
        self.appended = number + 1
        _RING_STATE.pack_into(buffer, self.block + 16, end, tail, number + 1)
        return number

    def skip(self) -> int:
        """Number a record that the ring does not keep: its reader counts it lost unless
        it was exported."""
        number = self.appended
        self.appended = number + 1
        _RING_STATE.pack_into(self.buffer, self.block + 16, self.head, self.tail, number + 1)
        return number

    def note_exported(self, count: int) -> None:
        """Records numbered below ``count`` have left the export queue."""
        _COUNT.pack_into(self.buffer, self.block + 40, count)


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
        """Records still queued for export that the ring did not hold (overwritten, or
        too large for it)."""
        held = sum(1 for number, _, _ in self.records if number >= self.gone)
        return max(0, self.appended - self.gone - held)


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
        length, number, resource, scope = _RECORD.unpack_from(buffer, offset + at)
        if length == _WRAP:
            position += room
            continue
        start = offset + at + _RECORD.size
        records.append((number, (resource, scope), bytes(buffer[start : start + length])))
        position += _RECORD.size + length
    return RingContents(records, appended, gone)
