from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from .harness import Cluster


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        codes = c.close()
    bad = {k: v for k, v in codes.items() if v != 0}
    assert not bad, f"daemons did not exit cleanly on SIGTERM: {bad}\n{c.logs()}"
