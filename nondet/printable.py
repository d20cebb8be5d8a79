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
#: Longest line of a script's output shown under an error (a progress bar redrawn with
#: carriage returns is one "line" of megabytes).
LINE_MAX = 400


def clip(text: str, limit: int = NAME_MAX) -> str:
    """A name cut to ``limit`` characters, its start and its (most specific) end kept: a
    300,000-character module name padded every context row to that width (2.4 MB printed)."""
    if len(text) <= limit:
        return text
    head = limit // 3
    return f"{text[:head]}…{text[len(text) - (limit - head - 1):]}"


# Note [Text from the program]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Names reach the capture from the running program: source file names (``co_filename``),
# module paths, files a run read. Python decodes a path's bytes with the file system
# encoding and keeps a byte it cannot decode as a lone surrogate (PEP 383), and HDF5 keeps
# UTF-8: a script importing a helper from a directory named in Latin-1 ended as "internal
# error", exit 3 ("malformed b'S' frame: surrogates not allowed"). The writer stores every
# string through ``as_utf8``; the comparison only needs the two runs' strings to be made
# alike, which they are (the same function of the same text).


def as_utf8(text: str) -> str:
    """``text`` as UTF-8 can hold it. A path or name from the running program holds lone
    surrogates where its bytes were not in the file system encoding (a directory named in
    Latin-1; any non-ASCII name under ``LC_ALL=C PYTHONUTF8=0``): the bytes are decoded as
    UTF-8 (so an ASCII locale's ``é`` reads as ``é``), those that are not UTF-8 shown as
    ``\\xNN``. Only text that cannot be encoded changes."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        pass
    try:
        data = text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a surrogate no decoder made (JSON's "\ud800"): its code
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return data.decode("utf-8", "backslashreplace")
