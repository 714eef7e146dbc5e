from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.harness import Cluster


def require_sglang() -> None:
    """SGLang 0.5.23 must be importable: under CI (``CI`` set) its absence fails the test; elsewhere
    the test is skipped with the reason and the commands that install it."""
    try:
        import sglang.srt.disaggregation.utils  # noqa: F401
    except ImportError as exc:
        msg = (f"SGLang is not importable ({exc}); install it with: pip install -e '.[sglang]' && "
               f"pip install --no-deps sglang==0.5.23")
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        codes = c.close()
    bad = {k: v for k, v in codes.items() if v != 0}
    assert not bad, f"daemons did not exit cleanly on SIGTERM: {bad}\n{c.logs()}"
