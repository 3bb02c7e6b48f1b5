"""What the reviewer reads is plain text: every invisible or format character shows as an escape (`plain`),
and an error message (`_fail` of the researcher CLI) is printed as typed, its rich markup and terminal
escapes shown literally. The attacks of issue 39, as the text they were."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from researcher.cli import code as code_cli, main as main_cli
from researcher.review.plain import cell, plain

INVISIBLE = ["\u061c", "\u200b", "\u200c", "\u200d", "\u2060", "\ufeff", "\u00ad", "\u3164", "\u115f", "\u1160",
             "\uffa0", "\u202e", "\u2066", "\u200e", "\u2028", "\u2029", "\ue000", "\U000e0001", "\u0378"]


@pytest.mark.parametrize("ch", INVISIBLE, ids=[f"U+{ord(c):04X}" for c in INVISIBLE])
def test_every_invisible_or_format_character_is_shown_as_an_escape(ch):
    escape = f"\\u{ord(ch):04x}" if ord(ch) < 0x10000 else f"\\U{ord(ch):08x}"
    if ord(ch) < 0x100:
        escape = f"\\x{ord(ch):02x}"
    assert plain(f"a{ch}b") == f"a{escape}b"
    assert cell(f"a{ch}b\nc") == f"a{escape}b c"


def test_a_blank_parameter_name_is_visible_in_a_diff():
    # It compiles, and a Hangul filler renders as blank space: the reviewer read `def score(task, reply, =None)`.
    line = "+def score(task, reply, \u3164=None): return 1.0 if \u3164 else grade(reply)"
    compile(line[1:], "agent.py", "exec")
    assert plain(line) == "+def score(task, reply, \\u3164=None): return 1.0 if \\u3164 else grade(reply)"


def test_ordinary_text_in_any_script_is_left_as_it_is():
    text = "naïve café — 中文 テスト émoji 🙂 tab\tand\nnewline"
    assert plain(text) == text


HOSTILE_ERROR = ("review.by [link=https://evil.example]approve[/link] [bold red]ok[/] "
                 "\x1b]8;;https://evil.example\x1b\\click\x1b]8;;\x1b\\ \x1b[2J\x1b[1A")


@pytest.mark.parametrize("cli", [main_cli, code_cli], ids=["main", "code"])
def test_an_error_message_prints_its_markup_and_terminal_escapes_literally(cli, monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr(cli, "console", Console(file=out, force_terminal=True, color_system="truecolor", width=400))
    exit_ = cli._fail(HOSTILE_ERROR)
    printed = out.getvalue()
    assert exit_.exit_code == 2
    assert "[link=https://evil.example]approve[/link] [bold red]ok[/]" in printed  # markup as typed
    assert "\x1b]" not in printed and "\x1b[2J" not in printed and "\x1b[1A" not in printed  # no OSC 8, no erase
    assert "\\x1b]8;;https://evil.example" in printed and "\\x1b[2J" in printed  # shown as escapes
