"""A topic's id (KIP-516), read with a Metadata v10 request.

A topic deleted and re-created keeps its name and numbers its records from 0 again; once its new
log has grown past a consumer's position, nothing in the offsets, the high watermarks or the
partition leaders tells it from the old one. Its id does: the broker gives every topic it creates
a new one. aiokafka reads metadata up to v5, which carries no ids, so the request and its answer
are declared here on aiokafka's own protocol types (field layout as Kafka's Metadata v10 schema).
"""

from __future__ import annotations

from io import BytesIO

from aiokafka import AIOKafkaConsumer
from aiokafka.errors import IncompatibleBrokerVersion, KafkaConnectionError, UnknownTopicOrPartitionError, for_code
from aiokafka.protocol.api import Request, RequestStruct, Response
from aiokafka.protocol.types import AbstractType, Boolean, CompactArray, CompactString, Int16, Int32, Schema, TaggedFields

class _Uuid(AbstractType[bytes]):
    @classmethod
    def encode(cls, value: bytes) -> bytes:
        return value

    @classmethod
    def decode(cls, data: BytesIO) -> bytes:
        return data.read(16)


_STRING = CompactString("utf-8")


class _MetadataResponseV10(Response):
    API_KEY = 3
    API_VERSION = 10
    SCHEMA = Schema(
        ("throttle_time_ms", Int32),
        ("brokers", CompactArray(("node_id", Int32), ("host", _STRING), ("port", Int32), ("rack", _STRING), ("tags", TaggedFields))),
        ("cluster_id", _STRING),
        ("controller_id", Int32),
        ("topics", CompactArray(
            ("error_code", Int16), ("name", _STRING), ("topic_id", _Uuid), ("is_internal", Boolean),
            ("partitions", CompactArray(
                ("error_code", Int16), ("partition_index", Int32), ("leader_id", Int32), ("leader_epoch", Int32),
                ("replica_nodes", CompactArray(Int32)), ("isr_nodes", CompactArray(Int32)), ("offline_replicas", CompactArray(Int32)),
                ("tags", TaggedFields))),
            ("topic_authorized_operations", Int32), ("tags", TaggedFields))),
        ("cluster_authorized_operations", Int32),
        ("tags", TaggedFields),
    )


class _MetadataRequestV10(RequestStruct):
    FLEXIBLE_VERSION = True
    API_KEY = 3
    API_VERSION = 10
    RESPONSE_TYPE = _MetadataResponseV10
    SCHEMA = Schema(
        ("topics", CompactArray(("topic_id", _Uuid), ("name", _STRING), ("tags", TaggedFields))),
        ("allow_auto_topic_creation", Boolean),
        ("include_cluster_authorized_operations", Boolean),
        ("include_topic_authorized_operations", Boolean),
        ("tags", TaggedFields),
    )


class _TopicMetadata(Request[_MetadataRequestV10]):
    API_KEY = 3

    def __init__(self, topic: str):
        self.topic = topic

    def build(self, request_struct_class: type[_MetadataRequestV10]) -> _MetadataRequestV10:
        return request_struct_class([(bytes(16), self.topic, {})], False, False, False, {})


class TopicIdsUnsupported(Exception):
    """The broker does not answer Metadata v10 (Kafka before 2.8)."""


async def topic_id(consumer: AIOKafkaConsumer, topic: str) -> bytes | None:
    """``topic``'s id now; None when it does not exist. Raises ``TopicIdsUnsupported``, or
    KafkaError when the broker cannot be asked. Uses the consumer's client (a private
    attribute: aiokafka offers no raw request)."""
    client = consumer._client  # noqa: SLF001
    node = client.get_random_node()
    if node is None:
        raise KafkaConnectionError("no broker known")
    try:
        resp = await client.send(node, _TopicMetadata(topic))
    except (IncompatibleBrokerVersion, NotImplementedError) as e:
        raise TopicIdsUnsupported(str(e)) from None
    for error_code, name, tid, *_ in resp.topics:
        if name != topic:
            continue
        if error_code == UnknownTopicOrPartitionError.errno:
            return None
        if error_code:
            raise for_code(error_code)()
        if tid == bytes(16):
            raise TopicIdsUnsupported("the broker gives the topic no id")
        return tid
    return None
