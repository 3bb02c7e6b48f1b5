"""The HTML report: the Markdown's tables, code and plots, with plots inlined and missing ones named."""

from __future__ import annotations

import base64

from researcher.review.report_html import to_html

_PNG = base64.b64decode(  # a 1x1 PNG: enough to check the bytes land in the page unchanged
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg==")


def test_plots_are_inlined_as_base64_and_tables_become_html(tmp_path):
    (tmp_path / "report").mkdir()
    (tmp_path / "report" / "curves.png").write_bytes(_PNG)
    markdown = ("# Study s\n\n| id | diff |\n| --- | --- |\n| r1-1 | `lr=0.03`<br>a \\| b |\n\n"
                "![curves](report/curves.png)\n\n```\nlog <tail>\n```\n")
    page = to_html(markdown, tmp_path, "study s")
    assert "<h1>Study s</h1>" in page
    assert "<td>r1-1</td><td><code>lr=0.03</code><br>a | b</td>" in page
    assert f"data:image/png;base64,{base64.b64encode(_PNG).decode()}" in page
    assert "<pre>log &lt;tail&gt;</pre>" in page


def test_a_plot_the_markdown_names_but_is_gone_is_reported_not_fatal(tmp_path):
    page = to_html("![scores](report/scores.png)\n", tmp_path, "study s")
    assert "plot scores missing: report/scores.png" in page
    assert "<img" not in page
