"""What a TensorBoard reader loses from a damaged event file.

An event file is a chain of TFRecords: a little-endian uint64 length, the masked CRC-32C of those 8 bytes, the
serialized ``Event`` and the masked CRC-32C of the event. TensorBoard's reader (which tbparse uses) stops at
the first record that is cut off or fails a checksum and reports that only at debug level, so a crash
mid-write or a damaged copy drops every later point without a word. :func:`scan_event_file` walks the chain
itself, steps over damage to the next intact record, and counts the scalar points in every record it can
frame, so the loader can say how many of them the reader did not return.

Only the 8-byte length headers are checksummed here: TensorBoard's pure-Python CRC runs at a few MB/s and the
reader already pays it for the payloads. A payload that fails its own checksum still shows up, as a point
count higher than what the reader returned.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_HEADER = struct.Struct("<QI")  # length, masked CRC-32C of the length
_FRAMING = _HEADER.size + 4  # header + the payload's CRC


@dataclass(frozen=True)
class EventFileScan:
    """Result of :func:`scan_event_file`.

    ``n_points``: scalar values (``simple_value``, what TensorBoard lists as scalars) in every framed record,
    including those after damage. ``damage_at``: byte offset of the first record a reader cannot pass
    (None if the chain is intact); ``reason`` says why. ``unreadable_bytes``: bytes no framed record covers.
    ``points_after_damage``: scalar values in the records past ``damage_at``, which the reader never reaches.
    """

    size: int
    n_records: int
    n_points: int
    damage_at: int | None = None
    reason: str = ""
    unreadable_bytes: int = 0
    points_after_damage: int = 0


@functools.cache
def _tensorboard() -> tuple[Any, Any, type[Exception]]:
    """TensorBoard's masked CRC-32C, its ``Event`` message and protobuf's decode error (imported on first use:
    importing :mod:`rlseq.compare` should not load TensorBoard)."""
    from google.protobuf.message import DecodeError
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

    return masked_crc32c, Event, DecodeError


def _record_end(data: bytes, pos: int) -> tuple[int, str]:
    """End offset of the record at ``pos`` (0 and the reason when there is none)."""
    if len(data) - pos < _HEADER.size:
        return 0, "truncated record"
    length, crc = _HEADER.unpack_from(data, pos)
    if _tensorboard()[0](data[pos:pos + 8]) != crc:
        return 0, "bad record header"
    end = pos + _FRAMING + length
    if end > len(data):
        return 0, "truncated record"
    return end, ""


def _resync(data: bytes, pos: int) -> int:
    """Offset of the next record after ``pos`` whose header checks out and that fits the file, else len(data).

    The length must fit what is left before a CRC is worth computing, which skips almost every offset of
    random bytes cheaply."""
    n = len(data)
    for q in range(pos + 1, n - _FRAMING + 1):
        (length,) = struct.unpack_from("<Q", data, q)
        if q + _FRAMING + length <= n and _record_end(data, q)[0]:
            return q
    return n


def _scalar_count(payload: bytes) -> int:
    _, Event, DecodeError = _tensorboard()
    try:
        event = Event.FromString(payload)
    except DecodeError:
        return 0
    return sum(v.HasField("simple_value") for v in event.summary.value)


def scan_event_file(path: str | Path) -> EventFileScan:
    """Walk the record chain of one event file; see :class:`EventFileScan`."""
    data = Path(path).read_bytes()
    pos = n_records = n_points = unreadable = after = 0
    damage_at: int | None = None
    reason = ""
    while pos < len(data):
        end, why = _record_end(data, pos)
        if not end:
            if damage_at is None:
                damage_at, reason = pos, why
            nxt = _resync(data, pos)
            unreadable += nxt - pos
            pos = nxt
            continue
        points = _scalar_count(data[pos + _HEADER.size:end - 4])
        n_records += 1
        n_points += points
        if damage_at is not None:
            after += points
        pos = end
    return EventFileScan(size=len(data), n_records=n_records, n_points=n_points, damage_at=damage_at,
                         reason=reason, unreadable_bytes=unreadable, points_after_damage=after)
