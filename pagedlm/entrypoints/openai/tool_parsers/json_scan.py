"""Reading tool-call objects out of JSON text that may still be growing: how far a value
goes, whether it is cut short (more may come) or not JSON at all, and a call's name and
raw arguments text as far as the text goes."""

from __future__ import annotations

import json
from dataclasses import dataclass


class _Truncated(Exception):
    """The JSON text ends before the value does (more may come)."""


class _Malformed(Exception):
    """Not JSON at this point: the rest of the region is not a call."""


WS = " \t\r\n"
_SCALAR_CHARS = frozenset("-+.0123456789eEtrufalsn")


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in WS:
        i += 1
    return i


def _string_end(text: str, i: int) -> int:
    """text[i] is '"': the index after the closing quote."""
    j = i + 1
    while j < len(text):
        c = text[j]
        if c == "\\":
            j += 2
        elif c == '"':
            return j + 1
        else:
            j += 1
    raise _Truncated


def _value_end(text: str, i: int) -> int:
    """The index after the JSON value that starts at text[i]."""
    if i >= len(text):
        raise _Truncated
    c = text[i]
    if c == '"':
        return _string_end(text, i)
    if c in "{[":
        depth, j = 0, i
        while j < len(text):
            c = text[j]
            if c == '"':
                j = _string_end(text, j)
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        raise _Truncated
    j = i
    while j < len(text) and text[j] in _SCALAR_CHARS:
        j += 1
    if j == i:
        raise _Malformed
    if j == len(text):
        raise _Truncated  # a number may go on
    return j


@dataclass
class CallScan:
    """A call object as far as the text goes."""

    name: str | None = None
    arguments: str = ""  # raw text of the arguments value so far
    arguments_done: bool = False
    complete: bool = False


_ARGUMENT_KEYS = ("arguments", "parameters")


def _scan_object(text: str, i: int) -> tuple[CallScan, int | None]:
    """text[i] is '{': the call it describes and the index after it (None: not finished)."""
    call = CallScan()
    i += 1
    while True:
        i = _skip_ws(text, i)
        if i >= len(text):
            return call, None
        c = text[i]
        if c == "}":
            call.complete = True
            call.arguments_done = True
            return call, i + 1
        if c == ",":
            i += 1
            continue
        if c != '"':
            raise _Malformed
        try:
            key_end = _string_end(text, i)
        except _Truncated:
            return call, None
        key = json.loads(text[i:key_end])
        i = _skip_ws(text, key_end)
        if i >= len(text):
            return call, None
        if text[i] != ":":
            raise _Malformed
        i = _skip_ws(text, i + 1)
        if i >= len(text):
            return call, None
        try:
            end = _value_end(text, i)
        except _Truncated:
            if key in _ARGUMENT_KEYS and text[i] in "{[" and not call.arguments:
                call.arguments = text[i:]  # the object so far: streamable
            return call, None
        value = text[i:end]
        if key == "name":
            name = json.loads(value)
            call.name = name if isinstance(name, str) else None
        elif key in _ARGUMENT_KEYS and not call.arguments_done:
            if value.startswith('"'):  # arguments sent as a JSON string
                decoded = json.loads(value)
                value = decoded if isinstance(decoded, str) else value
            call.arguments, call.arguments_done = value, True
        i = end


def scan_calls(body: str) -> list[CallScan]:
    """The call objects in a region's text: one object, a JSON list of them, or several
    separated by whitespace, commas or semicolons. Stops at anything else."""
    calls: list[CallScan] = []
    i = 0
    while True:
        i = _skip_ws(body, i)
        if i >= len(body):
            return calls
        c = body[i]
        if c in ",;[]":
            i += 1
            continue
        if c != "{":
            return calls
        try:
            call, end = _scan_object(body, i)
        except (_Malformed, ValueError):
            return calls
        if call.name is not None or end is None:
            calls.append(call)
        if end is None:
            return calls
        i = end


def find_outside_strings(text: str, marker: str, start: int) -> int:
    """The first `marker` at or after `start` that is not inside a JSON string (an argument
    may well contain the end marker's text); -1 if none."""
    in_string, i = False, start
    while i < len(text):
        c = text[i]
        if in_string:
            if c == "\\":
                i += 1
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif text.startswith(marker, i):
            return i
        i += 1
    return -1
