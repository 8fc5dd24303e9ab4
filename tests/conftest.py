import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

# matplotlib is an optional extra: choose its headless backend without importing it here (the
# tests that draw import it with pytest.importorskip).
os.environ.setdefault("MPLBACKEND", "Agg")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Headless Chromium, one per test module (starting it takes seconds); see tests/browser.py."""
    from tests.browser import start_browser  # selenium only for the tests that ask for it

    driver = start_browser()
    try:
        yield driver
    finally:
        driver.quit()


if os.environ.get("PYTEST_XDIST_WORKER"):
    # Several workers on a 2-core machine: one thread each avoids OpenMP barrier stalls that make
    # tiny ops take milliseconds when threads are oversubscribed.
    torch.set_num_threads(1)
