"""The engine's refusal of a request, below everything that raises it.

``InvalidRequestError`` lives here, not in ``sampling_params``, because both the sampling
parameters and the structured-output specs raise it (and the specs' own error subclasses it):
with the type in either of them, each module would have to import the other.
"""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request the engine can never run (bad parameters or prompt); ``code`` is stable for clients."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
