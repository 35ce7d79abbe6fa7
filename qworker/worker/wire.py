"""How a job's answers are encoded on the result topics: native messages, or OpenAI's shapes.

The worker builds every answer as a native message (``Completion`` / ``JobError`` / ``Delta``)
and only the last step, turning it into bytes, depends on the format the job came in. So size
limits, retries, attempts and commits work the same for both formats; an OpenAI-shaped record
says which run made it in headers (``qworker.attempt``, ``qworker.run_id``, and ``qworker.seq``
on stream chunks), since its shape has no field for that.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel

from qworker.messages import Delta, dumps, json_bytes
from qworker.openai_batch.requests import OpenAIRequest
from qworker.openai_batch.results import ChunkShaper, IdText, TokenizerText, TokenText, output_line, run_headers
from qworker.worker.stream import Render, StreamEnd

Shape = Callable[[BaseModel], bytes]


def token_text(engine: Any) -> TokenText:
    tok = getattr(engine, "tokenizer", None)
    return TokenizerText(tok) if tok is not None else IdText()


def shape(wire: OpenAIRequest | None, text: TokenText, param: str | None = None) -> Shape:
    """Bytes of a final answer (completion or error) in the job's format."""
    if wire is None:
        return dumps
    return lambda msg: json_bytes(output_line(msg, wire, text, param))  # type: ignore[arg-type]


def answer_headers(msg: BaseModel, wire: OpenAIRequest | None) -> list[tuple[str, bytes]]:
    if wire is None:
        return []
    return run_headers(getattr(msg, "attempt", 0), getattr(msg, "run_id", ""))


def chunk_render(wire: OpenAIRequest | None, model: str) -> Render | None:
    """Stream events as OpenAI chunks (None: native ``Delta`` messages)."""
    if wire is None:
        return None
    shaper = ChunkShaper(wire, model)

    def render(ev: Delta) -> tuple[bytes, list[tuple[str, bytes]]]:
        if isinstance(ev, StreamEnd):
            obj = shaper.chunk(ev.run_id, ev.index, "", ev.finish_reason, ev.usage)
        else:
            obj = shaper.chunk(ev.run_id, ev.index, ev.text)
        return json_bytes(obj), run_headers(ev.attempt, ev.run_id, ev.seq)

    return render
