from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from transferd.config import nixl_installed

from .harness import Cluster

MOONCAKE = importlib.util.find_spec("mooncake") is not None
NIXL = nixl_installed()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "planes: also run the test over the Mooncake TE and NIXL data planes (the "
                                       "`plane` parameter: `auto` is today's choice, `mooncake` and `nixl` set "
                                       "data_plane on every daemon)")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "plane" in metafunc.fixturenames and metafunc.definition.get_closest_marker("planes"):
        metafunc.parametrize("plane", ["auto", "mooncake", "nixl"])  # unmarked tests keep their ids: plane "auto"


@pytest.fixture
def plane(request: pytest.FixtureRequest) -> str:
    name: str = getattr(request, "param", "auto")
    if name in ("mooncake", "nixl"):  # CI installs both extras: the absence of either is a failure there
        return request.getfixturevalue(f"plane_{name}")
    return name


@pytest.fixture
def plane_mooncake() -> str:
    """A test that runs only over Mooncake TE (a failure under CI without the wheel)."""
    if not MOONCAKE:
        if os.environ.get("CI"):
            pytest.fail("mooncake-transfer-engine is not installed (pip install -e '.[mooncake]'; libibverbs1)")
        pytest.skip("mooncake-transfer-engine is not installed (pip install -e '.[mooncake]')")
    return "mooncake"


@pytest.fixture
def plane_nixl() -> str:
    """A test that runs only over NIXL (a failure under CI without the wheel)."""
    if not NIXL:
        if os.environ.get("CI"):
            pytest.fail("NIXL is not installed (pip install -e '.[nixl]')")
        pytest.skip("NIXL is not installed (pip install -e '.[nixl]')")
    return "nixl"


@pytest.fixture
def cluster(tmp_path: Path, plane: str) -> Iterator[Cluster]:
    c = Cluster(tmp_path, plane=plane)
    try:
        yield c
    finally:
        codes = c.close()
    bad = {k: v for k, v in codes.items() if v != 0}
    assert not bad, f"daemons did not exit cleanly on SIGTERM: {bad}\n{c.logs()}"
