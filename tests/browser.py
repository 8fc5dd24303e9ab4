"""Headless Chromium for tests of browser-facing output (the explorer, reports).

Uses Debian's ``chromium`` and ``chromium-driver`` through selenium, with the driver's path given
explicitly so that selenium-manager never runs and nothing is downloaded. Where the browser or
selenium is missing the tests skip with the reason, except in CI (``CI=true``), where they fail:
``.ci/run`` installs the browser, so a skip there would hide a broken set-up.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

CHROMIUM_CANDIDATES = ("/usr/bin/chromium", "/usr/bin/chromium-browser")
DRIVER_CANDIDATES = ("/usr/bin/chromedriver",)
FLOAT16_ATOL = 2.5e-4  # float16 rounding of a weight in [0, 1], as the explorer embeds them


def _first(paths: tuple[str, ...], name: str) -> str | None:
    for path in paths:
        if Path(path).is_file():
            return path
    return shutil.which(name)


def _unavailable(reason: str) -> None:
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"CI must run the browser tests, but {reason}", pytrace=False)
    pytest.skip(f"browser tests need Chromium + chromedriver + selenium: {reason}")


def start_browser(width: int = 1280, height: int = 900) -> Any:
    """A headless Chromium WebDriver with its browser console log enabled (skip/fail if absent)."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        _unavailable("selenium is not installed (pip install selenium)")
        raise  # unreachable: _unavailable raises
    binary = _first(CHROMIUM_CANDIDATES, "chromium")
    driver_path = _first(DRIVER_CANDIDATES, "chromedriver")
    if binary is None or driver_path is None:
        _unavailable(
            "chromium or chromedriver is missing (Debian: apt-get install chromium chromium-driver)"
        )
    options = webdriver.ChromeOptions()
    options.binary_location = str(binary)
    for arg in (
        "--headless=new",
        "--no-sandbox",  # CI containers run as root
        "--disable-dev-shm-usage",
        "--disable-gpu",
        f"--window-size={width},{height}",
        "--force-device-scale-factor=1",
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(executable_path=str(driver_path)), options=options)


def open_page(driver: Any, path: Path, ready: str | None = "ready", timeout: float = 30.0) -> None:
    """Load a local file and drain the old console log.

    Waits for ``document.body.dataset[ready] == "1"`` (the page's scripts have finished), or for
    the document to be loaded when ``ready`` is None (pages without scripts).
    """
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get_log("browser")
    driver.get(Path(path).resolve().as_uri())
    check = (
        "return document.readyState === 'complete' ? '1' : ''"
        if ready is None
        else f"return document.body && document.body.dataset.{ready}"
    )
    WebDriverWait(driver, timeout).until(lambda d: d.execute_script(check) == "1")


def console_errors(driver: Any) -> list[str]:
    """Severe console entries (uncaught exceptions, failed loads) since the last call."""
    return [e["message"] for e in driver.get_log("browser") if e.get("level") == "SEVERE"]


# --------------------------------------------------------------------------- the explorer

LINES_JS = """
return Array.from(document.querySelectorAll('#lines line')).map((l) => ({
  layer: +l.dataset.layer, head: +l.dataset.head, query: +l.dataset.query, key: +l.dataset.key,
  weight: +l.dataset.weight, opacity: +l.getAttribute('stroke-opacity'),
  cls: l.getAttribute('class'), stroke: l.getAttribute('stroke'),
  y1: +l.getAttribute('y1'), y2: +l.getAttribute('y2')}));
"""
TOKEN_Y_JS = """
const ys = (id) => Array.from(document.querySelectorAll('#' + id + ' .token text'))
  .map((t) => +t.getAttribute('y'));
return [ys('query-tokens'), ys('key-tokens')];
"""


def hover_token(driver: Any, side: str, index: int) -> None:
    """Move the pointer onto the explorer's query (``"q"``) or key (``"k"``) token ``index``."""
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    group = "query-tokens" if side == "q" else "key-tokens"
    token = driver.find_elements(By.CSS_SELECTOR, f"#{group} .token")[index]
    # Off any token first: a pointer already where the token now lies (left there by an earlier
    # page or frame of the shared browser) would move nowhere and fire no mouseenter.
    away = driver.find_element(By.ID, "layer-select")
    ActionChains(driver).move_to_element(away).move_to_element(token).perform()


def select_layer(driver: Any, layer: int) -> None:
    """Choose ``layer`` in the explorer's head view."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    Select(driver.find_element(By.ID, "layer-select")).select_by_value(str(layer))


def check_focus_lines(
    driver: Any, w: torch.Tensor, layer: int, side: str, index: int, heads: list[int]
) -> list[dict[str, Any]]:
    """The drawn lines are exactly the selected token's weights, the brightest on the argmax."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    own_side = {"q": "query", "k": "key"}[side]

    def drawn(d: Any) -> Any:
        # (the page redraws on its next frame: a busy machine may not have drawn it yet)
        got = d.execute_script(LINES_JS)
        focused = all(
            line["cls"] == "focus" and line["layer"] == layer and line[own_side] == index
            for line in got
        )
        return got if got and focused else False

    try:
        lines = WebDriverWait(driver, 10).until(drawn)
    except TimeoutException:  # checked below, with the message of what is drawn
        lines = driver.execute_script(LINES_JS)
    q_y, k_y = driver.execute_script(TOKEN_Y_JS)
    row_h = q_y[1] - q_y[0]
    assert sorted({line["head"] for line in lines}) == heads
    colours = {line["head"]: line["stroke"] for line in lines}
    assert len(set(colours.values())) == len(heads)  # one colour per head
    for h in heads:
        own = [line for line in lines if line["head"] == h]
        values = w[layer, h, index] if side == "q" else w[layer, h, :, index]  # (S,) or (L,)
        for line in own:
            assert line["cls"] == "focus" and line["layer"] == layer
            assert line[{"q": "query", "k": "key"}[side]] == index
            other = line["key"] if side == "q" else line["query"]
            assert line["weight"] == pytest.approx(float(values[other]), abs=FLOAT16_ATOL)
            # absolute scale (few tokens): opacity is the weight itself
            assert line["opacity"] == pytest.approx(float(values[other]), abs=1e-3)
            # the line joins the two tokens it stands for
            assert abs(line["y1"] - q_y[line["query"]]) < row_h / 2
            assert abs(line["y2"] - k_y[line["key"]]) < row_h / 2
        # every weight visible at 1% opacity has its line, none more
        assert len(own) == int((values >= 0.0105).sum()) or len(own) == int(
            (values >= 0.0095).sum()
        )
        brightest = max(own, key=lambda line: line["opacity"])
        assert (brightest["key"] if side == "q" else brightest["query"]) == int(values.argmax())
    return lines


def shown_weights(driver: Any) -> torch.Tensor:
    """Every weight the open explorer page decoded, ``(layers, H, L, S)``."""
    return torch.tensor(
        driver.execute_script(
            "const e = window.attnExplorer, out = [];"
            "for (let l = 0; l < e.layers; l++) { const a = []; out.push(a);"
            " for (let h = 0; h < e.heads; h++) { const b = []; a.push(b);"
            "  for (let i = 0; i < e.L; i++) { const r = []; b.push(r);"
            "   for (let j = 0; j < e.S; j++) r.push(e.weight(l, h, i, j)); } } }"
            "return out;"
        )
    )
