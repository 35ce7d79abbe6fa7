"""Worker settings: defaults < ``QWORKER_*`` environment variables < command-line flags.

Every field ``foo_bar`` is read from ``QWORKER_FOO_BAR``. Defaults suit real Kafka in
production (idempotent producer, acks=all, 45 s sessions); tests and the demo override the
timing knobs for the bundled Tansu broker (see DESIGN.md for its quirks).
"""

from __future__ import annotations

import json
import os
import re
import socket
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

ENV_PREFIX = "QWORKER_"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_size(value: str | int | None) -> int | None:
    """``"512MiB"`` / ``"2G"`` / ``"1048576"`` -> bytes."""
    if value is None or isinstance(value, int):
        return value
    m = _SIZE.match(str(value))
    if not m:
        raise ValueError(f"not a size: {value!r}")
    unit = (m.group(2) or "").lower().removesuffix("b")
    if not unit and "." in m.group(1):  # vLLM's swap_space=4.0 means GiB: here it would be 4 bytes
        raise ValueError(f"not a size: {value!r} (a byte count is a whole number; a fraction needs a unit, as 1.5GiB)")
    return int(float(m.group(1)) * _UNITS[unit])


# Below this a byte count is a mistake (a fraction written without its decimal point, a unit
# left out), never a KV cache that holds a useful number of tokens.
MIN_KV_BYTES = 1 << 20
INT32_MAX = 2**31 - 1  # Kafka's protocol carries the client's timings as int32 milliseconds
_FRACTION = re.compile(r"^\s*\d*\.\d*\s*$")
_TOPIC = re.compile(r"^[A-Za-z0-9._-]{1,249}$")  # what Kafka accepts as a topic name


def parse_kv_memory(value: Any) -> int | float | None:
    """``kv_cache_memory``: bytes (``"512MiB"``, ``"2G"``, ``1073741824``; at least 1 MiB) or a
    fraction of memory in (0, 1] written with a decimal point (``"0.9"``, ``0.9``, ``"1.0"``)."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, bool):
        raise ValueError("must be bytes (e.g. 512MiB, 2G) or a fraction of memory such as 0.9")
    if isinstance(value, float) or (isinstance(value, str) and _FRACTION.match(value)):
        try:
            f = float(value)
        except ValueError:
            raise ValueError("must be bytes (e.g. 512MiB, 2G) or a fraction of memory such as 0.9") from None
        if not 0.0 < f <= 1.0:
            raise ValueError(f"a fraction of memory must be in (0, 1], got {f:g} (bytes take a unit: 512MiB, 2G)")
        return f
    try:
        n = parse_size(value) if isinstance(value, str) else value
    except ValueError:
        raise ValueError("must be bytes (e.g. 512MiB, 2G) or a fraction of memory such as 0.9") from None
    if not isinstance(n, int) or n < MIN_KV_BYTES:
        raise ValueError(f"{n} bytes is too small for a KV cache (at least 1MiB); give bytes with a unit "
                         "(512MiB, 2G) or a fraction of memory in (0, 1] such as 0.9")
    return n


class WorkerSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    # --- Kafka ---
    bootstrap_servers: str = "localhost:9092"
    group_id: str = "qworker"
    client_id: str = Field(default_factory=lambda: f"qworker-{socket.gethostname()}-{os.getpid()}")
    jobs_topic: str = "qworker.jobs"
    tokens_topic: str = "qworker.tokens"
    completions_topic: str = "qworker.completions"
    dlq_topic: str = "qworker.dlq"
    cancel_topic: str = "qworker.cancel"
    kafka_security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    kafka_sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = None
    kafka_sasl_username: str | None = None
    kafka_sasl_password: str | None = None
    kafka_ssl_cafile: str | None = None
    kafka_ssl_certfile: str | None = None
    kafka_ssl_keyfile: str | None = None
    # Idempotence needs InitProducerId v1+; real Kafka has it, Tansu does not (tests set false).
    enable_idempotence: bool = True
    compression_type: Literal["gzip", "snappy", "lz4", "zstd"] | None = "zstd"
    # Kafka client timings: 0 or a negative value hangs or spins the client instead of failing;
    # the protocol carries them as int32 (a larger one failed inside aiokafka after the model loaded)
    linger_ms: int = Field(5, ge=0, le=INT32_MAX)
    session_timeout_ms: int = Field(45_000, ge=1, le=INT32_MAX)
    heartbeat_interval_ms: int = Field(3_000, ge=1, le=INT32_MAX)  # below session_timeout_ms
    # Only a safety net: the poll loop never blocks on generation, so this is never reached
    # by long jobs (aiokafka issue 848).
    max_poll_interval_ms: int = Field(300_000, ge=1, le=INT32_MAX)
    fetch_max_wait_ms: int = Field(100, ge=0, le=INT32_MAX)
    request_timeout_ms: int = Field(30_000, ge=1, le=INT32_MAX)
    # at least 1 ms: 0 would turn the commit loop and a streaming job's ticker into busy loops
    commit_interval_ms: int = Field(500, ge=1, le=INT32_MAX)
    stream_interval_ms: int = Field(50, ge=1, le=INT32_MAX)
    # finite: the cancel reader starts this far back in time (int(inf) killed it; a start before
    # the epoch is read from the beginning)
    cancel_ttl_s: float = Field(600.0, ge=0, allow_inf_nan=False)
    # The largest record the worker produces (uncompressed key + value + headers). Match the
    # broker's message.max.bytes (Kafka's default is about 1 MB): a completion over it is
    # answered with error 'result_too_large' instead of being retried forever.
    max_message_bytes: int = Field(1_000_000, ge=16_384)

    # --- engine ---
    model: str | None = None  # model directory
    model_name: str | None = None  # the name jobs' "model" must match; default: the engine's
    # bytes (512MiB, 2G, ...) or a fraction of memory in (0, 1] with a decimal point (0.9): on
    # CUDA vLLM's gpu_memory_utilization, on CPU of the memory available at start less the
    # weights (qworker/host_memory.py)
    kv_cache_memory: int | float | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    block_size: int | None = None
    swap_space: int | None = None  # bytes
    enable_prefix_caching: bool | None = None
    device: str | None = None
    dtype: str | None = None
    kv_cache_dtype: str | None = None  # auto | float32 | float16 (CPU)
    # structured output: compiled grammars kept (LRU), and seconds a compile may take before the
    # job gets invalid_structured_output
    grammar_cache_size: int | None = Field(None, ge=1)
    grammar_cache_bytes: int | None = Field(None, ge=0)  # bytes of compiled grammar cached ("256MiB")
    grammar_compile_timeout: float | None = Field(None, gt=0)
    # speculative decoding: vLLM's speculative_config as JSON, e.g. {"method": "ngram",
    # "num_speculative_tokens": 6, "prompt_lookup_min": 2, "prompt_lookup_max": 4, "policy": "auto"}
    speculative_config: dict[str, Any] | None = None
    # tensor parallelism: the model sharded over this many devices of the pod (rank 0 is this
    # process, ranks 1.. are spawned); across pods, see the chart's leaderWorkerSet option
    tensor_parallel_size: int | None = Field(None, ge=1)
    # LoRA adapters (qworker/lora_modules.py): JSON {"name": "path"}, vLLM's "name=path ..." list,
    # or the path of a file holding either, re-read every lora_reload_interval_s when it changes.
    # Setting it turns LoRA on (enable_lora: on with no adapters yet). Every adapter folder must
    # resolve inside lora_root when that is set.
    lora_modules: str | None = None
    lora_root: str | None = None
    enable_lora: bool | None = None
    max_loras: int | None = Field(None, ge=1)  # distinct adapters in one engine step
    max_lora_rank: int | None = Field(None, ge=1)
    max_cpu_loras: int | None = Field(None, ge=1)  # adapters kept loaded in host memory (LRU)
    lora_reload_interval_s: float = Field(10.0, gt=0, allow_inf_nan=False)

    # --- admission, shutdown, ops ---
    max_waiting_jobs: int = Field(16, ge=1)
    admission_reserve_tokens: int = Field(256, ge=0)
    drain_timeout_s: float = Field(120.0, ge=0, allow_inf_nan=False)
    http_host: str = "0.0.0.0"
    http_port: int = Field(8080, ge=-1, le=65535)  # 0: any free port; -1: no HTTP server
    # /healthz fails when the engine loop made no progress for this long while jobs run; it
    # must exceed the longest step (a full prefill batch on a slow device)
    liveness_timeout_s: float = Field(120.0, gt=0, allow_inf_nan=False)
    # /readyz's in_group fails when the consumer has not confirmed its group state with the
    # broker (coordinator answering, assignment current, fetches answered) for this long; at
    # least 1 s (the check runs every quarter of it), finite (inf: ready forever)
    ready_timeout_s: float = Field(30.0, ge=1, allow_inf_nan=False)
    log_level: str = "INFO"
    log_format: Literal["json", "text"] = "json"  # json: one object per line, with trace ids

    @field_validator("log_level")
    @classmethod
    def _log_level(cls, v: str) -> str:
        import logging

        if not isinstance(logging.getLevelName(v.upper()), int):
            raise ValueError(f"not a log level: {v!r} (DEBUG, INFO, WARNING, ERROR, CRITICAL)")
        return v

    @field_validator("swap_space", "grammar_cache_bytes", mode="before")
    @classmethod
    def _size(cls, v: Any) -> Any:
        return parse_size(v) if isinstance(v, str) else v

    @field_validator("kv_cache_memory", mode="before")
    @classmethod
    def _kv_memory(cls, v: Any) -> Any:
        return parse_kv_memory(v)

    @field_validator("block_size", "max_num_seqs", "max_num_batched_tokens", "swap_space", "kv_cache_dtype", "dtype")
    @classmethod
    def _engine_rule(cls, v: Any, info: Any) -> Any:
        # the engine's own rules, checked here so a bad value is one line naming its variable
        # rather than a traceback once the model has loaded
        if v is None:
            return v
        if info.field_name == "dtype":
            if v not in ("auto", "float32", "bfloat16", "float16"):
                raise ValueError("must be auto, float32, bfloat16 or float16")
            return v
        from qworker.engine.config import EngineConfig

        EngineConfig(model="-", **{info.field_name: v})
        return v

    @field_validator("speculative_config", mode="before")
    @classmethod
    def _speculative(cls, v: Any) -> Any:
        if isinstance(v, str) and not v.strip():
            return None
        if isinstance(v, str):
            try:
                v = json.loads(v)
            except ValueError as e:
                raise ValueError(f"not JSON: {e}") from None
        if v is not None:
            from qworker.engine.spec_decode.config import SpeculativeConfig

            if not isinstance(v, dict):
                raise ValueError("must be a JSON object")
            SpeculativeConfig.parse(v)  # checked at start-up, before the model loads
        return v

    @field_validator("lora_modules", mode="before")
    @classmethod
    def _lora_modules_mapping(cls, v: Any) -> Any:
        # from Python (Worker(WorkerSettings(...)), -o) a mapping is the JSON spelling
        if isinstance(v, Mapping):
            return json.dumps(dict(v))
        return v

    @field_validator("lora_modules")
    @classmethod
    def _lora_modules(cls, v: str | None) -> str | None:
        # read once here so that a typo stops the start with one line; a file's later
        # versions are checked by the worker, which keeps the last good set
        if v is not None:
            from qworker.lora_modules import is_file_source, parse_modules, read_modules_file

            if is_file_source(v):
                read_modules_file(v.strip())
            else:
                parse_modules(v)
        return v

    @field_validator("lora_root")
    @classmethod
    def _lora_root(cls, v: str | None) -> str | None:
        if v is not None and not os.path.isdir(v):
            raise ValueError("no such directory")
        return v

    @property
    def lora_enabled(self) -> bool:
        """LoRA is on when adapters are configured, unless ``enable_lora`` says false."""
        return bool(self.enable_lora) if self.enable_lora is not None else self.lora_modules is not None

    @field_validator("jobs_topic", "tokens_topic", "completions_topic", "dlq_topic", "cancel_topic")
    @classmethod
    def _topic(cls, v: str) -> str:
        if not _TOPIC.match(v) or v in (".", ".."):
            raise ValueError("a Kafka topic name is 1-249 of the characters a-z A-Z 0-9 . _ -")
        return v

    @field_validator("bootstrap_servers")
    @classmethod
    def _bootstrap(cls, v: str) -> str:
        for entry in v.split(","):
            host, colon, port = entry.strip().rpartition(":")
            if not colon:
                host, port = port, "9092"
            if not host.strip("[]") or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError("must be host:port[,host:port...]")
        return v

    @field_validator("device")
    @classmethod
    def _device(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"auto|cpu|cuda(:\d+)?", v):
            raise ValueError("must be auto, cpu, cuda or cuda:N")
        return v

    @field_validator("kafka_ssl_cafile", "kafka_ssl_certfile", "kafka_ssl_keyfile")
    @classmethod
    def _readable_file(cls, v: str | None) -> str | None:
        if v is not None and not os.path.isfile(v):
            raise ValueError("no such file")
        return v

    @model_validator(mode="after")
    def _tls_files_load(self) -> WorkerSettings:
        """The TLS files parse (a CA file that is not a certificate failed inside aiokafka, as a
        traceback, once the model had loaded)."""
        if self.kafka_security_protocol not in ("SSL", "SASL_SSL"):
            return self
        import ssl

        from aiokafka.helpers import create_ssl_context

        try:
            create_ssl_context(cafile=self.kafka_ssl_cafile)
        except (ssl.SSLError, OSError) as e:
            raise ValueError(f"QWORKER_KAFKA_SSL_CAFILE: not a CA certificate file ({e})") from None
        if self.kafka_ssl_certfile is not None:
            try:
                create_ssl_context(certfile=self.kafka_ssl_certfile, keyfile=self.kafka_ssl_keyfile)
            except (ssl.SSLError, OSError) as e:
                raise ValueError(f"QWORKER_KAFKA_SSL_CERTFILE / QWORKER_KAFKA_SSL_KEYFILE: not a certificate and its key ({e})") from None
        return self

    @model_validator(mode="after")
    def _heartbeat_within_session(self) -> WorkerSettings:
        if self.heartbeat_interval_ms >= self.session_timeout_ms:
            raise ValueError(f"QWORKER_HEARTBEAT_INTERVAL_MS ({self.heartbeat_interval_ms}) must be below QWORKER_SESSION_TIMEOUT_MS ({self.session_timeout_ms})")
        return self

    @model_validator(mode="after")
    def _lora_limits(self) -> WorkerSettings:
        if self.enable_lora is False and self.lora_modules is not None:
            raise ValueError("QWORKER_LORA_MODULES is set but QWORKER_ENABLE_LORA is false: unset one")
        if self.max_loras is not None and self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"QWORKER_MAX_CPU_LORAS ({self.max_cpu_loras}) must be at least QWORKER_MAX_LORAS ({self.max_loras})")
        return self

    @field_validator("*", mode="before")
    @classmethod
    def _empty_is_none(cls, v: Any) -> Any:
        return None if isinstance(v, str) and v.strip() == "" else v

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> WorkerSettings:
        """Settings from ``QWORKER_*`` variables, then ``overrides`` (flags; None means unset)."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for name in cls.model_fields:
            key = ENV_PREFIX + name.upper()
            if key in env:
                values[name] = env[key]
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls.model_validate(values)

    @classmethod
    def explain(cls, err: ValidationError) -> str:
        """One line naming each bad setting by its environment variable (what an operator sets)."""
        parts = []
        for e in err.errors(include_url=False):
            name = str(e["loc"][0]) if e["loc"] else ""
            var = ENV_PREFIX + name.upper() if name in cls.model_fields else name or "settings"
            given = f" (got {e['input']!r})" if "input" in e and not isinstance(e["input"], dict) else ""
            msg = e["msg"].removeprefix("Value error, ")
            if not e["loc"]:  # a rule across settings: its message names them
                parts.append(msg)
                continue
            parts.append(f"{var}: {msg}{given}" if name in cls.model_fields else f"unknown setting {name!r}")
        return "invalid settings: " + "; ".join(parts)

    def engine_config(self) -> dict[str, Any]:
        """Keyword arguments for ``AsyncEngine.from_model`` (only what was set)."""
        keys = ("kv_cache_memory", "max_num_seqs", "max_num_batched_tokens", "block_size", "swap_space", "enable_prefix_caching", "device", "dtype", "kv_cache_dtype",
                "grammar_cache_size", "grammar_cache_bytes", "grammar_compile_timeout", "speculative_config", "tensor_parallel_size")
        cfg = {k: getattr(self, k) for k in keys if getattr(self, k) is not None}
        if isinstance(self.kv_cache_memory, float):  # a fraction: the engine sizes the pool per device
            from qworker.host_memory import cpu_kv_budget

            del cfg["kv_cache_memory"]
            cfg["gpu_memory_utilization"] = self.kv_cache_memory
            cfg["cpu_kv_cache_memory"] = cpu_kv_budget(self.kv_cache_memory, self.model)
        if self.lora_enabled:
            cfg["enable_lora"] = True
            cfg.update({k: getattr(self, k) for k in ("max_loras", "max_lora_rank", "max_cpu_loras") if getattr(self, k) is not None})
        cfg["scheduling_policy"] = "priority"  # jobs carry a priority; lower runs first
        return cfg

    def kafka_common(self) -> dict[str, Any]:
        """Connection and security options shared by consumers, producers and the admin client."""
        opts: dict[str, Any] = {"bootstrap_servers": self.bootstrap_servers, "security_protocol": self.kafka_security_protocol}
        if self.kafka_security_protocol in ("SSL", "SASL_SSL"):
            from aiokafka.helpers import create_ssl_context

            opts["ssl_context"] = create_ssl_context(
                cafile=self.kafka_ssl_cafile, certfile=self.kafka_ssl_certfile, keyfile=self.kafka_ssl_keyfile
            )
        if self.kafka_security_protocol.startswith("SASL"):
            opts["sasl_mechanism"] = self.kafka_sasl_mechanism or "PLAIN"
            opts["sasl_plain_username"] = self.kafka_sasl_username
            opts["sasl_plain_password"] = self.kafka_sasl_password
        return opts

    def producer_options(self) -> dict[str, Any]:
        # acks=all: a result counts as delivered only when every in-sync replica has it, because
        # the job's offset is committed right after.
        return {
            **self.kafka_common(),
            "client_id": self.client_id,
            "acks": "all",
            "enable_idempotence": self.enable_idempotence,
            "compression_type": self.compression_type,
            "linger_ms": self.linger_ms,
            "request_timeout_ms": self.request_timeout_ms,
            "max_request_size": self.max_message_bytes,
        }

    def consumer_options(self) -> dict[str, Any]:
        return {
            **self.kafka_common(),
            "client_id": self.client_id,
            "group_id": self.group_id,
            "enable_auto_commit": False,  # offsets move only when results are delivered
            "auto_offset_reset": "earliest",  # a new group must not skip queued jobs
            "session_timeout_ms": self.session_timeout_ms,
            "heartbeat_interval_ms": self.heartbeat_interval_ms,
            "max_poll_interval_ms": self.max_poll_interval_ms,
            "rebalance_timeout_ms": max(self.session_timeout_ms, 10_000),
            "fetch_max_wait_ms": self.fetch_max_wait_ms,
            "request_timeout_ms": max(self.request_timeout_ms, self.session_timeout_ms + 5_000),
        }
