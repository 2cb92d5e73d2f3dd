"""Text that a node or a model file reported, made fit to store and to show: printable characters only.

Everything a node prints (device names, hostnames, OS strings, versions, banners, process command lines)
and every string of a GGUF header is written by whoever controls that node or file. Pages escape it, but a
page must not have to be the only line of defence, and some harm needs no markup at all: a right-to-left
override (U+202E) or an isolate (U+2066..U+2069) makes "CUDA0 evil.sh" read differently from what it is, a
terminal escape colours or hides the text of a downloaded log, a zero-width character makes two names look
alike. So text from those sources is cleaned where it enters the database, with `printable()` (one string)
or `printable_json()` (every string in a JSON value, keys too):

- control characters (Unicode category Cc) go, except that multi-line text keeps newlines and tabs;
- format characters (Cf: the bidi embeddings, overrides and isolates, the LRM/RLM marks, zero-width
  characters, the BOM) go, as do surrogates, private-use and unassigned code points (the other C* categories);
- line and paragraph separators and other spaces become a plain space (a newline in multi-line text);
- ANSI terminal sequences go as a whole, not just their ESC byte;
- the result is cut to the field's length, ending in "…" when something was cut.

Pure Python, no Django: the probe's parsers and the job log use it too.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterator
from typing import Any

ELLIPSIS = "…"
# A JSON string with no field of its own to fit (facts, profiles, reports): long enough for any path.
JSON_STRING_LIMIT = 1000

# CSI (colours, cursor moves), OSC (titles, hyperlinks) and the two-byte forms, as in jobs/broadcast.py.
_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[@-Z\\-_]")
# Line breaks other than \n: a multi-line text gets a newline for them, a one-line text a space.
_BREAKS = frozenset("\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029")


def printable(text: Any, limit: int | None, *, lines: bool = False) -> str:
    """`text` with only printable characters, at most `limit` characters long (None: no limit).

    `lines`: keep newlines and tabs (a reason, an error message, a log line); otherwise every kind of line
    break and tab becomes a space (a name, a version, a path)."""
    if text is None:
        return ""
    text = str(text)
    if text.isprintable() and (limit is None or len(text) <= limit):
        return text  # The common case: nothing to remove, nothing to cut.
    if limit is not None:
        # Look at no more than a bounded prefix: a megabyte of zero-width characters costs no more than a
        # short name (what is dropped still has to be read).
        text = text[: 4 * limit + 64]
    if "\x1b" in text:
        text = _ANSI.sub("", text)
    if lines:
        text = text.replace("\r\n", "\n") if "\r" in text else text
        rest = text.replace("\n", "").replace("\t", "")
    else:
        text = rest = text.replace("\n", " ").replace("\t", " ")
    # Tabs, newlines and terminal colours are the usual reasons for a second look (build output, tables):
    # once they are dealt with, most text is printable and needs no look at each character.
    cleaned = text if rest.isprintable() else "".join(_printable_chars(text, lines))
    if limit is not None and len(cleaned) > limit:
        cleaned = cleaned[: max(limit - 1, 0)] + ELLIPSIS if limit else ""
    return cleaned


def _printable_chars(text: str, lines: bool) -> Iterator[str]:
    for char in text:
        if char.isprintable() or char == "\n" or char == "\t":
            yield char  # a one-line text has no newline or tab left by now
        elif char in _BREAKS:
            yield "\n" if lines else " "
        elif unicodedata.category(char)[0] == "Z":
            yield " "  # no-break and other spaces
        # Everything else is C* (controls, format and bidi characters, surrogates, private use, unassigned).


def printable_json(value: Any, limit: int = JSON_STRING_LIMIT, *, lines: bool = False) -> Any:
    """A copy of a JSON value with every string (dictionary keys included) passed through `printable`.
    Numbers, booleans and None are kept; tuples become lists, as JSON would have them."""
    if isinstance(value, str):
        return printable(value, limit, lines=lines)
    if isinstance(value, dict):
        return {
            printable(key, limit): printable_json(item, limit, lines=lines) for key, item in value.items()
        }
    if isinstance(value, list | tuple):
        return [printable_json(item, limit, lines=lines) for item in value]
    return value
