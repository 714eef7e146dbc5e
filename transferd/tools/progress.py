"""A progress bar on a terminal when the ``tools`` extra (tqdm) is installed; nothing otherwise."""

from __future__ import annotations

from typing import Any


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, s: str, refresh: bool = True) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(*, enabled: bool, **kwargs: Any) -> Any:
    """A ``tqdm`` bar (its keyword arguments) when ``enabled`` and tqdm is importable."""
    if not enabled:
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(**kwargs)
