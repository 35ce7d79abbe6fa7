"""The LoRA adapters this worker serves: names from the settings -> validated ``LoRARequest``s.

A job never carries a path: it names an adapter (native ``lora``, or OpenAI's ``model``), and
only the names in ``QWORKER_LORA_MODULES`` exist. Invariants:

- ``served`` holds only adapters that passed ``load_lora_adapter`` (inside ``QWORKER_LORA_ROOT``
  when set, rank within ``max_lora_rank``, shapes of this base model, finite weights); an adapter
  that fails is ``refused`` with its reason (one log line, counted in ``refusals``),
  and jobs naming it get ``model_not_found`` saying why. No failure stops the worker.
- ``lora_path`` is the folder as it resolved when validated, so a symlink moved later cannot
  redirect the engine elsewhere.
- Int ids are stable per (name, version) for the life of the process: a version is the resolved
  folder plus the size, mtime, ctime and inode of its two files (ctime: a write in place that
  restores the mtime, as ``cp -p`` or ``rsync -t --inplace`` do, still changes it). A path that changes, or files
  rewritten in place, get a new id, so the engine's prefix cache and adapter cache (keyed by the
  id) never mix two versions. Ids are never reused.
- Reload (``refresh``, every ``lora_reload_interval_s``): the modules file is re-read when its
  bytes change (a bad new version keeps the last good set), and every adapter's version is
  re-checked; only what changed is validated again. An empty file after a non-empty one is taken
  for a write in progress, not for "no adapters" (``{}`` says that). A refused adapter whose folder changes
  (e.g. appears) is tried again. A removed name stops taking new jobs at once; its running jobs
  finish under the version they started with; a version no longer served is dropped from the
  engine's adapter cache (``release``) once no request uses it.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from qworker.engine.lora_request import LoRARequest
from qworker.lora_modules import MAX_FILE_BYTES, LoRAModulesError, is_file_source, parse_file_bytes, parse_modules

log = logging.getLogger("qworker.worker")

FILES = ("adapter_config.json", "adapter_model.safetensors")
_UNREAD = b"\x00unread"  # no file bytes seen yet (a real modules file is UTF-8 text, never this)
_LISTED = 20  # names quoted in a model_not_found message
MAX_RETIRED = 1024  # retired versions remembered for release (beyond: the engine's LRU drops them)


@dataclass(frozen=True, slots=True)
class Resolution:
    """A job's adapter (None: the base model), or the error that answers it."""

    lora: LoRARequest | None = None
    code: str | None = None
    message: str = ""


def version(path: str) -> tuple | None:
    """What identifies an adapter folder's current content without reading it; None when it
    cannot be read (missing, not a folder)."""
    try:
        folder = os.path.realpath(path)
        stats = [os.stat(os.path.join(folder, f)) for f in FILES]
    except OSError:
        return None
    return (folder, *((s.st_size, s.st_mtime_ns, s.st_ctime_ns, s.st_ino) for s in stats))


Validate = Callable[[str], str]  # path -> resolved folder; raises ValueError with the reason


class Adapters:
    """The adapter table of one worker. ``validate`` runs on a thread (it reads the files);
    everything else runs on the worker's event loop."""

    def __init__(self, modules: str | None, validate: Validate, base_name: str, base_names: set[str] = frozenset()):
        self.source = modules  # the setting's text: inline modules, or a file path
        self.validate = validate
        self.base_name = base_name  # the served name
        self.base_names = {base_name, *base_names}  # every name of the base model a job may use
        self.refusals: dict[str, int] = {}  # name -> times refused (a metric)
        self.file_errors = 0  # versions of the modules file that could not be used (a metric)
        self.served: dict[str, LoRARequest] = {}
        self.refused: dict[str, str] = {}  # name -> why
        self._versions: dict[str, tuple | None] = {}  # name -> the version last validated
        self._paths: dict[str, str] = {}  # name -> configured path
        self._ids: dict[tuple[str, tuple | None], int] = {}
        self._next_id = 1
        self._file_bytes: bytes | None = _UNREAD  # the file's last bytes; None: unreadable last time
        self.engine: Any = None  # set: versions no longer served are dropped from its adapter cache
        self.retired: list[LoRARequest] = []  # no longer served, maybe still in the engine's cache

    # ------------------------------------------------------------------ lookups (event loop)
    def resolve(self, model: str | None, lora: str | None, enabled: bool) -> Resolution:
        """The adapter a job asks for: ``lora`` (native) or a ``model`` that names an adapter
        (OpenAI's way). A ``model`` naming neither the base nor an adapter is ``model_not_found``
        when LoRA is on (it may be an adapter this pod does not have), else ``wrong_model``."""
        by_model = None
        if model is not None and model not in self.base_names:
            if model in self.served:
                by_model = model
            elif enabled:
                return Resolution(code="model_not_found", message=self._missing("model", model))
            else:
                return Resolution(code="wrong_model", message=f"this worker serves {self.base_name!r}, not {model!r}")
        if lora is not None:
            if not enabled:
                return Resolution(code="model_not_found", message=f"lora {lora!r}: this worker serves no LoRA adapters")
            if by_model is not None and lora != by_model:
                return Resolution(code="invalid_job", message=f"model names the adapter {model!r} but lora names {lora!r}; set one")
            if lora not in self.served:
                return Resolution(code="model_not_found", message=self._missing("lora", lora))
            return Resolution(self.served[lora])
        return Resolution(self.served[by_model]) if by_model is not None else Resolution()

    def _missing(self, field: str, name: str) -> str:
        if name in self.refused:
            return f"{field} {name!r}: the adapter was refused at load: {self.refused[name]}"
        names = sorted(self.served)
        listed = ", ".join(names[:_LISTED]) + (f", ... ({len(names)} in all)" if len(names) > _LISTED else "")
        return f"{field} {name!r}: the model does not exist on this worker (base model {self.base_name!r}; adapters: {listed or 'none'})"

    # ------------------------------------------------------------------ loading
    async def refresh(self) -> bool:
        """Re-read the modules (a file source) and validate what changed. Returns whether the
        table changed. Never raises for a bad file or adapter."""
        modules = self._read()
        if modules is None:  # unreadable now: keep the last good set
            modules = dict(self._paths)
        changed = False
        for name in [n for n in self._paths if n not in modules]:
            self._drop(name)
            log.info("LoRA adapter %r removed from the modules: no new jobs take it", name)
            changed = True
        # stat calls on a thread: adapter folders may sit on a network volume
        checks = await asyncio.to_thread(lambda: {name: version(path) for name, path in modules.items()})
        todo = [(name, path) for name, path in modules.items() if name not in self._paths or self._paths[name] != path or self._versions.get(name) != checks[name]]
        for name, path in todo:
            self._paths[name] = path
            self._versions[name] = checks[name]
            reason = self._name_clash(name)
            resolved = None
            if reason is None:
                try:
                    resolved = await asyncio.to_thread(self.validate, path)
                except Exception as e:  # noqa: BLE001 - any failure refuses this adapter alone
                    reason = " ".join(str(e).split())[:1000] or type(e).__name__
            if reason is not None:
                self._retire(self.served.pop(name, None))
                self.refused[name] = reason
                self.refusals[name] = self.refusals.get(name, 0) + 1
                log.error("LoRA adapter %r (%s) refused: %s", name, path, reason)
            else:
                self.refused.pop(name, None)
                req = LoRARequest(name, self._id_for(name, checks[name]), resolved or path)
                old = self.served.get(name)
                if old is not None and old.lora_int_id != req.lora_int_id:
                    self._retire(old)
                self.served[name] = req
                log.info("LoRA adapter %r %s: %s (id %d)", name, "reloaded" if old is not None else "serving", req.lora_path, req.lora_int_id)
            changed = True
        return changed

    def _read(self) -> dict[str, str] | None:
        src = self.source
        if src is None:
            return {}
        if not is_file_source(src):
            return parse_modules(src)  # checked by the settings already
        path = src.strip()
        try:
            with open(path, "rb") as f:
                raw = f.read(MAX_FILE_BYTES + 1)
        except OSError as e:
            if self._file_bytes is not None:
                self.file_errors += 1
                log.error("LoRA modules file %s unreadable (%s); keeping the %d adapters read before", path, e.strerror or e, len(self._paths))
                self._file_bytes = None
            return None
        if raw == self._file_bytes:
            return dict(self._paths)
        self._file_bytes = raw
        if not raw.strip() and self._paths:
            # most often a file being rewritten in place (``>`` truncates before it writes): taken
            # as it stands, every adapter job would fail at once, and for good (model_not_found)
            self.file_errors += 1
            log.error("LoRA modules file %s is empty (a write in progress?); keeping the %d adapters read before (write {} to serve none)",
                      path, len(self._paths))
            return None
        try:
            return parse_file_bytes(raw, path)
        except LoRAModulesError as e:
            self.file_errors += 1
            log.error("LoRA modules file rejected (%s); keeping the %d adapters read before", e, len(self._paths))
            return None

    def _name_clash(self, name: str) -> str | None:
        if name in self.base_names:
            return f"the name {name!r} is the base model's; jobs naming it run the base model"
        return None

    def _id_for(self, name: str, ver: tuple | None) -> int:
        key = (name, ver)
        if key not in self._ids:
            self._ids[key] = self._next_id
            self._next_id += 1
        return self._ids[key]

    def _retire(self, req: LoRARequest | None) -> None:
        if req is not None:
            self.retired = [*self.retired, req][-MAX_RETIRED:]

    async def release(self) -> None:
        """Drops retired versions from the engine's adapter cache once no request uses them
        (the engine refuses while one does: tried again next round). Memory only: a retired id
        is never handed out again, so nothing could hit it anyway."""
        if not self.retired or self.engine is None or not hasattr(self.engine, "remove_lora"):
            return
        loaded = await self.engine.list_loras()
        keep = []
        for req in self.retired:
            if req.lora_int_id in loaded and not await self.engine.remove_lora(req.lora_int_id):
                keep.append(req)
            elif req.lora_int_id in loaded:
                log.info("LoRA adapter %r version %d dropped from the engine's cache", req.lora_name, req.lora_int_id)
        self.retired = keep

    def _drop(self, name: str) -> None:
        self._retire(self.served.get(name))
        self.served.pop(name, None)
        self.refused.pop(name, None)
        self._paths.pop(name, None)
        self._versions.pop(name, None)

    async def reload_loop(self, interval_s: float, on_change: Callable[[], None] | None = None) -> None:
        """``refresh`` forever; a failing round is logged and the next one starts afresh."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                if await self.refresh() and on_change is not None:
                    on_change()
                await self.release()
            except Exception:  # noqa: BLE001 - the loop must outlive any one bad round
                log.exception("LoRA reload round failed")


class LoRAUnavailable(Exception):
    """Adapters are configured but the engine cannot serve them (one line, a startup error)."""


async def start_adapters(modules: str | None, root: str | None, engine: Any, base_name: str, base_names: set[str]) -> Adapters:
    """The worker's adapter table, loaded: each adapter validated by the model layer's
    ``load_lora_adapter`` against the engine's base model and ``max_lora_rank``, inside ``root``."""
    from qworker.model.loader import load_config
    from qworker.model.lora.adapter import load_lora_adapter

    cfg = getattr(getattr(engine, "engine", None), "config", None)  # the engine's EngineConfig
    if cfg is None or not getattr(cfg, "enable_lora", False):
        raise LoRAUnavailable("LoRA adapters are configured (QWORKER_LORA_MODULES / QWORKER_ENABLE_LORA) but the engine was built without enable_lora")
    base_config = await asyncio.to_thread(load_config, cfg.model)
    max_rank = cfg.max_lora_rank

    def validate(path: str) -> str:
        return load_lora_adapter(path, base_config, max_rank, root=root).path

    table = Adapters(modules, validate, base_name, base_names)
    table.engine = engine
    await table.refresh()
    return table
