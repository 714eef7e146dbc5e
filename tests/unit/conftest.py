"""Shared helpers for the unit tests (pure logic; no sockets)."""

from __future__ import annotations

import os
from collections.abc import Callable
from types import ModuleType

import pytest


def require_torch() -> ModuleType:
    """Import torch for tests of torch views.

    Locally a missing torch skips the test; under CI (``CI`` set) torch is part of the test
    environment, so a missing or broken torch fails the test instead of hiding it as a skip.
    """
    if os.environ.get("CI"):
        try:
            import torch
        except ImportError as exc:
            pytest.fail(f"CI is set but torch cannot be imported: {exc!r}")
        return torch
    return pytest.importorskip("torch")


@pytest.fixture
def torch_mod() -> ModuleType:
    """torch, or a skip (locally) / failure (under CI) when it cannot be imported."""
    return require_torch()


@pytest.fixture
def torch_loader() -> Callable[[], ModuleType]:
    """The helper itself, for tests that exercise it."""
    return require_torch
