"""Text from the user's program or a capture, made safe to print (no framework, no NumPy:
the error handler uses it when importing those is what failed)."""

from __future__ import annotations

import re

# C0 controls but tab and newline, DEL, C1 controls (0x9b is a one-byte CSI), bidirectional
# overrides (they reorder what a reader sees), surrogates and the XML 1.0 non-characters.
_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e"
                     "\u2066-\u2069\ud800-\udfff\ufffe\uffff]")
_LINE_BREAKS = re.compile("[\n\u2028\u2029]")


def printable(text: str, *, newlines: bool = False) -> str:
    """Text from a capture or a script's output made safe to print, to a terminal or into XML:
    control characters (the ESC that starts a terminal escape sequence included) become
    U+FFFD, and so do line breaks unless ``newlines``. Replacing, never deleting, keeps
    rich markup escaping (a backslash before a bracket) exactly as it was."""
    text = _UNSAFE.sub("\ufffd", text)
    return text if newlines else _LINE_BREAKS.sub("\ufffd", text)


#: Longest name from a capture shown whole (module paths of deep models stay well under it).
NAME_MAX = 160


def clip(text: str, limit: int = NAME_MAX) -> str:
    """A name cut to ``limit`` characters, its start and its (most specific) end kept: a
    300,000-character module name padded every context row to that width (2.4 MB printed)."""
    if len(text) <= limit:
        return text
    head = limit // 3
    return f"{text[:head]}…{text[len(text) - (limit - head - 1):]}"
