"""Record batches built byte by byte, as a foreign client (or a broker that does not validate)
may store them: header keys that are not UTF-8 or null, any codec, a CRC that does not hold."""

from __future__ import annotations

import struct
import time

from aiokafka import AIOKafkaProducer
from aiokafka.record.default_records import _DefaultRecordBatchBuilderPy
from aiokafka.record.util import calc_crc32c


class RawKey(str):
    """A header key that encodes to arbitrary bytes in aiokafka's pure-Python batch builder."""

    def __new__(cls, raw: bytes) -> RawKey:
        o = super().__new__(cls, raw.decode("latin-1"))
        o.raw = raw
        return o

    def encode(self, *args, **kwargs) -> bytes:  # type: ignore[override]
        return self.raw


def record_batch(base: int, records: list, codec: int = 0, null_key_marker: bytes | None = None) -> bytes:
    """A v2 batch at ``base``: (key, value, headers) per record. Header keys may be raw bytes (not
    UTF-8); in an uncompressed batch, the header ``("", null_key_marker)`` gets a null key."""
    assert null_key_marker is None or codec == 0, "a null key is patched into uncompressed bytes"
    b = _DefaultRecordBatchBuilderPy(2, codec, 0, -1, -1, -1, 1 << 20)
    now_ms = int(time.time() * 1000)
    for i, (key, value, headers) in enumerate(records):
        b.append(i, now_ms + i, key, value, [(RawKey(k) if isinstance(k, bytes) else k, v) for k, v in headers])
    buf = b.build()
    struct.pack_into(">q", buf, 0, base)
    if null_key_marker is not None:  # the key "" before this value: its length varint 0 -> -1
        i = bytes(buf).index(b"\x00" + bytes([2 * len(null_key_marker)]) + null_key_marker)
        buf[i] = 0x01
        struct.pack_into(">I", buf, 17, calc_crc32c(bytes(buf[21:])))
    return bytes(buf)


class _Fixed(_DefaultRecordBatchBuilderPy):
    """A builder whose batch is given bytes (the producer sends what ``build`` returns)."""

    def __init__(self, data: bytes) -> None:
        super().__init__(2, 0, 0, -1, -1, -1, 1 << 22)
        self._data = data

    def build(self):
        return bytearray(self._data)


async def produce_batch(bootstrap_servers: str, topic: str, partition: int, data: bytes) -> None:
    """Stores ``data`` (one v2 batch) on ``topic``/``partition`` as it is; the broker assigns the
    base offset."""
    p = AIOKafkaProducer(bootstrap_servers=bootstrap_servers, enable_idempotence=False)
    await p.start()
    try:
        batch = p.create_batch()
        batch._builder = _Fixed(data)
        batch.append(timestamp=None, key=None, value=b"x")  # counted, so the batch is sent; never built
        batch.close()
        await (await p.send_batch(batch, topic, partition=partition))
    finally:
        await p.stop()
