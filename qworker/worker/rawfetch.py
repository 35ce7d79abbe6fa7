"""Find and read record batches aiokafka refuses (a header key that is not UTF-8 or null, a CRC
that does not hold, bytes it cannot parse).

aiokafka unpacks a fetched batch as a whole: one record it cannot decode makes every ``getmany``
raise before any record of that partition is returned, and since the broker serves whole
batches, seeking past the bad record alone does not help (the next fetch returns the same batch
from its base offset, and it raises again). This module fetches the partition's raw bytes itself,
asks aiokafka's own batch reader which batch it refuses, and parses that batch leniently (header
keys stay bytes), so the worker can answer the records before it and the good records in it,
dead-letter the rest, and seek past the whole batch.
"""

from __future__ import annotations

import asyncio
import struct
from dataclasses import dataclass

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.codec import gzip_decode, lz4_decode, snappy_decode, zstd_decode
from aiokafka.errors import OffsetOutOfRangeError
from aiokafka.protocol.fetch import FetchRequest
from aiokafka.record.memory_records import MemoryRecords
from aiokafka.record.util import calc_crc32c, decode_varint

from qworker.worker.dlq import raw_headers_header

_BATCH = struct.Struct(">qiibIhiqqqhii")  # the v2 record batch header, 61 bytes
_DECODE = {1: gzip_decode, 2: snappy_decode, 3: lz4_decode, 4: zstd_decode}
FETCH_BYTES, FETCH_WAIT_MS = 8 * 2**20, 100  # one raw fetch: how far it reads, how long it waits


@dataclass(slots=True)
class RawRecord:
    """A record as stored: ``key``/``value`` None when null, header keys as bytes."""

    topic: str
    partition: int
    offset: int
    timestamp: int
    key: bytes | None
    value: bytes | None
    raw_headers: list[tuple[bytes | None, bytes | None]]

    @property
    def decodable(self) -> bool:
        """Whether aiokafka could give this record: every header key present and UTF-8."""
        return not self.bad_header_keys

    @property
    def bad_header_keys(self) -> list[bytes | None]:
        """The header keys aiokafka refuses: null ones (None) and those that are not UTF-8."""
        bad = []
        for k, _ in self.raw_headers:
            try:
                k.decode("utf-8")
            except (AttributeError, UnicodeDecodeError):
                bad.append(k)
        return bad

    @property
    def headers(self) -> tuple[tuple[str, bytes | None], ...]:
        """As aiokafka would give them; for a record it refuses, all of them as one JSON header
        (``dlq.raw_headers_header``), the only form in which they can be produced again."""
        if not self.decodable:
            return (raw_headers_header(self.raw_headers),)
        return tuple((k.decode("utf-8"), v) for k, v in self.raw_headers)


def _nullable(buf: bytes, pos: int) -> tuple[bytes | None, int]:
    n, pos = decode_varint(buf, pos)
    if n < 0:
        return None, pos
    return bytes(buf[pos : pos + n]), pos + n


def parse(tp: TopicPartition, data: bytes, only: int | None = None) -> list[RawRecord]:
    """Records of a v2 message set (older formats carry no headers; they are skipped, as are
    control batches and a truncated last batch). ``only``: the batches before that offset are not
    decoded (their bytes may not even inflate), and parsing stops at the first batch holding a
    record at or past it (a batch compaction emptied, or whose last records it removed, reaches
    the offset by its header but holds no such record: the next one tells)."""
    out: list[RawRecord] = []
    pos = 0
    while pos + _BATCH.size <= len(data):
        (base, length, _epoch, magic, _crc, attrs, last_delta, first_ts, max_ts, _pid, _pepoch, _seq, count) = _BATCH.unpack_from(data, pos)
        end = pos + 12 + length
        if end > len(data):
            break  # a partial batch at the end of the fetch
        if magic < 2 or attrs & 0x20 or (only is not None and base + last_delta < only):
            pos = end
            continue
        body = data[pos + _BATCH.size : end]
        codec = attrs & 0x07
        if codec:
            body = _DECODE[codec](bytes(body))
        body = bytearray(body)
        p = 0
        for _ in range(count):
            _len, p = decode_varint(body, p)
            p += 1  # attributes
            ts_delta, p = decode_varint(body, p)
            off_delta, p = decode_varint(body, p)
            key, p = _nullable(body, p)
            value, p = _nullable(body, p)
            nh, p = decode_varint(body, p)
            headers = []
            for _ in range(nh):
                hk, p = _nullable(body, p)
                hv, p = _nullable(body, p)
                headers.append((hk, hv))  # a null key (None) is kept: aiokafka refuses it
            ts = max_ts if attrs & 0x08 else first_ts + ts_delta
            out.append(RawRecord(tp.topic, tp.partition, base + off_delta, ts, key, value, headers))
        if only is not None and out and out[-1].offset >= only:
            break
        pos = end
    return out


async def _fetch_partition(consumer: AIOKafkaConsumer, tp: TopicPartition, offset: int, max_bytes: int = FETCH_BYTES,
                           max_wait_ms: int = FETCH_WAIT_MS) -> tuple[int, int, bytes]:
    """(error code, high watermark, raw record-set bytes) of one fetch of ``tp`` from ``offset``
    (the broker may start the bytes before ``offset``: it serves whole batches). Uses the
    consumer's client (a private attribute: aiokafka offers no raw fetch). Raises KafkaError when
    the request fails and LookupError when the partition has no known leader."""
    client = consumer._client  # noqa: SLF001
    node = client.cluster.leader_for_partition(tp)
    if node is None or node < 0:
        raise LookupError(f"no leader known for {tp.topic}/{tp.partition}")
    req = FetchRequest(max_wait_ms, 1, max_bytes, 0, [(tp.topic, [(tp.partition, offset, max_bytes)])])
    resp = await client.send(node, req)
    for _topic, parts in resp.topics:
        for partition, error_code, high_watermark, *rest in parts:
            if partition == tp.partition:
                return error_code, high_watermark, rest[-1] or b""
    raise LookupError(f"the fetch answer holds no {tp.topic}/{tp.partition}")


async def _fetch(consumer: AIOKafkaConsumer, tp: TopicPartition, offset: int, max_bytes: int = FETCH_BYTES, max_wait_ms: int = FETCH_WAIT_MS) -> bytes:
    """The raw record-set bytes one fetch of ``tp`` from ``offset`` returns; none on any error."""
    try:
        error_code, _hw, data = await _fetch_partition(consumer, tp, offset, max_bytes, max_wait_ms)
    except LookupError:
        return b""
    return data if error_code == 0 else b""


async def fetch_raw(consumer: AIOKafkaConsumer, tp: TopicPartition, offset: int, max_bytes: int = FETCH_BYTES, max_wait_ms: int = FETCH_WAIT_MS) -> list[RawRecord]:
    """The records of ``tp`` from ``offset`` on, as far as one fetch of ``max_bytes`` reaches."""
    return [r for r in parse(tp, await _fetch(consumer, tp, offset, max_bytes, max_wait_ms)) if r.offset >= offset]


RECORD_AT_WAIT_MS = 500


async def record_at(consumer: AIOKafkaConsumer, tp: TopicPartition, offset: int) -> RawRecord | None | str:
    """What ``tp``'s log holds at ``offset`` now: the record; None when the log does not reach
    ``offset`` yet; or, as a string, why the record is gone from a log that reaches past it
    (below the log's start, or removed from its batch). Raises KafkaError or LookupError when the
    broker cannot be asked, or answers without saying (ask again later)."""
    # Not a zero wait: Tansu answers such a fetch without the partition. The broker answers as
    # soon as it has a byte; on object storage it may first answer with none within a short wait.
    error_code, high_watermark, data = await _fetch_partition(consumer, tp, offset, max_wait_ms=RECORD_AT_WAIT_MS)
    reaches = high_watermark is not None and high_watermark > offset
    if error_code == OffsetOutOfRangeError.errno and reaches:
        return f"offset {offset} lies below the log's start"
    if not reaches:
        return None
    if error_code != 0:
        raise LookupError(f"the fetch of {tp.topic}/{tp.partition} at {offset} answered error {error_code}")
    try:
        records = parse(tp, data, only=offset)
    except Exception as e:  # noqa: BLE001 - its batch does not decode (a codec's error): cannot say
        raise LookupError(f"the batch of {tp.topic}/{tp.partition} holding {offset} does not decode: {e!r}") from None
    for r in records:
        if r.offset == offset:
            return r
    if any(r.offset > offset for r in records):
        return f"offset {offset} holds no record any more"
    raise LookupError(f"the log of {tp.topic}/{tp.partition} reaches past {offset}, but the fetch brought no record")


@dataclass(slots=True)
class RefusedBatch:
    """The first record batch of a partition that aiokafka refuses, and what lies before it."""

    before: list[RawRecord]  # the records from the consumer's position up to the batch (all readable)
    # the batch's records from the position on, parsed leniently; None when its bytes cannot be
    # trusted (its CRC does not hold, or they do not parse): then only the bytes can be kept
    records: list[RawRecord] | None
    reason: str  # what aiokafka said
    first_offset: int  # the batch's first offset at or after the position
    next_offset: int  # one past the batch's last offset: where the partition goes on
    raw: bytes  # the batch as stored


def _batch_spans(data: bytes):
    """(start, end) of each complete batch; every message format starts with its offset (8 bytes)
    and its length (4 bytes)."""
    pos = 0
    while pos + 12 <= len(data):
        end = pos + 12 + struct.unpack_from(">i", data, pos + 8)[0]
        if end > len(data) or end <= pos + 12:
            return  # a partial batch at the end of the fetch (or a length no batch has)
        yield pos, end
        pos = end


def _read_as_aiokafka(tp: TopicPartition, batch: bytes, position: int) -> list[RawRecord] | str:
    """The records of ``batch`` from ``position`` on, read by aiokafka's own reader as its fetcher
    reads one (the CRC, then each record's fields); or, where it refuses the batch, why."""
    try:
        b = MemoryRecords(batch).next_batch()
        if b is None:
            return "not a record batch"
        if not b.validate_crc():
            return "its CRC does not hold"
        if getattr(b, "is_control_batch", False):
            return []
        return [RawRecord(tp.topic, tp.partition, r.offset, r.timestamp, r.key, r.value, [(k.encode(), v) for k, v in r.headers])
                for r in b if r.offset >= position]
    except Exception as e:  # noqa: BLE001 - whatever aiokafka raises is what stops the partition
        return f"{type(e).__name__}: {e}"


def _trusted(tp: TopicPartition, batch: bytes, position: int) -> list[RawRecord] | None:
    """The records of a v2 batch whose CRC holds, parsed leniently; None otherwise."""
    if len(batch) < _BATCH.size or batch[16] < 2 or calc_crc32c(batch[21:]) != struct.unpack_from(">I", batch, 17)[0]:
        return None
    try:
        return [r for r in parse(tp, batch) if r.offset >= position]
    except Exception:  # noqa: BLE001 - bytes that pass the CRC yet do not parse: keep the bytes only
        return None


def _next_offset(batch: bytes) -> int:
    base = struct.unpack_from(">q", batch, 0)[0]
    if len(batch) >= _BATCH.size and batch[16] >= 2:
        return base + struct.unpack_from(">i", batch, 23)[0] + 1  # v2: base + last offset delta + 1
    return base + 1  # v0/v1: a (wrapper) message carries its last offset


def first_refused(tp: TopicPartition, data: bytes, position: int) -> RefusedBatch | None:
    """In fetched bytes of ``tp`` read from ``position``: the first batch aiokafka refuses, with
    the records before it; None when it reads them all."""
    before: list[RawRecord] = []
    for start, end in _batch_spans(data):
        batch = data[start:end]
        read = _read_as_aiokafka(tp, batch, position)
        if not isinstance(read, str):
            before += read
            continue
        first = max(struct.unpack_from(">q", batch, 0)[0], position)
        return RefusedBatch(before, _trusted(tp, batch, position), read, first, max(_next_offset(batch), position + 1), batch)
    return None


async def refused_batches(consumer: AIOKafkaConsumer, tps: list[TopicPartition]) -> dict[TopicPartition, RefusedBatch]:
    """For each partition whose next batches include one aiokafka refuses: that batch and the
    records before it, from the consumer's position. The caller handles them and seeks to its
    ``next_offset``."""
    found: dict[TopicPartition, RefusedBatch] = {}
    for tp in tps:
        position = await consumer.position(tp)
        data = await _fetch(consumer, tp, position)
        # parsed off the event loop: a few MB of records take a quarter of a second (heartbeats,
        # streams and probes must not wait for it)
        refused = await asyncio.to_thread(first_refused, tp, data, position)
        if refused is not None:
            found[tp] = refused
    return found
