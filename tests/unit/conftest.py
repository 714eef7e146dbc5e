"""Shared helpers for the unit tests (pure logic; no sockets)."""

from __future__ import annotations

import os
from types import ModuleType
from typing import Callable

import pytest

from transferd.layout import ModelSpec, PoolLayout, StateComponent


def require_torch() -> ModuleType:
    """Import torch for tests of torch views.

    Locally a missing torch skips the test; under CI (``CI`` set) torch is part of the test
    environment, so a missing or broken torch fails the test instead of hiding it as a skip.
    """
    if os.environ.get("CI"):
        try:
            import torch
        except ImportError as exc:  # pragma: no cover - depends on the environment
            pytest.fail(f"CI is set but torch cannot be imported: {exc!r}")
        return torch
    return pytest.importorskip("torch")


@pytest.fixture
def torch_mod() -> ModuleType:
    return require_torch()


def _small_spec(**kw: object) -> ModelSpec:
    """A small hybrid model: 4 MHA KV layers plus two state components (2 and 3 layers)."""
    base: dict[str, object] = dict(
        name="tiny",
        dtype="bf16",
        page_size=4,
        kv_layers=4,
        kv_format="mha",
        kv_token_elems=8,
        state=(
            StateComponent("conv", 2, (3, 4), "bf16"),
            StateComponent("ssm", 3, (5,), "fp32"),
        ),
        aux_row_bytes=16,
    )
    base.update(kw)
    return ModelSpec(**base)  # type: ignore[arg-type]


def _small_layout(kv_pages: int = 32, state_slots: int = 8, aux_slots: int = 4, **kw: object) -> PoolLayout:
    return _small_spec(**kw).layout(kv_pages, state_slots, aux_slots)


@pytest.fixture
def make_spec() -> Callable[..., ModelSpec]:
    """Factory for the small hybrid model spec; keyword arguments override its fields."""
    return _small_spec


@pytest.fixture
def make_layout() -> Callable[..., PoolLayout]:
    """Factory: ``make_layout(kv_pages, state_slots, aux_slots, **spec_overrides)``."""
    return _small_layout
