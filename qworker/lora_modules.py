"""``QWORKER_LORA_MODULES``: the LoRA adapters a worker serves, by name, as an operator writes them.

Three spellings, told apart by their first character (after blanks):

- ``{...}``: a JSON object ``{"name": "path", ...}`` (any other JSON is refused);
- ``name=path`` pairs separated by blanks or commas (vLLM's ``--lora-modules``);
- anything else: the path of a file holding either of the above. The worker re-reads it when
  its content changes, so adapters can be added to a running pod (a Kubernetes ConfigMap mount
  is updated in place); the two inline spellings are fixed for the life of the process.

Invariants: a name is 1-256 characters of ``A-Z a-z 0-9 . _ - : /`` (it is what jobs and
OpenAI's ``model`` field send, and a metric label value); a path is a non-empty string; a name
appears once. Paths come only from here, never from a job. Parsing never touches the
adapters' folders (that is the worker's validation, which may refuse one adapter alone).
"""

from __future__ import annotations

import json
import re

NAME = re.compile(r"[A-Za-z0-9._:/-]{1,256}")  # used with fullmatch: "$" would let a final "\n" through
MAX_MODULES = 1024
MAX_FILE_BYTES = 1 << 20


class LoRAModulesError(ValueError):
    """The modules text cannot be read; the message says where."""


def is_file_source(text: str) -> bool:
    """The value names a file to (re-)read rather than holding the modules itself."""
    s = text.strip()
    return bool(s) and s[0] not in "{[" and "=" not in s


def parse_modules(text: str) -> dict[str, str]:
    """``{name: path}`` from an inline spelling (a JSON object or ``name=path`` pairs); raises
    ``LoRAModulesError`` naming the first bad entry."""
    s = text.strip()
    if not s:
        return {}
    if s[0] in "{[":
        try:
            data = json.loads(s, object_pairs_hook=_no_duplicates)
        except (ValueError, RecursionError) as e:  # RecursionError: arrays nested past the stack
            raise LoRAModulesError(f"not a JSON object of name: path ({e})") from None
        if not isinstance(data, dict):
            raise LoRAModulesError(f"not a JSON object of name: path (a JSON {type(data).__name__})")
        pairs = list(data.items())
    else:
        pairs = []
        for item in re.split(r"[\s,]+", s):
            name, eq, path = item.partition("=")
            if not eq:
                raise LoRAModulesError(f"{item!r} is not name=path")
            pairs.append((name, path))
    out: dict[str, str] = {}
    for name, path in pairs:
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise LoRAModulesError(f"adapter name {name!r}: 1-256 characters of A-Z a-z 0-9 . _ - : /")
        if not isinstance(path, str) or not path.strip():
            raise LoRAModulesError(f"adapter {name!r}: the path must be a non-empty string")
        if name in out:
            raise LoRAModulesError(f"adapter {name!r} is named twice")
        out[name] = path.strip()
    if len(out) > MAX_MODULES:
        raise LoRAModulesError(f"{len(out)} adapters; at most {MAX_MODULES}")
    return out


def read_modules_file(path: str) -> dict[str, str]:
    """The modules a file holds (either inline spelling); raises ``LoRAModulesError`` (file
    missing, too large, not UTF-8, or a bad entry) with the file named."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise LoRAModulesError(f"cannot read {path}: {e.strerror or e}") from None
    return parse_file_bytes(raw, path)


def parse_file_bytes(raw: bytes, path: str) -> dict[str, str]:
    """The modules of a file already read (its bytes); errors name ``path``."""
    if len(raw) > MAX_FILE_BYTES:
        raise LoRAModulesError(f"{path} is larger than {MAX_FILE_BYTES} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise LoRAModulesError(f"{path} is not UTF-8 text") from None
    if is_file_source(text):
        raise LoRAModulesError(f"{path}: expected a JSON object or name=path pairs")
    try:
        return parse_modules(text)
    except LoRAModulesError as e:
        raise LoRAModulesError(f"{path}: {e}") from None


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    seen: dict[str, object] = {}
    for k, v in pairs:
        if k in seen:
            raise ValueError(f"adapter {k!r} is named twice")
        seen[k] = v
    return seen
