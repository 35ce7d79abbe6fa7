"""Batch files over Kafka: ``submit`` produces a file's keyed lines to the jobs topic; ``collect``
reads the completions topic until every line's id is answered (or a timeout) and writes one
OpenAI output line per input line (see ``files`` for which line gets what)."""

from __future__ import annotations

import asyncio
import fcntl
import os
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiokafka.errors import KafkaError

from qworker.config import WorkerSettings
from qworker.messages import json_bytes
from qworker.openai_batch.files import InputLine, attempt_of, local_answer, status_of, to_output
from qworker.openai_batch.progress import Progress
from qworker.openai_batch.results import error_line
from qworker.client import ResultReader, parse, producer_for


@dataclass
class SubmitReport:
    lines: int = 0
    submitted: int = 0
    openai: int = 0
    native: int = 0
    skipped: list[InputLine] = field(default_factory=list)  # not keyed or too large: answered by collect
    refused: list[tuple[InputLine, str]] = field(default_factory=list)  # the producer refused them
    seconds: float = 0.0

    def summary(self) -> str:
        rate = self.submitted / self.seconds if self.seconds > 0 else 0.0
        text = (f"submitted {self.submitted} of {self.lines} lines ({self.openai} OpenAI, {self.native} native) in {self.seconds:.1f} s "
                f"({rate:.0f} lines/s); {len(self.skipped)} not submitted (no usable id or too large: collect answers them as error lines)")
        if self.refused:
            text += f"; {len(self.refused)} refused by the producer"
        return text


def stall_limit_s(s: WorkerSettings) -> float:
    """How long ``submit_lines`` goes on with no line acknowledged before it gives the rest up:
    three request timeouts (a broker that went away otherwise costs one per batch, each failing
    after its own timeout: hours for a large file), at least 30 s."""
    return max(30.0, 3 * s.request_timeout_ms / 1000)


async def submit_lines(s: WorkerSettings, lines: list[InputLine], progress: Progress | None = None) -> SubmitReport:
    """Produce every keyed line as written (its bytes unchanged), keyed by its id; returns once
    the broker acknowledged them all, or once it has acknowledged none for ``stall_limit_s``:
    the lines not acknowledged by then are reported refused."""
    rep = SubmitReport(lines=len(lines))
    t0 = time.monotonic()
    acked = [0]
    last_progress = [t0]
    limit = stall_limit_s(s)

    def on_ack(fut: asyncio.Future) -> None:
        acked[0] += 1
        if not fut.cancelled() and fut.exception() is None:  # a batch that failed is no progress
            last_progress[0] = time.monotonic()

    def left() -> float:
        return last_progress[0] + limit - time.monotonic()

    stalled = f"the broker acknowledged nothing for {limit:.0f} s"
    p = await producer_for(s)
    try:
        sent: list[tuple[InputLine, asyncio.Future]] = []
        keyed = [ln for ln in lines if ln.key is not None]
        rep.skipped.extend(ln for ln in lines if ln.key is None)
        for i, ln in enumerate(keyed):
            try:
                fut = await asyncio.wait_for(p.send(s.jobs_topic, value=ln.raw, key=ln.key.encode("utf-8")), max(left(), 0.0))
            except TimeoutError:
                rep.refused.extend((rest, stalled) for rest in keyed[i:])
                break
            except KafkaError as e:  # e.g. larger than the producer's max_request_size
                rep.refused.append((ln, repr(e)))
                continue
            fut.add_done_callback(on_ack)
            sent.append((ln, fut))
            if progress is not None:
                progress.update(acked[0])
        for ln, fut in sent:
            try:
                await asyncio.wait_for(asyncio.shield(fut), max(left(), 0.0))
            except TimeoutError:
                rep.refused.append((ln, stalled))
                continue
            except KafkaError as e:
                rep.refused.append((ln, repr(e)))
                continue
            rep.submitted += 1
            rep.openai += ln.fmt == "openai"
            rep.native += ln.fmt == "native"
            if progress is not None:
                progress.update(rep.submitted + len(rep.refused))
    finally:
        try:  # stop flushes what is left: bounded too
            await asyncio.wait_for(p.stop(), max(left(), 5.0))
        except TimeoutError:
            pass
    rep.refused.sort(key=lambda r: r[0].number)
    rep.seconds = time.monotonic() - t0
    return rep


@dataclass
class CollectReport:
    lines: int = 0
    ok: int = 0
    errors: Counter = field(default_factory=Counter)  # error code -> lines
    not_answered: int = 0
    seconds: float = 0.0
    timed_out: bool = False

    @property
    def failed(self) -> int:
        return sum(self.errors.values())

    def summary(self, out: str) -> str:
        codes = ", ".join(f"{c} {n}" for c, n in self.errors.most_common())
        rate = self.lines / self.seconds if self.seconds > 0 else 0.0
        text = (f"collected {self.lines} lines in {self.seconds:.1f} s ({rate:.0f} lines/s): {self.ok} ok, {self.failed} errors"
                f"{f' ({codes})' if codes else ''}; wrote {out}")
        if self.timed_out:
            text += f"; timed out with {self.not_answered} lines unanswered"
        return text


async def collect_lines(s: WorkerSettings, lines: list[InputLine], out: Path | None, timeout_s: float, since_s: float = 0.0,
                        progress: Progress | None = None) -> tuple[CollectReport, list[dict[str, Any]]]:
    """Wait (up to ``timeout_s``) until every keyed line's id has an answer on the completions
    topic at or after ``since_s`` (Unix seconds), then write the output lines to ``out``
    (atomically; None: return them only)."""
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    per_key = Counter(ln.key for ln in lines if ln.key is not None)
    best: dict[str, tuple[int, int, dict]] = {}  # key -> (attempt, order on the topic, value)
    done = sum(1 for ln in lines if ln.key is None)
    rep = CollectReport(lines=len(lines))
    if per_key:
        reader = ResultReader(s, [s.completions_topic], from_beginning=True)
        try:
            await reader.start(timeout=max(1.0, timeout_s))
        except TimeoutError:
            await reader.stop()  # started, just found no topic: must not be left open
            reader = None  # the topic never appeared: nothing was answered
        order, idle = 0, 0
        ends: dict | None = None  # end offsets once every id is answered
        try:
            while reader is not None:
                batches = await reader.consumer.getmany(timeout_ms=100, max_records=2000)
                got = False
                for recs in batches.values():
                    for rec in recs:
                        got = True
                        order += 1
                        key = rec.key.decode("utf-8", "replace") if rec.key else None
                        if key not in per_key or (rec.timestamp is not None and rec.timestamp < since_s * 1000):
                            continue
                        value = _parse(rec.value)
                        if value is None:
                            continue
                        attempt = attempt_of(value, dict(rec.headers or ()))
                        old = best.get(key)
                        if old is None:
                            done += per_key[key]
                        if old is None or attempt >= old[0]:  # a later copy of the same attempt wins too
                            best[key] = (attempt, order, value)
                if progress is not None:
                    progress.update(done)
                # all answered: read on until caught up, so a rerun's later answer already on the topic is kept.
                # Caught up means an empty poll, or (a shared topic is never quiet) past every partition's
                # end as it was when the last id got its answer.
                idle = 0 if got else idle + 1
                if len(best) == len(per_key):
                    if idle >= 2:
                        break
                    if ends is None:
                        ends = await reader.consumer.end_offsets(list(reader.consumer.assignment()))
                    if await reader.caught_up(ends):
                        break
                if time.monotonic() > deadline:
                    rep.timed_out = len(best) < len(per_key)
                    break
        finally:
            if reader is not None:
                await reader.stop()
    results = []
    for ln in lines:
        if ln.key is None:
            obj = local_answer(ln)
        elif ln.key in best:
            obj = to_output(ln, best[ln.key][2])
        else:
            rep.not_answered += 1
            obj = error_line(ln.answer_id, "not_answered", f"no answer on {s.completions_topic} within {timeout_s:g} s")
        status = status_of(obj)
        if status == 200:
            rep.ok += 1
        else:
            rep.errors[(obj.get("error") or {}).get("code", str(status))] += 1
        results.append(obj)
    rep.timed_out = rep.timed_out or rep.not_answered > 0
    if out is not None:
        write_lines(out, results)
    rep.seconds = time.monotonic() - t0
    return rep, results


def write_lines(out: Path, results: list[dict]) -> None:
    """``results`` as JSONL at ``out``: a regular file (through a symlink, its target) all or
    nothing, written beside it then renamed; anything else there (a pipe, a device) written
    through as it is, never replaced by a file; a name of one of this process's open files
    (``/dev/stdout``, ``/dev/fd/N``: a shell's ``>``, ``>>``, ``|`` or ``>(...)``) written to that
    open file, as the shell set it up (appending after ``>>``)."""
    fd = _own_fd(out)
    if fd is not None:
        with os.fdopen(os.dup(fd), "wb") as f:
            for obj in results:
                f.write(json_bytes(obj) + b"\n")
        return
    out = _through_links(out)
    special = out.exists() and not out.is_file()
    tmp = out if special else out.with_name(out.name + ".tmp")
    with open(tmp, "wb") as f:
        for obj in results:
            f.write(json_bytes(obj) + b"\n")
    if not special:
        os.replace(tmp, out)


def _through_links(out: Path) -> Path:
    return out.resolve() if out.is_symlink() else out


_FD_PATH = re.compile(r"/dev/fd/(\d+)|/proc/(?:self|(\d+))/fd/(\d+)")


def _own_fd(out: Path) -> int | None:
    """The descriptor of this process that ``out`` names through its links (``/dev/stdout`` ->
    ``/proc/self/fd/1``), or None. Such a link's target is no path to open afresh: it reads
    ``pipe:[N]`` for a pipe, and for a file opened by the shell, its path, which a new file
    renamed over would replace (and ``>>`` would lose what was there)."""
    path = os.path.abspath(out)
    for _ in range(40):  # links to links, as far as the kernel follows them
        m = _FD_PATH.fullmatch(path)
        if m and m.group(2) in (None, str(os.getpid())):
            return int(m.group(1) or m.group(3))
        if not os.path.islink(path):
            return None
        path = os.path.normpath(os.path.join(os.path.dirname(path), os.readlink(path)))
    return None


def unwritable(out: Path) -> str | None:
    """Why ``write_lines`` could not write ``out`` (None: it can), found by trying: permission
    bits do not tell (root passes ``os.access`` everywhere, ``/proc`` takes no new files)."""
    fd = _own_fd(out)
    if fd is not None:
        try:
            mode = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE
        except OSError as e:
            return f"descriptor {fd}: {e.strerror or e}"
        return None if mode in (os.O_WRONLY, os.O_RDWR) else f"descriptor {fd} is not open for writing"
    out = _through_links(out)
    if out.is_dir():
        return "it is a folder"
    if out.exists() and not out.is_file():  # a pipe or a device: opened only to write (a pipe would block)
        return None if os.access(out, os.W_OK) else "not writable"
    tmp = out.with_name(out.name + ".tmp")
    existed = tmp.exists()
    try:
        with open(tmp, "ab"):
            pass
        if not existed:
            tmp.unlink()
    except OSError as e:
        return f"{tmp}: {e.strerror or e}"
    return None


def _parse(value: bytes | None) -> dict | None:
    v = parse(value)  # None for someone's unparseable record under our key: not an answer
    return v if isinstance(v, dict) else None
