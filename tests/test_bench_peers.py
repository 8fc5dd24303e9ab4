"""attnkit.bench.peers: optional libraries are imported quietly, and only for the import."""

from __future__ import annotations

import logging
import warnings

import pytest

from attnkit.bench import peers


def test_quiet_holds_back_import_time_noise_and_restores(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("torchao")
    before = log.level
    with caplog.at_level(logging.WARNING):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with peers.quiet():
                log.warning("Failed to load a native library")
                warnings.warn("deprecated", DeprecationWarning, stacklevel=1)
                log.error("a real error still shows")
            assert not seen  # the warning inside the block was held back
            warnings.warn("after", UserWarning, stacklevel=1)
            assert [str(w.message) for w in seen] == ["after"]  # and warnings work again
        log.warning("after the block")
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["a real error still shows", "after the block"]
    assert log.level == before


def test_import_quietly_imports_and_reports_what_is_missing() -> None:
    assert peers.import_quietly("json").dumps([1]) == "[1]"
    with pytest.raises(ImportError):
        peers.import_quietly("attnkit_no_such_module")
