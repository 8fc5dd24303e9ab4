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

CHROMIUM_CANDIDATES = ("/usr/bin/chromium", "/usr/bin/chromium-browser")
DRIVER_CANDIDATES = ("/usr/bin/chromedriver",)


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
