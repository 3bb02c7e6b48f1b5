"""The study report as one self-contained HTML file: the Markdown report's text, with its plots inline.

It converts only the Markdown that `researcher.review.report` writes (headings, pipe tables, fenced code,
image lines, `<details>` blocks, list items and paragraphs); it is not a general Markdown renderer.
Plots become base64 PNG `<img>` tags so the file can be opened or mailed on its own.
"""

from __future__ import annotations

import base64
import html
import re
from pathlib import Path

from researcher.review.plain import MARKDOWN_PUNCTUATION

_IMAGE = re.compile(r"^!\[(?P<alt>[^\]]*)\]\((?P<src>[^)]+)\)$")
_CODE = re.compile(r"`([^`]+)`")
_ESCAPED = re.compile("\\\\([" + re.escape(MARKDOWN_PUNCTUATION) + "])")  # a Markdown backslash escape


def _inline(text: str) -> str:
    # <br> is the report's own line break inside table cells: kept, everything else escaped. A backslash-escaped
    # character (`plain.markdown`: untrusted text) is held aside first, so it shows as typed and starts nothing.
    held: list[str] = []

    def hold(match: re.Match[str]) -> str:
        held.append(match.group(1))
        return f"\0{len(held) - 1}\0"

    escaped = html.escape(_ESCAPED.sub(hold, text)).replace("&lt;br&gt;", "<br>")
    escaped = _CODE.sub(r"<code>\1</code>", escaped)
    return re.sub("\0(\\d+)\0", lambda m: html.escape(held[int(m.group(1))]), escaped)


def _image(alt: str, src: str, root: Path) -> str:
    path = root / src
    if not path.is_file():  # a plot the Markdown names but that is gone: say so rather than break
        return f"<p>(plot {html.escape(alt)} missing: {html.escape(src)})</p>"
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return f'<p><img alt="{html.escape(alt)}" src="data:image/png;base64,{data}"></p>'


def _row(line: str) -> list[str]:
    cells = re.split(r"(?<!\\)\|", line.strip().strip("|")) if line.strip() != "|" else []
    return [c.strip() for c in cells]


def to_html(markdown: str, root: Path, title: str) -> str:
    """The report's Markdown as HTML; image paths are read relative to `root`."""
    out: list[str] = []
    lines = markdown.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("```"):
            # The fence is as long as the report made it (`plain.fenced`): only the same run closes it.
            fence = line[:len(line) - len(line.lstrip("`"))]
            block = []
            i += 1
            while i < len(lines) and lines[i].rstrip() != fence:
                block.append(lines[i])
                i += 1
            out.append(f"<pre>{html.escape(chr(10).join(block))}</pre>")
        elif line.startswith("|"):
            rows = []
            while i < len(lines) and lines[i].startswith("|"):
                if not re.fullmatch(r"\|[\s\-:|]+\|", lines[i].strip()):  # the separator row
                    rows.append(_row(lines[i]))
                i += 1
            head, body = rows[0], rows[1:]
            out.append("<table><tr>" + "".join(f"<th>{_inline(c)}</th>" for c in head) + "</tr>"
                       + "".join("<tr>" + "".join(f"<td>{_inline(c)}</td>" for c in r) + "</tr>" for r in body)
                       + "</table>")
            continue
        elif m := re.match(r"^(#{1,6}) (.*)$", line):
            level = len(m.group(1))
            out.append(f"<h{level}>{_inline(m.group(2))}</h{level}>")
        elif m := _IMAGE.match(line.strip()):
            out.append(_image(m.group("alt"), m.group("src"), root))
        elif line.startswith(("<details>", "</details>")):
            out.append(line)  # the report's own tags, passed through
        elif line.startswith("- "):
            out.append(f"<ul><li>{_inline(line[2:])}</li></ul>")
        elif line.strip():
            out.append(f"<p>{_inline(line)}</p>")
        i += 1
    style = "body{font-family:sans-serif;max-width:70em}table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 6px;vertical-align:top}"
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{style}</style></head><body>\n" + "\n".join(out) + "\n</body></html>\n")
