"""LoRA on the worker side, without a broker or a model: QWORKER_LORA_MODULES parsing, the
adapter table (names -> LoRARequest, int ids per version, reload, refusals) and its metrics.

The adapter check here is a stand-in (``validate`` is injected; the real one, the model layer's
``load_lora_adapter``, runs in test_worker_lora.py), and so is the engine's adapter cache in one
test (``CacheStandIn``, its two calls only): these tests are about the table's rules.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from pydantic import ValidationError

from qworker.config import WorkerSettings
from qworker.lora_modules import LoRAModulesError, is_file_source, parse_modules, read_modules_file
from qworker.telemetry.lora_metrics import LoRASnapshot
from qworker.telemetry.metrics import WorkerMetrics
from qworker.worker.adapters import Adapters


def settings(env: dict[str, str]) -> WorkerSettings:
    return WorkerSettings.from_env(env)


def error_line(env: dict[str, str]) -> str:
    with pytest.raises(ValidationError) as e:
        settings(env)
    return WorkerSettings.explain(e.value)


# ---------------------------------------------------------------------------- settings
def test_modules_spellings() -> None:
    want = {"sql": "/a/sql", "chat-v2": "/a/chat"}
    assert parse_modules('{"sql": "/a/sql", "chat-v2": "/a/chat"}') == want
    assert parse_modules("sql=/a/sql chat-v2=/a/chat") == want
    assert parse_modules("sql=/a/sql,chat-v2=/a/chat") == want
    assert parse_modules(" sql=/a/sql ,\n chat-v2=/a/chat ") == want
    assert parse_modules("") == {}
    assert not is_file_source("a=/x") and not is_file_source('{"a": "/x"}') and is_file_source("/etc/qworker/lora/modules.json")


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("a=/x sql", "'sql' is not name=path"),
        ("sql=", "non-empty"),
        ("=/a", "adapter name ''"),
        ("a b=/x", "'a' is not name=path"),
        ("sql=/a sql=/b", "named twice"),
        ('{"sql": "/a", "sql": "/b"}', "named twice"),
        ('{"sql": 3}', "non-empty string"),
        ('["sql"]', "not a JSON object"),
        ('{"bad name": "/a"}', "adapter name 'bad name'"),
        ("{not json", "not a JSON object"),
    ],
)
def test_modules_refused_naming_the_entry(text: str, says: str) -> None:
    with pytest.raises(LoRAModulesError) as e:
        parse_modules(text)
    assert says in str(e.value)
    line = error_line({"QWORKER_LORA_MODULES": text})
    assert line.startswith("invalid settings: QWORKER_LORA_MODULES: ") and says in line


def test_lora_settings_reach_the_engine_config(tmp_path: Path) -> None:
    s = settings({"QWORKER_LORA_MODULES": "a=/x", "QWORKER_MAX_LORAS": "2", "QWORKER_MAX_LORA_RANK": "32", "QWORKER_MAX_CPU_LORAS": "4",
                  "QWORKER_LORA_ROOT": str(tmp_path)})
    assert s.lora_enabled and s.lora_root == str(tmp_path)
    cfg = s.engine_config()
    assert (cfg["enable_lora"], cfg["max_loras"], cfg["max_lora_rank"], cfg["max_cpu_loras"]) == (True, 2, 32, 4)
    # no modules: LoRA stays off and the limits are not passed
    off = settings({"QWORKER_MAX_LORAS": "2"})
    assert not off.lora_enabled and "enable_lora" not in off.engine_config() and "max_loras" not in off.engine_config()
    # on with no adapters yet (a file fills in later)
    assert settings({"QWORKER_ENABLE_LORA": "true"}).engine_config()["enable_lora"] is True


def test_lora_settings_refused_with_their_names(tmp_path: Path) -> None:
    assert "QWORKER_LORA_ROOT: no such directory" in error_line({"QWORKER_LORA_ROOT": str(tmp_path / "nope")})
    assert "QWORKER_MAX_LORAS" in error_line({"QWORKER_MAX_LORAS": "0"})
    assert "QWORKER_MAX_CPU_LORAS (1) must be at least QWORKER_MAX_LORAS (2)" in error_line({"QWORKER_MAX_LORAS": "2", "QWORKER_MAX_CPU_LORAS": "1"})
    assert "QWORKER_ENABLE_LORA is false" in error_line({"QWORKER_LORA_MODULES": "a=/x", "QWORKER_ENABLE_LORA": "false"})
    line = error_line({"QWORKER_LORA_MODULES": str(tmp_path / "modules.json")})
    assert "QWORKER_LORA_MODULES: cannot read" in line and "modules.json" in line
    bad = tmp_path / "bad.json"
    bad.write_text('{"a": ')
    assert f"{bad}: not a JSON object" in error_line({"QWORKER_LORA_MODULES": str(bad)})


def test_modules_file(tmp_path: Path) -> None:
    f = tmp_path / "modules"
    f.write_text("a=/x b=/y\n")
    assert read_modules_file(str(f)) == {"a": "/x", "b": "/y"}
    f.write_text("/some/other/file")
    with pytest.raises(LoRAModulesError, match="expected a JSON object or name=path pairs"):
        read_modules_file(str(f))
    f.write_bytes(b"\xff\xfe")
    with pytest.raises(LoRAModulesError, match="not UTF-8"):
        read_modules_file(str(f))


# ---------------------------------------------------------------------------- the table
def adapter_dir(root: Path, name: str) -> Path:
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "adapter_config.json").write_text("{}")
    (d / "adapter_model.safetensors").write_bytes(b"x")
    return d


def checker(refuse: set[str] | None = None):
    """A stand-in validator: refuses folders whose name is in ``refuse`` and counts its calls."""
    calls: list[str] = []

    def validate(path: str) -> str:
        calls.append(path)
        if not os.path.isdir(path):
            raise ValueError(f"LoRA adapter folder {path!r} does not exist")
        if os.path.basename(path) in (refuse or set()):
            raise ValueError(f"{path}: rank 999 is above max_lora_rank 16")
        return os.path.realpath(path)

    return validate, calls


def test_resolve_rules(tmp_path: Path) -> None:
    validate, _ = checker({"bad"})
    mods = f"sql={adapter_dir(tmp_path, 'sql')} bad={adapter_dir(tmp_path, 'bad')} gone={tmp_path / 'gone'}"
    t = Adapters(mods, validate, "smollm", {"smollm2-135m"})
    asyncio.run(t.refresh())
    assert sorted(t.served) == ["sql"] and sorted(t.refused) == ["bad", "gone"]
    sql = t.served["sql"]
    assert sql.lora_name == "sql" and sql.lora_int_id >= 1 and sql.lora_path == os.path.realpath(tmp_path / "sql")
    assert t.resolve(None, None, True).lora is None  # base
    assert t.resolve("smollm2-135m", None, True).lora is None  # the folder's name is the base too
    assert t.resolve(None, "sql", True).lora == sql
    assert t.resolve("sql", None, True).lora == sql  # OpenAI's way
    assert t.resolve("sql", "sql", True).lora == sql
    assert t.resolve("smollm", "sql", True).lora == sql
    r = t.resolve(None, "nope", True)
    assert r.code == "model_not_found" and "'nope'" in r.message and "adapters: sql" in r.message
    r = t.resolve("nope", None, True)
    assert r.code == "model_not_found"
    r = t.resolve(None, "bad", True)  # refused: the job is told why
    assert r.code == "model_not_found" and "refused at load" in r.message and "rank 999" in r.message
    assert t.resolve("sql", "other", True).code == "invalid_job"
    # LoRA off: a wrong model stays wrong_model (as before adapters existed), a lora is not found
    off = Adapters(None, validate, "smollm")
    assert off.resolve("gpt-9", None, False).code == "wrong_model"
    assert "serves 'smollm'" in off.resolve("gpt-9", None, False).message
    assert off.resolve(None, "sql", False).code == "model_not_found"


def test_ids_stable_per_version_and_new_on_change(tmp_path: Path) -> None:
    validate, calls = checker()
    a, b = adapter_dir(tmp_path, "a"), adapter_dir(tmp_path, "b")
    modules = tmp_path / "modules.json"
    modules.write_text(f'{{"x": "{a}", "y": "{b}"}}')
    t = Adapters(str(modules), validate, "base")
    assert asyncio.run(t.refresh())
    ids = {n: r.lora_int_id for n, r in t.served.items()}
    assert len(set(ids.values())) == 2
    # nothing changed: nothing validated again, same ids
    n = len(calls)
    assert not asyncio.run(t.refresh())
    assert len(calls) == n and {k: r.lora_int_id for k, r in t.served.items()} == ids
    # x now points at b's folder: a new id (its prefix-cache entries must not be reused), y keeps its own
    modules.write_text(f'{{"x": "{b}", "y": "{b}"}}')
    assert asyncio.run(t.refresh())
    assert t.served["y"].lora_int_id == ids["y"]
    assert t.served["x"].lora_int_id not in ids.values()
    # y's files rewritten in place (a retrained adapter): a new id too
    before = t.served["y"].lora_int_id
    (b / "adapter_model.safetensors").write_bytes(b"xy")
    asyncio.run(t.refresh())
    assert t.served["y"].lora_int_id != before
    # removed from the file: no longer served (new jobs get model_not_found)
    modules.write_text(f"y={b}")
    asyncio.run(t.refresh())
    assert sorted(t.served) == ["y"] and t.resolve(None, "x", True).code == "model_not_found"
    # a broken file keeps the last good set and counts the error
    modules.write_text("{broken")
    assert not asyncio.run(t.refresh())
    assert sorted(t.served) == ["y"] and t.file_errors == 1
    # a vanished file too
    modules.unlink()
    asyncio.run(t.refresh())
    assert sorted(t.served) == ["y"] and t.file_errors == 2


def test_reload_adds_and_retries(tmp_path: Path) -> None:
    validate, _ = checker()
    modules = tmp_path / "modules"
    late = tmp_path / "late"
    modules.write_text(f"late={late}")
    t = Adapters(str(modules), validate, "base")
    asyncio.run(t.refresh())
    assert "late" in t.refused and t.refusals == {"late": 1}
    asyncio.run(t.refresh())  # unchanged folder: not tried (and not logged) again
    assert t.refusals == {"late": 1}
    adapter_dir(tmp_path, "late")  # the folder appears: tried again, served
    asyncio.run(t.refresh())
    assert "late" in t.served and "late" not in t.refused
    # a name added to the file is served on the next round
    adapter_dir(tmp_path, "new")
    modules.write_text(f"late={late} new={tmp_path / 'new'}")
    asyncio.run(t.refresh())
    assert sorted(t.served) == ["late", "new"]


def test_adapter_named_as_the_base_model_is_refused(tmp_path: Path) -> None:
    validate, calls = checker()
    t = Adapters(f"base={adapter_dir(tmp_path, 'a')}", validate, "base")
    asyncio.run(t.refresh())
    assert "base" in t.refused and "base model" in t.refused["base"] and not calls
    assert t.resolve("base", None, True).lora is None


def test_a_validator_crash_refuses_one_adapter(tmp_path: Path) -> None:
    def validate(path: str) -> str:
        if path.endswith("boom"):
            raise RuntimeError("unexpected")
        return path

    t = Adapters(f"ok={adapter_dir(tmp_path, 'ok')} boom={adapter_dir(tmp_path, 'boom')}", validate, "base")
    asyncio.run(t.refresh())
    assert list(t.served) == ["ok"] and t.refused == {"boom": "unexpected"}


# ---------------------------------------------------------------------------- metrics
def test_lora_metrics_exposition() -> None:
    m = WorkerMetrics("base")
    body = m.render()[0].decode()
    assert "lora_requests_info" not in body  # LoRA off: nothing
    m.lora.update(LoRASnapshot(max_lora=2, served=("a", "b", "c"), refused=("d",), running={"a": 2, "b": 0}, waiting={"c": 1},
                               refusals={"d": 3}, file_errors=1, at=1700000000.0))
    m.lora.job_outcome("a", "completed")
    body = m.render()[0].decode()
    assert 'qworker:lora_requests_info{max_lora="2",running_lora_adapters="a",waiting_lora_adapters="c"} 1.7e+09' in body
    assert 'qworker:lora_requests_running{lora_name="a",model_name="base"} 2.0' in body
    assert 'qworker:lora_requests_waiting{lora_name="c",model_name="base"} 1.0' in body
    assert 'qworker:lora_adapters{model_name="base",state="refused"} 1.0' in body
    assert 'qworker:lora_adapter_refusals_total{lora_name="d",model_name="base"} 3.0' in body
    assert "qworker:lora_modules_file_errors_total 1.0" in body
    assert 'qworker:lora_requests_total{lora_name="a",model_name="base",outcome="completed"} 1.0' in body


def test_cli_lora_modules_flag() -> None:
    """``qworker run --lora-modules`` takes vLLM's repeated name=path values, checked as the setting."""
    from typer.testing import CliRunner

    from qworker.cli import app

    r = CliRunner().invoke(app, ["run", "--lora-modules", "a=/x", "--lora-modules", "a=/y", "--http-port", "-1"])
    assert r.exit_code == 2 and "QWORKER_LORA_MODULES: adapter 'a' is named twice" in r.output


def test_modules_file_unreadable_from_the_start_is_counted(tmp_path: Path) -> None:
    validate, _ = checker()
    t = Adapters(str(tmp_path / "not-yet.json"), validate, "base")
    asyncio.run(t.refresh())
    asyncio.run(t.refresh())
    assert t.served == {} and t.file_errors == 1  # counted (and logged) once, not every round
    adapter_dir(tmp_path, "a")
    (tmp_path / "not-yet.json").write_text(f"a={tmp_path / 'a'}")
    asyncio.run(t.refresh())
    assert list(t.served) == ["a"]


def test_modules_as_a_mapping_from_python() -> None:
    s = WorkerSettings(lora_modules={"a": "/x", "b": "/y"})
    assert s.lora_enabled and parse_modules(s.lora_modules) == {"a": "/x", "b": "/y"}
    with pytest.raises(ValidationError, match="adapter name 'bad name'"):
        WorkerSettings(lora_modules={"bad name": "/x"})


class CacheStandIn:
    """The engine's adapter-cache calls (vLLM's list_loras / remove_lora), recorded: ids in
    ``busy`` are refused as the engine refuses an adapter a request in flight uses."""

    def __init__(self, loaded: set[int]):
        self.loaded, self.busy, self.removed = set(loaded), set(), []

    async def list_loras(self) -> set[int]:
        return set(self.loaded)

    async def remove_lora(self, lora_id: int) -> bool:
        if lora_id in self.busy or lora_id not in self.loaded:
            return False
        self.loaded.discard(lora_id)
        self.removed.append(lora_id)
        return True


def test_versions_no_longer_served_leave_the_engine_cache(tmp_path: Path) -> None:
    validate, _ = checker()
    a, b = adapter_dir(tmp_path, "a"), adapter_dir(tmp_path, "b")
    modules = tmp_path / "modules"
    modules.write_text(f"x={a} y={b}")
    t = Adapters(str(modules), validate, "base")
    asyncio.run(t.refresh())
    x_old, y_old = t.served["x"].lora_int_id, t.served["y"].lora_int_id
    t.engine = CacheStandIn({x_old, y_old})
    t.engine.busy = {y_old}
    modules.write_text(f"x={b}")  # x moves (new id), y is removed
    asyncio.run(t.refresh())
    asyncio.run(t.release())
    assert t.engine.removed == [x_old] and [r.lora_int_id for r in t.retired] == [y_old]  # y still in flight: kept
    t.engine.busy = set()
    asyncio.run(t.release())
    assert t.engine.removed == [x_old, y_old] and t.retired == []
    assert t.served["x"].lora_int_id not in (x_old, y_old)
