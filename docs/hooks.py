"""mkdocs hooks: the guide's figures are drawn by ``docs/make_figures.py`` at build time."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

HERE = Path(__file__).resolve().parent


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
