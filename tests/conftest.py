import os

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


if os.environ.get("PYTEST_XDIST_WORKER"):
    # Several workers on a 2-core machine: one thread each avoids OpenMP barrier stalls that make
    # tiny ops take milliseconds when threads are oversubscribed.
    torch.set_num_threads(1)
