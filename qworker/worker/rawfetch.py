"""Find and read records aiokafka cannot decode (a header key that is not UTF-8).

aiokafka decodes header keys as UTF-8 while it unpacks a fetched batch; one bad key makes every
``getmany`` raise ``UnicodeDecodeError`` before any record of that partition is returned, and
the consumer stays at that offset for good. This module fetches the partition's raw bytes
itself and parses the v2 record format leniently (header keys stay bytes), so the worker can
answer the records before the bad one, dead-letter the bad one and seek past it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.codec import gzip_decode, lz4_decode, snappy_decode, zstd_decode
from aiokafka.protocol.fetch import FetchRequest
from aiokafka.record.util import decode_varint

_BATCH = struct.Struct(">qiibIhiqqqhii")  # the v2 record batch header, 61 bytes
_DECODE = {1: gzip_decode, 2: snappy_decode, 3: lz4_decode, 4: zstd_decode}


@dataclass(slots=True)
class RawRecord:
    """A record as stored: ``key``/``value`` None when null, header keys as bytes."""

    topic: str
    partition: int
    offset: int
    timestamp: int
    key: bytes | None
    value: bytes | None
    raw_headers: list[tuple[bytes, bytes | None]]

    @property
    def decodable(self) -> bool:
        try:
            for k, _ in self.raw_headers:
                k.decode("utf-8")
        except UnicodeDecodeError:
            return False
        return True

    @property
    def headers(self) -> tuple[tuple[str, bytes | None], ...]:
        """As aiokafka would give them (only valid when ``decodable``)."""
        return tuple((k.decode("utf-8"), v) for k, v in self.raw_headers)


def _nullable(buf: bytes, pos: int) -> tuple[bytes | None, int]:
    n, pos = decode_varint(buf, pos)
    if n < 0:
        return None, pos
    return bytes(buf[pos : pos + n]), pos + n


def parse(tp: TopicPartition, data: bytes) -> list[RawRecord]:
    """Records of a v2 message set (older formats carry no headers; they are skipped, as are
    control batches and a truncated last batch)."""
    out: list[RawRecord] = []
    pos = 0
    while pos + _BATCH.size <= len(data):
        (base, length, _epoch, magic, _crc, attrs, _last_delta, first_ts, max_ts, _pid, _pepoch, _seq, count) = _BATCH.unpack_from(data, pos)
        end = pos + 12 + length
        if end > len(data):
            break  # a partial batch at the end of the fetch
        if magic < 2 or attrs & 0x20:
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
                headers.append((hk or b"", hv))
            ts = max_ts if attrs & 0x08 else first_ts + ts_delta
            out.append(RawRecord(tp.topic, tp.partition, base + off_delta, ts, key, value, headers))
        pos = end
    return out


async def fetch_raw(consumer: AIOKafkaConsumer, tp: TopicPartition, offset: int, max_bytes: int = 8 * 2**20, max_wait_ms: int = 100) -> list[RawRecord]:
    """The records of ``tp`` from ``offset`` on, as far as one fetch of ``max_bytes`` reaches.
    Uses the consumer's client (a private attribute: aiokafka offers no raw fetch)."""
    client = consumer._client  # noqa: SLF001
    node = client.cluster.leader_for_partition(tp)
    if node is None or node < 0:
        return []
    req = FetchRequest(max_wait_ms, 1, max_bytes, 0, [(tp.topic, [(tp.partition, offset, max_bytes)])])
    resp = await client.send(node, req)
    out: list[RawRecord] = []
    for _topic, parts in resp.topics:
        for partition, error_code, _hw, *rest in parts:
            if partition == tp.partition and error_code == 0:
                out += [r for r in parse(tp, rest[-1] or b"") if r.offset >= offset]
    return out


async def undecodable(consumer: AIOKafkaConsumer, tps: list[TopicPartition]) -> dict[TopicPartition, list[RawRecord]]:
    """For each partition whose next records include one aiokafka cannot decode: the records
    from the consumer's position up to and including the first such record. The caller
    handles them and seeks past the last one."""
    found: dict[TopicPartition, list[RawRecord]] = {}
    for tp in tps:
        recs = await fetch_raw(consumer, tp, await consumer.position(tp))
        for i, r in enumerate(recs):
            if not r.decodable:
                found[tp] = recs[: i + 1]
                break
    return found
