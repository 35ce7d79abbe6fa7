"""The Kafka side of qworker: consume jobs, admit them, run them on the engine, publish results."""

from qworker.worker.app import Worker, serve

__all__ = ["Worker", "serve"]
