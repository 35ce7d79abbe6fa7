"""Starting a Kafka producer, re-exported where tests import it; it lives in ``qworker.producer``."""

from qworker.producer import FALLBACK_WARNING, start_producer

__all__ = ["FALLBACK_WARNING", "start_producer"]
