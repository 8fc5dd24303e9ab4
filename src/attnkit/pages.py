"""The HTML every attnkit page is made of: one page shell, one embedded figure, one embedded page.

The tour's report, the lab's report, ``attnkit explain``'s pages and the attention explorer are
all :func:`page` around their own body, so they share one document head, one base stylesheet and
one way of escaping; each adds its own CSS. Figures are embedded with :func:`figure` (a base64
PNG, so a page can be mailed or opened anywhere, naming and linking its file), and a whole page
goes inside another, or into a notebook cell, with :func:`iframe` (a sandboxed ``srcdoc``: its
scripts and element ids cannot meet those of the page around it).

Only the standard library is used, and nothing of attnkit: the modules that write pages (the
explorer, the lab, the tour, the notebook views, the commands) all sit above this one.
"""

from __future__ import annotations

import base64
import html
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

__all__ = ["BASE_CSS", "asset", "figure", "iframe", "page", "table"]

BASE_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Helvetica,Arial,sans-serif;max-width:1150px;
margin:1.5em auto;padding:0 1.2em;color:#1f2328;background:#fff;line-height:1.45}
h1{font-size:1.6em;margin:0 0 .2em}h2{border-bottom:1px solid #d0d7de;padding-bottom:.25em;
margin-top:1.8em;font-size:1.3em}h3{font-size:1.05em}
figure{margin:1.2em 0}figure img{max-width:100%;border:1px solid #eaeef2;border-radius:6px}
figcaption{color:#59636e;font-size:.88em}
table{border-collapse:collapse;margin:1em 0;font-size:.9em}
th,td{border:1px solid #d0d7de;padding:.3em .6em;text-align:right}
th{background:#f6f8fa}td.l,th.l{text-align:left}
code,pre{background:#f6f8fa;border-radius:4px;padding:.1em .3em;font-size:.9em}
pre{padding:.8em;overflow-x:auto}
.sub{color:#59636e;margin-top:0}
.ok{color:#1a7f37}.bad{color:#cf222e}
"""
"""The stylesheet every page starts from (typography, figures, tables, code)."""


def asset(name: str) -> str:
    """The text of ``attnkit/assets/<name>`` (the explorer's script, style and template).

    Raises:
        FileNotFoundError: If there is no such asset.
    """
    return resources.files("attnkit").joinpath("assets").joinpath(name).read_text(encoding="utf-8")


def page(title: str, body: str, *, css: str = "", base_css: bool = True, head: str = "") -> str:
    """One HTML document: the shared head (charset, viewport, title, styles) around ``body``.

    Args:
        title: The document title (plain text; escaped here).
        body: The body's HTML.
        css: The page's own stylesheet, after :data:`BASE_CSS`.
        base_css: Whether to start from :data:`BASE_CSS` (the explorer brings its own layout).
        head: More HTML for the head (already escaped).

    Returns:
        The document, ``<!DOCTYPE html>`` first.
    """
    style = (BASE_CSS if base_css else "") + css
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>{html.escape(title)}</title>\n<style>{style}</style>{head}</head>\n"
        f"<body>\n{body}\n</body></html>\n"
    )


def figure(path: str | Path, caption: str, *, file: str | None = None, embed: bool = True) -> str:
    """A ``<figure>`` showing the PNG at ``path``, with its caption and a link to its file.

    Args:
        path: The PNG on disk.
        caption: What it shows (plain text): the caption and the image's alt text.
        file: The link to the file, relative to the page (default: the file's name). The image
            carries it as ``data-file``.
        embed: Embed the image as base64 (the page stands alone) rather than refer to ``file``
            (the page is read beside its files).

    Returns:
        The figure's HTML.

    Raises:
        FileNotFoundError: If ``path`` does not exist.
        ValueError: If the file is not a PNG.
    """
    data = Path(path).read_bytes()
    if not data.startswith(b"\x89PNG\r\n\x1a\n"):
        raise ValueError(f"{path} is not a PNG file")
    link = html.escape(file if file is not None else Path(path).name)
    text = html.escape(caption)
    source = "data:image/png;base64," + base64.b64encode(data).decode("ascii") if embed else link
    return (
        f'<figure><img src="{source}" alt="{text}" data-file="{link}">'
        f'<figcaption>{text} <a href="{link}">{link}</a></figcaption></figure>'
    )


def iframe(document: str, *, height: int = 720, title: str = "attnkit page") -> str:
    """An ``<iframe>`` holding ``document`` itself (``srcdoc``), sandboxed to run scripts only.

    The embedded page is its own document: its element ids, styles and scripts do not collide
    with the page around it or with other embedded pages, it needs no file or server, and the
    sandbox (no ``allow-same-origin``) keeps its scripts away from the outer page.

    Args:
        document: A whole HTML page.
        height: The frame's height in CSS pixels (at least 100).
        title: The frame's accessible title.

    Returns:
        The iframe's HTML.

    Raises:
        ValueError: If ``height`` is below 100.
    """
    if isinstance(height, bool) or not isinstance(height, int) or height < 100:
        raise ValueError(f"height must be an int of at least 100 (pixels), got {height!r}")
    return (
        f'<iframe class="attnkit-frame" srcdoc="{html.escape(document, quote=True)}" '
        f'sandbox="allow-scripts" title="{html.escape(title)}" loading="eager" '
        f'style="width:100%;height:{height}px;border:1px solid #d0d7de;border-radius:6px">'
        "</iframe>"
    )


def table(header: Sequence[str], rows: Sequence[Sequence[object]], *, left: int = 1) -> str:
    """An HTML table: ``header`` is plain text (escaped), the cells are HTML.

    Args:
        header: Column titles.
        rows: One list of cells (HTML, or values formatted with ``str``) per row.
        left: How many leading columns are left-aligned (text); the rest align right (numbers).

    Returns:
        The table's HTML.
    """

    def cell(tag: str, i: int, value: object) -> str:
        cls = ' class="l"' if i < left else ""
        return f"<{tag}{cls}>{value}</{tag}>"

    head = "".join(cell("th", i, html.escape(str(h))) for i, h in enumerate(header))
    body = "".join(
        "<tr>" + "".join(cell("td", i, v) for i, v in enumerate(r)) + "</tr>" for r in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"
