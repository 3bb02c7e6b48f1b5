"""Plain text for a person's eyes: control characters made visible, markup never interpreted.

What a reviewer reads comes partly from code and text nobody reviewed yet: an LLM's hypothesis and
notes, a proposal's diff, a validation log, a tag anyone with MLflow access typed. A terminal acts
on some of those bytes (ESC sequences erase lines, move the cursor, rewrite the title; a carriage
return overwrites the line it ends), and a bidirectional override makes code read in another order
than it runs ("Trojan Source"). `plain` turns each such character into a visible escape (`\\x1b`,
`\\u202e`), and so every character a reader cannot see (format characters such as U+200B or U+FEFF,
the Hangul fillers that render as blank space, unassigned and private-use code points), keeping
newlines and tabs where a multi-line text may hold them; `cell` does the same for one-line table cells. `text` gives rich a `Text`, so `[bold]` or `[link=...]` in LLM text stays
literal; `plain_record` is the logging filter that does it to every log line the CLI prints. Every
surface a person reads (the CLI, the Markdown/HTML report, the MLflow note) passes its untrusted text
through here.

It escapes for display only: what a study stores (state, diffs, artifacts) keeps the exact bytes.
It is not an HTML or Markdown escaper (`report_html` and the MLflow note do that on top).
"""

from __future__ import annotations

import logging
import re
import unicodedata

from rich.text import Text

# Unicode categories a reader cannot see or that change what the text around them looks like: controls (C0,
# DEL, C1: CSI is 0x9b), format characters (bidi marks, embeddings, overrides and isolates, U+061C, the zero
# widths U+200B-U+200D, U+2060, U+FEFF, the soft hyphen U+00AD), the line and paragraph separators some
# terminals break lines at, private-use, unassigned code points and lone surrogates.
HIDDEN_CATEGORIES = frozenset({"Cc", "Cf", "Zl", "Zp", "Co", "Cn", "Cs"})
# Letters that render as blank space, so `def f(x, \u3164=None)` reads as `def f(x, =None)`: the Hangul fillers
# and the blank Braille pattern.
BLANK_LETTERS = frozenset("\u115f\u1160\u3164\uffa0\u2800")
# Candidates: everything but printable ASCII, newline and tab (each candidate is then judged by its category).
_CANDIDATE = re.compile("[^\x20-\x7e\n\t]")
_CANDIDATE_LINE = re.compile("[^\x20-\x7e]")  # in a one-line cell, newlines and tabs too


def _escape(ch: str) -> str:
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def _visible(match: re.Match[str]) -> str:
    ch = match.group()
    if ch in "\n\t":
        return " "  # a cell is one line: a newline would start a new table row
    if ch in BLANK_LETTERS or unicodedata.category(ch) in HIDDEN_CATEGORIES:
        return _escape(ch)
    return ch


def plain(value: object) -> str:
    """`value` as text with every control, format and invisible character escaped visibly; newlines and tabs kept."""
    return _CANDIDATE.sub(_visible, str(value))


def cell(value: object) -> str:
    """`value` as one line of plain text (a table cell): hidden characters escaped, newlines and tabs as spaces."""
    return _CANDIDATE_LINE.sub(_visible, str(value))


def fenced(value: object, lang: str = "") -> str:
    """A Markdown fenced code block of `plain(value)`, its fence longer than any run of backticks in the
    text, so no line of it can close the block and have the rest read as Markdown."""
    shown = plain(value)
    fence = "`" * max(3, 1 + max((len(run) for run in re.findall(r"`+", shown)), default=0))
    return f"{fence}{lang}\n{shown}\n{fence}"


# Markdown's (and inline HTML's) punctuation that can start markup in the middle of a line: backslash-escaped by
# `markdown`, so text from a planner or a person reads as typed (`[x](javascript:...)`, `<img src=...>`, `**`).
MARKDOWN_PUNCTUATION = "\\`*_[]<>|~&"
_MARKDOWN = re.compile("([" + re.escape(MARKDOWN_PUNCTUATION) + "])")


def markdown(value: object) -> str:
    """`cell(value)` for the middle of a Markdown line: every character that could start markup escaped."""
    return _MARKDOWN.sub(r"\\\1", cell(value))


def text(value: object, style: str = "") -> Text:
    """A rich `Text` of `plain(value)`: printed as it reads, never parsed as rich markup."""
    return Text(plain(value), style=style)


def plain_record(record: logging.LogRecord) -> bool:
    """A logging filter: a log line is plain text too (a planner's error quoting the LLM's reply, a run's log tail)."""
    record.msg, record.args = plain(record.getMessage()), None
    return True
