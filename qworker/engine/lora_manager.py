"""The engine's LoRA adapters: loading them off the step, the CPU cache, and the device slots.

An adapter is known by its ``lora_int_id``; while the engine knows an id (loading, loaded, or
named by a request in flight) that id names one folder: a ``LoRARequest`` with the same id and
another path is refused (``invalid_lora``).

- Loading: ``submit(req)`` (on ``add_request``) starts loading the request's adapter on one
  background thread unless it is loaded already; the request waits unscheduled
  (``Request.lora_loading``: the scheduler skips it, it holds nothing and stops nobody) until
  ``poll`` (the engine thread, at the start of a step) sees the load done. A load that fails
  finishes that request alone, unscheduled, with finish_reason "abort" and ``error_code``
  "invalid_lora"; requests of other adapters go on. The failure is not cached: a later request
  for the id tries again (the folder may have been fixed).
- CPU cache: loaded adapters in LRU order. At most ``max_cpu_loras`` of them are kept once no
  request in flight names them; an adapter a request in flight names is never dropped (its
  request already waited for it), so while more distinct adapters are in flight than
  ``max_cpu_loras``, more are held, and ``trim`` (after every step and abort) drops the excess
  once their requests are gone.
- Device slots: ``activate`` runs before each forward. The scheduler guarantees that the
  adapters of running sequences are at most ``max_loras`` (see ``scheduler.py``), so every adapter
  of the step finds a slot: the one it already has, else a free slot, else the least recently
  used slot whose adapter no running sequence uses (there always is one). A slot is thus never
  rewritten under a running sequence.

Everything but the load itself runs on the engine thread.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from qworker.engine.block_pool import NONE_HASH
from qworker.engine.config import EngineConfig
from qworker.engine.errors import InvalidRequestError
from qworker.engine.lora_request import LoRARequest
from qworker.engine.sequence import SeqStatus
from qworker.model.lora.adapter import LoRAAdapterError, load_lora_adapter

if TYPE_CHECKING:
    from qworker.engine.requests import RequestBook
    from qworker.engine.scheduler import ScheduledSeq, SchedulerOutput
    from qworker.engine.sequence import Request

ERR_LORA = "invalid_lora"  # RequestOutput.error_code / InvalidRequestError.code of an adapter refused


class LoRALoadError(InvalidRequestError, LoRAAdapterError):
    """An adapter that could not be loaded (``add_lora``, ``LLM.generate``): the engine's refusal
    (code "invalid_lora") and the loader's error type at once, with the loader's reason."""

    def __init__(self, message: str):
        InvalidRequestError.__init__(self, ERR_LORA, message)


def prefix_root(lora: LoRARequest | None, load: int = 0) -> bytes:
    """The parent hash of a sequence's first block: the base model keeps the plain root; an
    adapter's root is derived from its id, folder and ``load`` (which load of it the cache holds:
    the manager sets it once the adapter is loaded), so a block computed under one adapter is
    never a prefix hit for another adapter, for the base model, or for the same id and folder
    loaded again after ``remove_lora`` or an eviction (its files may have changed)."""
    if lora is None:
        return NONE_HASH
    return hashlib.sha256(NONE_HASH + b"lora\0" + str(lora.lora_int_id).encode() + b"\0" + lora.lora_path.encode()
                          + b"\0" + str(load).encode()).digest()


@dataclass(slots=True)
class _Entry:
    lora: LoRARequest
    adapter: object | None = None  # a qworker.model.lora.adapter.LoRAAdapter once loaded
    future: Future | None = None  # while loading
    waiters: list = field(default_factory=list)  # requests waiting for this load
    root: bytes = b""  # prefix_root of this load (set when it enters the cache)


class LoRAManager:
    def __init__(self, config: EngineConfig, runner, requests: dict[str, Request]):
        self.enabled = config.enable_lora
        self.max_loras = config.max_loras
        self.max_cpu_loras = config.max_cpu_loras
        self.max_rank = config.max_lora_rank
        self.runner = runner
        self.requests = requests  # the engine's requests in flight (the same dict)
        self.loaded: OrderedDict[int, _Entry] = OrderedDict()  # LRU: least recent first
        self.loading: dict[int, _Entry] = {}
        self.slot_ids: list[int | None] = [None] * config.max_loras  # slot -> adapter id
        self._slot_used: list[float] = [0.0] * config.max_loras  # last step a slot served
        self._pool: ThreadPoolExecutor | None = None
        self._wake = threading.Event()  # a load finished: a step with nothing to run sleeps on it
        self._loads = 0  # entries put in the cache so far: each gets its own prefix root
        self.counters = {"lora_loads": 0, "lora_load_failures": 0, "lora_slot_writes": 0, "lora_evictions": 0}
        if self.enabled:
            runner.enable_lora(config.max_loras, config.max_lora_rank)

    # -- requests ----------------------------------------------------------------------------------
    def check(self, lora: LoRARequest | None) -> None:
        """Refuses (``InvalidRequestError``, code "invalid_lora") a ``lora_request`` this engine can
        never serve: not a ``LoRARequest``, LoRA not enabled, or an id the engine knows under
        another path. Read-only, so another thread may call it too."""
        if lora is None:
            return
        if not isinstance(lora, LoRARequest):
            raise InvalidRequestError(ERR_LORA, f"lora_request must be a LoRARequest or None, got {type(lora).__name__}")
        if not self.enabled:
            raise InvalidRequestError(ERR_LORA, f"lora_request {lora.lora_name!r} given, but this engine was started without enable_lora=True")
        known = self._known(lora.lora_int_id)
        if known is not None and known.lora_path != lora.lora_path:
            raise InvalidRequestError(ERR_LORA, f"lora_int_id {lora.lora_int_id} already names adapter {known.lora_name!r} at "
                                      f"{known.lora_path!r}, not {lora.lora_path!r}; give each adapter folder its own id")

    def _known(self, int_id: int) -> LoRARequest | None:
        entry = self.loaded.get(int_id) or self.loading.get(int_id)
        if entry is not None:
            return entry.lora
        for req in list(self.requests.values()):
            if req.lora_request is not None and req.lora_request.lora_int_id == int_id:
                return req.lora_request
        return None

    def submit(self, req: Request) -> None:
        """``req`` (just made, under ``req.lora_request``) waits unscheduled until its adapter is
        loaded, unless it is loaded already."""
        lora = req.lora_request
        if lora is None:
            return
        entry = self.loaded.get(lora.lora_int_id)
        if entry is not None:
            self.loaded.move_to_end(lora.lora_int_id)
            req.prefix_root = entry.root
            return
        entry = self.loading.get(lora.lora_int_id)
        if entry is None:
            entry = self.loading[lora.lora_int_id] = _Entry(lora)
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="qworker-lora")
            entry.future = self._pool.submit(self._load, lora)
            entry.future.add_done_callback(lambda _f: self._wake.set())
        entry.waiters.append(req)
        req.lora_loading = True

    def _load(self, lora: LoRARequest):
        return load_lora_adapter(lora.lora_path, self.runner.config, self.max_rank)

    # -- the step ----------------------------------------------------------------------------------
    def poll(self, book: RequestBook, now: float) -> list[Request]:
        """Finished loads: their requests become schedulable, or (a failed load) end with
        "invalid_lora". Returns the requests it ended. Arms the wake event first, so a load
        finishing after the poll ends the sleep in ``wait_if_idle``."""
        if not self.loading:
            return []
        self._wake.clear()
        failed = []
        for int_id, entry in list(self.loading.items()):
            if not entry.future.done():
                continue
            del self.loading[int_id]
            err = entry.future.exception()
            if err is None:
                entry.adapter = entry.future.result()
                entry.future = None
                self.counters["lora_loads"] += 1
                self._insert(entry)
            else:
                self.counters["lora_load_failures"] += 1
            for req in entry.waiters:
                if book.requests.get(req.request_id) is not req or req.finished:
                    continue  # aborted or expired while it loaded
                if err is None:
                    req.prefix_root = entry.root  # nothing was hashed yet: it never ran
                    req.lora_loading = False
                    continue
                del book.requests[req.request_id]
                book.end(req, f"LoRA adapter {entry.lora.lora_name!r} (id {int_id}) could not be loaded: {err}", ERR_LORA, now)
                failed.append(req)
            entry.waiters = []
        return failed

    def wait_if_idle(self, sched: SchedulerOutput, timeout_s: float) -> None:
        """Nothing can run until an adapter loads: sleep until a load finishes, ``wake()`` is called
        or ``timeout_s`` passes, rather than spin."""
        if sched.empty and not sched.copies and self.loading:
            self._wake.wait(timeout_s)

    def wake(self) -> None:
        self._wake.set()

    def activate(self, scheduled: list[ScheduledSeq], running_ids) -> dict[int, int]:
        """Puts every adapter of the step's ``scheduled`` sequences in a device slot (see the
        module docstring); ``running_ids``: the adapters of all running sequences. Returns
        adapter id -> slot for this step."""
        if not self.enabled:
            return {}
        step_ids = {s.seq.request.lora_int_id for s in scheduled} - {0}
        if not step_ids:
            return {}
        now = time.monotonic()
        slots: dict[int, int] = {}
        missing = []
        for int_id in step_ids:
            if int_id in self.slot_ids:
                slots[int_id] = self.slot_ids.index(int_id)
            else:
                missing.append(int_id)
        for int_id in sorted(missing):
            slot = self._free_slot(step_ids, running_ids)
            entry = self.loaded[int_id]  # in flight, so never evicted
            # a write that fails halfway leaves a slot of neither adapter: free until one succeeds
            self.slot_ids[slot] = None
            self.runner.set_lora(slot, entry.adapter)
            self.slot_ids[slot] = int_id
            self.counters["lora_slot_writes"] += 1
            slots[int_id] = slot
        for int_id, slot in slots.items():
            self._slot_used[slot] = now
            self.loaded.move_to_end(int_id)
        return slots

    def _free_slot(self, step_ids: set[int], running_ids) -> int:
        if None in self.slot_ids:
            return self.slot_ids.index(None)
        spare = [i for i, a in enumerate(self.slot_ids) if a not in step_ids and a not in running_ids]
        if not spare:  # the scheduler's limit makes this unreachable
            raise RuntimeError(f"no LoRA slot free for this step: slots hold {self.slot_ids}, the step needs {sorted(step_ids)}")
        return min(spare, key=lambda i: self._slot_used[i])

    # -- the CPU cache -------------------------------------------------------------------------------
    def _insert(self, entry: _Entry) -> None:
        self._loads += 1
        entry.root = prefix_root(entry.lora, self._loads)
        self.loaded[entry.lora.lora_int_id] = entry
        self.loaded.move_to_end(entry.lora.lora_int_id)
        self.trim()

    def trim(self) -> None:
        """Drops least recently used adapters no request in flight names until at most
        ``max_cpu_loras`` are loaded (or only adapters in flight are left)."""
        if len(self.loaded) <= self.max_cpu_loras:
            return
        in_flight = self.ids_in_flight()
        for int_id in list(self.loaded):
            if len(self.loaded) <= self.max_cpu_loras:
                break
            if int_id not in in_flight:
                del self.loaded[int_id]
                self._forget_slot(int_id)
                self.counters["lora_evictions"] += 1

    def _forget_slot(self, int_id: int) -> None:
        """Marks the slot holding ``int_id`` (if any) free. Once the cache has dropped an id, the
        engine no longer knows it: it may come back under another folder (or its files rewritten),
        and must then be written to a slot again, never served from the old weights."""
        if int_id in self.slot_ids:
            self.slot_ids[self.slot_ids.index(int_id)] = None

    def ids_in_flight(self) -> set[int]:
        return {r.lora_request.lora_int_id for r in self.requests.values() if r.lora_request is not None}

    def load(self, lora: LoRARequest):
        """Reads and validates ``lora``'s folder (blocking; any thread; the cache is untouched).
        Raises ``InvalidRequestError`` ("invalid_lora") with the loader's reason."""
        self.check(lora)
        if lora is None:
            raise InvalidRequestError(ERR_LORA, "add_lora needs a LoRARequest")
        try:
            return self._load(lora)
        except (ValueError, OSError) as e:  # LoRAAdapterError (a ValueError), or the folder unreadable
            raise LoRALoadError(f"LoRA adapter {lora.lora_name!r} (id {lora.lora_int_id}) could not be loaded: {e}") from e

    def add(self, lora: LoRARequest, adapter=None) -> bool:
        """vLLM's ``add_lora``: loads (blocking, unless ``adapter`` is what ``load`` returned for
        it) and validates ``lora`` into the CPU cache; raises ``InvalidRequestError``
        ("invalid_lora") naming the problem. True once it is loaded."""
        self.check(lora)
        if lora is None:
            raise InvalidRequestError(ERR_LORA, "add_lora needs a LoRARequest")
        if lora.lora_int_id in self.loaded:
            self.loaded.move_to_end(lora.lora_int_id)
            return True
        if adapter is None:
            adapter = self.load(lora)
        self.counters["lora_loads"] += 1
        self._insert(_Entry(lora, adapter))
        return True

    def remove(self, int_id: int) -> bool:
        """vLLM's ``remove_lora``: drops adapter ``int_id`` from the CPU cache and its device slot.
        False when it was not loaded, or a request in flight still uses it (then nothing moves)."""
        if int_id in self.ids_in_flight() or int_id not in self.loaded:
            return False
        del self.loaded[int_id]
        if int_id in self.slot_ids:
            slot = self.slot_ids.index(int_id)
            self.runner.set_lora(slot, None)
            self.slot_ids[slot] = None
        return True

    def list(self) -> set[int]:
        """vLLM's ``list_loras``: the ids of the adapters loaded."""
        return set(self.loaded)

    # -- introspection -----------------------------------------------------------------------------
    def request_counts(self) -> dict:
        """Requests in flight per adapter name: ``running`` (a choice running) and ``waiting`` (the
        rest: queued, swapped out, or waiting for the adapter to load); the shape vLLM's
        ``vllm:lora_requests_info`` gauge is built from."""
        running: dict[str, int] = {}
        waiting: dict[str, int] = {}
        for req in list(self.requests.values()):
            lora = req.lora_request
            if lora is None:
                continue
            side = running if any(s.status is SeqStatus.RUNNING for s in req.seqs) else waiting
            side[lora.lora_name] = side.get(lora.lora_name, 0) + 1
        return {"running": running, "waiting": waiting, "max_lora": self.max_loras if self.enabled else 0}

    def stats(self) -> dict:
        return {**self.counters, "lora_loaded": len(self.loaded), "lora_loading": len(self.loading),
                "lora_slots_used": sum(a is not None for a in self.slot_ids) if self.enabled else 0}
