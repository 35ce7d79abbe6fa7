"""Does a compiled grammar accept any finite string at all?

xgrammar compiles ``{"$ref": "#"}`` (``root ::= root``) or a required property that refers back
to its own schema without complaint: the result admits no finite output, so a constrained
sequence can never finish (and a mask with nothing allowed breaks the sampler). That is the
spec's fault, like a schema the compiler refuses, so the compile reports it as an error.

The test is the textbook one for a context-free grammar: a rule is *productive* when its body
can derive a finite string; iterate to the fixed point and check the root. It reads xgrammar's
serialized grammar (``Grammar.serialize_json``): rules ``[name, body_expr_id, ...]`` and
expressions stored flat as ``[type, payload_len, *payload]`` (CSR: ``grammar_expr_indptr``).
An expression type this module does not know counts as productive: an unknown shape can never
make a valid spec fail, at worst an empty one goes through as it did before.

No imports beyond the standard library: the compile child process loads it by file name.
"""

from __future__ import annotations

import json

BYTE_STRING, CHAR_CLASS, CHAR_CLASS_STAR, EMPTY_STR, RULE_REF, SEQUENCE, CHOICES, TAG_DISPATCH, REPEAT = range(9)

EMPTY_LANGUAGE = ("it admits no finite output: every way through it recurses forever "
                  "(in a JSON schema: a $ref cycle with no way out, such as {\"$ref\": \"#\"})")


def accepts_some_string(grammar_json: str) -> bool:
    """True when the root rule of the serialized grammar derives at least one finite string."""
    g = json.loads(grammar_json)
    rules = g["rules"]
    data, indptr = g["grammar_expr_data"], g["grammar_expr_indptr"]

    def expr(i: int) -> tuple[int, list[int]]:
        start = indptr[i]
        return data[start], data[start + 2:start + 2 + data[start + 1]]

    productive = [False] * len(rules)

    def prod(i: int) -> bool:
        kind, payload = expr(i)
        if kind == RULE_REF:
            return productive[payload[0]]
        if kind == SEQUENCE:
            return all(prod(j) for j in payload)
        if kind == CHOICES:
            return any(prod(j) for j in payload)
        if kind == REPEAT:  # [rule, min, max]: zero repetitions need nothing of the rule
            return payload[1] == 0 or productive[payload[0]]
        if kind == CHAR_CLASS:
            return class_matches_something(payload)
        return True  # other terminals (bytes, a class's star, the empty string), tag dispatch, anything newer

    changed = True
    while changed:  # at most one pass per rule: each pass marks one more or stops
        changed = False
        for r, rule in enumerate(rules):
            if not productive[r] and prod(rule[1]):
                productive[r] = True
                changed = True
    return productive[g["root_rule_id"]]


MAX_CODEPOINT = 0x10FFFF


def class_matches_something(payload: list[int]) -> bool:
    """A character class ``[negated, lo0, hi0, lo1, hi1, ...]`` (codepoint ranges): False for
    one that matches no character, ``[]`` or ``[^\\s\\S]`` (helper-62: such a regex compiled, and
    its job ended with a bare abort at the first token)."""
    negated, ranges = payload[0], sorted(zip(payload[1::2], payload[2::2]))
    if not negated:
        return any(lo <= hi for lo, hi in ranges)
    reach = -1  # every codepoint up to here is in the ranges
    for lo, hi in ranges:
        if lo > reach + 1:
            return True  # a gap: the negated class matches it
        reach = max(reach, hi)
    return reach < MAX_CODEPOINT
