"""Text that is safe to show: what every renderer writes through before a kernel's or a user's words
reach a terminal, a Markdown file or an HTML page. Below the metrics and the wording, which both use it."""

from __future__ import annotations

import re

__all__ = ["printable"]

# C0 controls except tab and newline, DEL and C1 controls (terminal escapes, NUL, carriage returns), and
# lone surrogates (undecodable bytes of a file name), which no terminal or UTF-8 file can hold.
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff]")


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group(0))
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(value: object) -> str:
    """`value` as text with control characters and lone surrogates written as visible ``\\x1b``-style
    escapes, so that a message carrying terminal colour codes or a carriage return cannot rewrite what a
    reader sees, and every renderer's output encodes as UTF-8."""
    text = value if isinstance(value, str) else str(value)
    return _CONTROL.sub(_escape, text)
