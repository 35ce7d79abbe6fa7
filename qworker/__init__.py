"""qworker: a queue-driven LLM inference worker with a paged, continuous-batching engine."""

__all__ = ["AsyncEngine", "InvalidRequestError", "LLM", "LoRARequest", "RequestOutput", "SamplingParams"]


def __getattr__(name: str):
    """``from qworker import LLM`` etc. load the engine on first use (PEP 562): importing it pulls in
    torch and transformers, ~7 s of CPU, which the client commands (``qworker submit``, ``collect``,
    ``topics``) and every other ``qworker.*`` module that does not need the engine must not pay."""
    if name in __all__:
        import qworker.engine

        return getattr(qworker.engine, name)
    raise AttributeError(f"module 'qworker' has no attribute {name!r}")
