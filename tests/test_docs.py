"""The documentation site: its code runs, its figures draw, its reference covers the package, and
``mkdocs build --strict`` passes (so every cross-reference resolves)."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import re
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

import attnkit

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
GUIDE = sorted((DOCS / "guide").glob("*.md"))
# Pages whose code trains, loads the bundled sentence model or times kernels: seconds each.
SLOW_PAGES = {
    "benchmarks",
    "complexity",
    "decoding",
    "distributed",
    "explorer",
    "lab",
    "models",
    "serve",
    "structured",
    "tour",
}


def python_blocks(text: str) -> list[str]:
    """The ```python blocks of a markdown page, in order (indented blocks too, dedented)."""
    pattern = re.compile(r"^(?P<indent>[ ]*)```python\n(?P<body>.*?)^(?P=indent)```$", re.M | re.S)
    blocks = []
    for match in pattern.finditer(text):
        indent = len(match["indent"])
        lines = match["body"].splitlines()
        blocks.append("\n".join(line[indent:] for line in lines))
    return blocks


def _nav_pages() -> list[str]:
    """Every page path named in mkdocs.yml's nav (``- Title: page.md`` or ``- page.md``)."""
    nav = (ROOT / "mkdocs.yml").read_text().split("\nnav:", 1)[1]
    return re.findall(r"^\s*-\s*(?:[^:\n]*:\s*)?([\w/.-]+\.md)\s*$", nav, re.M)


def _load(name: str, path: Path) -> object:
    """The module of a script that is not part of the package (``docs/*.py``)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _figures() -> object:
    return _load("make_figures", DOCS / "make_figures.py")


def test_collector_finds_blocks_and_fails_on_broken_ones():
    page = "text\n```python\nx = 1\n```\n\n  ```python\n  y = x + 1\n  ```\n```bash\nls\n```\n"
    assert python_blocks(page) == ["x = 1", "y = x + 1"]
    with pytest.raises(ZeroDivisionError):
        _run_blocks(python_blocks("```python\n1 / 0\n```\n"), "broken.md")


def _run_blocks(blocks: list[str], name: str) -> None:
    namespace: dict[str, object] = {"__name__": f"docs_{Path(name).stem}"}
    for i, block in enumerate(blocks):
        exec(compile(block, f"{name} (python block {i + 1})", "exec"), namespace)


@pytest.mark.parametrize(
    "page",
    [
        pytest.param(p, marks=pytest.mark.slow) if p.stem in SLOW_PAGES else p
        for p in [DOCS / "index.md", *GUIDE]
    ],
    ids=lambda p: p.stem,
)
def test_guide_code_runs(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Every ```python block of the page runs, in order, in one namespace, in a scratch folder."""
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    monkeypatch.chdir(tmp_path)
    blocks = python_blocks(page.read_text())
    for block in blocks:
        ast.parse(block)  # a syntax error names the page before anything runs
    _run_blocks(blocks, page.name)


def test_every_guide_page_is_in_the_nav_and_every_nav_page_exists():
    nav = set(_nav_pages())
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert {f"guide/{p.name}" for p in GUIDE} <= nav
    assert nav <= pages, sorted(nav - pages)


def _public_modules() -> set[str]:
    package = ROOT / "src" / "attnkit"
    names = set()
    for path in package.rglob("*.py"):
        parts = path.relative_to(package).with_suffix("").parts
        if parts[0] == "commands" or any(p.startswith("_") for p in parts):
            continue
        names.add("attnkit." + ".".join(parts))
    return names


def test_reference_documents_every_public_module():
    documented = set()
    for page in (DOCS / "reference").glob("*.md"):
        documented |= set(re.findall(r"^::: (attnkit[\w.]*)", page.read_text(), re.M))
    missing = _public_modules() - documented
    assert not missing, f"no reference page renders {sorted(missing)}"


def test_reference_index_links_every_name_of_attnkit_all():
    text = (DOCS / "reference" / "attnkit.md").read_text()
    linked = set(re.findall(r"\[`([\w]+)`\]", text)) | set(re.findall(r"`(__\w+__)`", text))
    assert set(attnkit.__all__) <= linked, sorted(set(attnkit.__all__) - linked)


def test_figures_used_by_the_guide_are_the_ones_the_script_draws():
    used = set()
    for page in [DOCS / "index.md", *GUIDE]:
        used |= set(
            re.findall(
                r"\(\.\./figures/([\w.-]+\.png)\)|\(figures/([\w.-]+\.png)\)", page.read_text()
            )
        )
    used_names = {a or b for a, b in used}
    assert used_names == set(_figures().FIGURES)  # type: ignore[attr-defined]


@pytest.mark.slow
def test_make_figures_script_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """The script's command line draws the figures it is asked for (the site build draws all)."""
    pytest.importorskip("matplotlib")
    script = _figures()
    assert script.main(["--out", str(tmp_path), "masks.png", "softmax.png"]) == 0  # type: ignore[attr-defined]
    assert {p.name for p in tmp_path.iterdir()} == {"masks.png", "softmax.png"}
    for path in tmp_path.iterdir():
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert path.stat().st_size > 5_000, path  # a drawn figure, not an empty canvas
    with pytest.raises(SystemExit) as exited:
        script.main(["--out", str(tmp_path), "nope.png"])  # type: ignore[attr-defined]
    assert exited.value.code == 2 and "nope.png" in capsys.readouterr().err


def _hooks() -> object:
    pytest.importorskip("mkdocs")
    return _load("docs_hooks", DOCS / "hooks.py")


def test_docstring_roles_become_reference_links():
    hooks = _hooks()
    resolve = hooks._resolve  # type: ignore[attr-defined]
    functional = ["attnkit.functional"]
    assert resolve("scaled_dot_product_attention", functional) == (
        "attnkit.functional.scaled_dot_product_attention"
    )
    assert resolve("attnkit.masks.Structure", functional) == "attnkit.masks.Structure"
    assert resolve("TransformerLM.generate", ["attnkit.models"]) == (
        "attnkit.models.TransformerLM.generate"
    )

    class FakePage:
        markdown = "::: attnkit.functional\n"

    html = hooks.on_page_content(  # type: ignore[attr-defined]
        "see :func:<code>attend</code> and :class:<code>~attnkit.masks.Structure</code>.",
        FakePage(),
    )
    assert html == (
        'see <autoref identifier="attnkit.functional.attend" optional><code>attend</code></autoref>'
        ' and <autoref identifier="attnkit.masks.Structure" optional><code>Structure</code>'
        "</autoref>."
    )


def _inventory(path: Path) -> set[str]:
    """Object names in a Sphinx ``objects.inv`` (what mkdocstrings rendered)."""
    data = path.read_bytes()
    header_end = 0
    for _ in range(4):
        header_end = data.index(b"\n", header_end) + 1
    lines = zlib.decompress(data[header_end:]).decode().splitlines()
    return {line.split(" ", 1)[0] for line in lines}


@pytest.mark.slow
def test_site_builds_strict_offline(tmp_path: Path):
    """``mkdocs build --strict``: no warning, every reference resolved, nothing fetched."""
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    pytest.importorskip("material")
    site = tmp_path / "site"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
        "NO_MKDOCS_2_WARNING": "1",
        # Any attempt to reach the network fails fast instead of hanging the build.
        "HTTP_PROXY": "http://127.0.0.1:9",
        "HTTPS_PROXY": "http://127.0.0.1:9",
    }
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "WARNING" not in done.stderr, done.stderr

    rendered = _inventory(site / "objects.inv")
    for name in attnkit.__all__:
        if name == "__version__":
            continue
        obj = getattr(attnkit, name)
        target = (
            obj.__name__
            if hasattr(obj, "__file__")
            else f"{obj.__module__}.{obj.__name__}"
            if hasattr(obj, "__qualname__")
            else None
        )
        if target is not None:
            assert target in rendered, f"{name}: {target} is not in the API reference"
    for module in _public_modules():
        assert module in rendered, module

    for name in _figures().FIGURES:  # type: ignore[attr-defined]
        png = (site / "figures" / name).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5_000, name
    for page in site.rglob("*.html"):
        assert ":func:<code>" not in page.read_text(), page
        fetched = re.findall(
            r"<(?:script|link|img)[^>]+(?:src|href)=\"(https?://[^\"]+)", page.read_text()
        )
        assert not fetched, f"{page.relative_to(site)} loads {fetched[:3]}"


def test_modules_named_in_reference_import():
    """The reference's ``:::`` targets are importable (a renamed module fails here, fast)."""
    for page in (DOCS / "reference").glob("*.md"):
        for target in re.findall(r"^::: (attnkit[\w.]*)", page.read_text(), re.M):
            if target.startswith(
                (
                    "attnkit.interop",
                    "attnkit.lab",
                    "attnkit.viz",
                    "attnkit.tour",
                    "attnkit.explorer",
                    "attnkit.bench",
                )
            ):
                pytest.importorskip("matplotlib")
                pytest.importorskip("safetensors")
            importlib.import_module(target)
