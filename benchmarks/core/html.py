"""One self-contained ``report.html`` for a benchmark folder: the analysis's numbers and figures,
the run's own figures (7, 1/10, 13, 14, 12) and its tables (``summary.md``). Images are linked
relatively (they sit in the same folder tree), styles are inline, and nothing is loaded from
the network: the file opens offline."""

from __future__ import annotations

import html
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .figures import Figure

RUN_FIGURES = (
    ("fig7_error_vs_time.png", "Figure 7: test error against wall-clock"),
    ("fig1_breakdown.png", "Figure 1/10: where an epoch's time goes"),
    ("fig13_selectivity.png", "Figure 13: selectivity sweep"),
    ("fig14_pareto.png", "Figure 14: Pareto frontier"),
    ("fig12_noise.png", "Figure 12: label noise"),
)
"""The run report's figures (``report.py``), shown when the folder has them."""

_STYLE = """
body { font-family: sans-serif; max-width: 1100px; margin: 2em auto; padding: 0 1em;
       color: #222; line-height: 1.4; }
h1, h2, h3 { color: #123; }
table { border-collapse: collapse; margin: 1em 0; font-size: 0.85em; }
th, td { border: 1px solid #bbb; padding: 3px 7px; text-align: left; }
th { background: #eef; }
figure { margin: 1.5em 0; }
figure img { max-width: 100%; border: 1px solid #ddd; }
figcaption { font-size: 0.85em; color: #444; max-width: 800px; }
code { background: #f4f4f4; padding: 0 3px; }
nav a { margin-right: 1em; }
"""


def _inline(text: str) -> str:
    """Markdown inline markup (code, bold) as HTML, everything else escaped."""
    out = html.escape(text, quote=False)
    out = re.sub(r"`([^`]+)`", r"<code>\1</code>", out)
    return re.sub(r"\*\*([^*]+)\*\*", r"<strong>\1</strong>", out)


def markdown_html(text: str) -> str:
    """The markdown that ``report.py`` writes (headings, tables, paragraphs, inline code and
    bold) as HTML."""
    out: list[str] = []
    para: list[str] = []
    table: list[list[str]] = []

    def flush() -> None:
        if para:
            out.append(f"<p>{_inline(' '.join(para))}</p>")
            para.clear()
        if table:
            head, *body = table
            out.append("<table><tr>" + "".join(f"<th>{_inline(c)}</th>" for c in head) + "</tr>")
            for row in body:
                out.append("<tr>" + "".join(f"<td>{_inline(c)}</td>" for c in row) + "</tr>")
            out.append("</table>")
            table.clear()

    for line in text.splitlines():
        s = line.strip()
        if s.startswith("|"):
            if para:
                flush()
            cells = [c.strip() for c in s.strip("|").split("|")]
            if not all(re.fullmatch(r":?-+:?", c) for c in cells):
                table.append(cells)
        elif s.startswith("#"):
            flush()
            level = min(len(s) - len(s.lstrip("#")) + 1, 4)  # the page's h1 is the title
            out.append(f"<h{level}>{_inline(s.lstrip('#').strip())}</h{level}>")
        elif not s:
            flush()
        else:
            if table:
                flush()
            para.append(s)
    flush()
    return "\n".join(out)


def _figure(src: str, title: str, caption: str) -> str:
    return (
        f'<figure><img src="{html.escape(src)}" alt="{html.escape(title)}">'
        f"<figcaption><strong>{html.escape(title)}.</strong> {html.escape(caption)}"
        "</figcaption></figure>"
    )


def _number(v: Any) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{100 * v:.1f}%" if 0 <= v <= 1 else f"{v:.4g}"
    return html.escape(str(v))


def write_report(
    folder: Path,
    figures: Sequence[Figure],
    numbers: dict[str, Any],
    title: str,
    intro: str,
) -> Path:
    """Write ``folder/report.html``: the numbers, the analysis ``figures`` (files under
    ``folder``), the run's figures that exist and ``summary.md``. Returns its path."""
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title><style>{_STYLE}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        '<nav><a href="#numbers">Numbers</a><a href="#analysis">Per-example analysis</a>'
        '<a href="#run">The run\'s figures</a><a href="#tables">Tables</a></nav>',
        f"<p>{html.escape(intro)}</p>",
        '<h2 id="numbers">What the figures say</h2>',
        "<table><tr><th>measure</th><th>value</th></tr>",
    ]
    parts += [
        f"<tr><td>{html.escape(k)}</td><td>{_number(v)}</td></tr>" for k, v in numbers.items()
    ]
    parts.append("</table>")
    parts.append('<h2 id="analysis">Per-example analysis</h2>')
    for f in figures:
        parts.append(_figure(f.path.relative_to(folder).as_posix(), f.title, f.caption))
    parts.append('<h2 id="run">The run\'s figures</h2>')
    shown = [(name, t) for name, t in RUN_FIGURES if (folder / name).exists()]
    parts += [_figure(name, t, "From the benchmark's report (run.py).") for name, t in shown]
    if not shown:
        parts.append("<p>This folder has none (run.py writes them).</p>")
    parts.append('<h2 id="tables">Tables (summary.md)</h2>')
    summary = folder / "summary.md"
    parts.append(
        markdown_html(summary.read_text()) if summary.exists() else "<p>No summary.md here.</p>"
    )
    parts.append("</body></html>")
    path = folder / "report.html"
    path.write_text("\n".join(parts) + "\n", encoding="utf-8")
    return path
