"""mkdocs hooks: the guide's figures are drawn at build time, and the docstrings' Sphinx-style
cross-references (``:func:`name```) become links of the API reference."""

from __future__ import annotations

import html
import importlib
import importlib.util
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

HERE = Path(__file__).resolve().parent
DIRECTIVE = re.compile(r"^::: (attnkit[\w.]*)", re.M)
# A role in a docstring, as Markdown renders it: :func:<code>name</code>
ROLE = re.compile(r":(?:func|mod|class|meth|data|attr|exc|obj):<code>(~?)([\w.]+)</code>")


def _make_figures() -> Any:
    spec = importlib.util.spec_from_file_location("make_figures", HERE / "make_figures.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def on_files(files: Files, config: Any) -> Files:
    """Add ``figures/<name>.png`` for every figure the script draws."""
    for name, png in _make_figures().render().items():
        files.append(File.generated(config, f"figures/{name}", content=png))
    return files


def _resolve(name: str, modules: list[str]) -> str:
    """The full identifier of ``name`` as written in a docstring of one of ``modules``."""
    if name.startswith("attnkit"):
        return name
    head = name.split(".", 1)[0]
    for module_name in modules:
        module = importlib.import_module(module_name)
        if hasattr(module, head):
            owner = getattr(getattr(module, head), "__module__", None)
            if isinstance(owner, str) and owner.startswith("attnkit") and owner != module_name:
                return f"{owner}.{name}"  # imported into this module: link the definition
            return f"{module_name}.{name}"
    for module_name in modules:  # a method or attribute named from inside its class
        for cls_name, cls in vars(importlib.import_module(module_name)).items():
            if isinstance(cls, type) and cls.__module__ == module_name and head in vars(cls):
                return f"{module_name}.{cls_name}.{name}"
    return f"attnkit.{name}"


def on_page_content(html_text: str, page: Page, **_: Any) -> str:
    """Turn the roles on API pages into (optional) autorefs; unresolved ones stay plain code."""
    modules = DIRECTIVE.findall(page.markdown or "")
    if not modules:
        return html_text

    def link(match: re.Match[str]) -> str:
        short, name = match[1] == "~", match[2]
        title = name.rsplit(".", 1)[-1] if short else name
        identifier = html.escape(_resolve(name, modules), quote=True)
        return f'<autoref identifier="{identifier}" optional><code>{title}</code></autoref>'

    return ROLE.sub(link, html_text)
