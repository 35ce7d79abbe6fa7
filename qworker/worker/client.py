"""The producer-side client, re-exported where the CLI, demo, benches and tests import it.

It lives in ``qworker.client``, below both ``worker/`` and ``openai_batch/``.
"""

from qworker.client import MAX_JOB_RECORD_BYTES, ResultReader, cancel, create_topics, dumps_any, parse, producer_for, result_topics, submit

__all__ = ["MAX_JOB_RECORD_BYTES", "ResultReader", "cancel", "create_topics", "dumps_any", "parse", "producer_for", "result_topics", "submit"]
