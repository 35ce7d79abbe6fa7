"""OpenAI's Batch API on qworker's topics: request lines in, batch output lines out.

A record on the jobs topic whose JSON object has a ``custom_id`` key is an OpenAI batch request
line (``{"custom_id", "method", "url", "body"}``); anything else is a native job. ``requests``
maps a line to a native ``Job`` (plus the few facts needed to answer in OpenAI's shape),
``results`` shapes the native answers into batch output lines and stream chunks, and ``files``
submits and collects JSONL batch files. Nothing here imports the ``openai`` package: the tests
validate the output with its types, the runtime does not need it.
"""

from qworker.openai_batch.requests import OpenAIRequest, RequestError, is_openai_line, map_line

__all__ = ["OpenAIRequest", "RequestError", "is_openai_line", "map_line"]
