"""transferd as an SGLang disaggregation transfer backend, through SGLang's own plugin loader.

The entry point ``transferd = "transferd.engines.sglang:register"`` in the ``sglang.srt.plugins``
group makes every SGLang process that runs ``load_plugins()`` (server, engine, scheduler) accept
``--disaggregation-transfer-backend transferd``: :func:`register` adds the name to the CLI's
choices, replaces ``TransferBackend`` with the same enum plus ``TRANSFERD``, and wraps
``get_kv_class`` so that that member returns transferd's classes (every other backend still gets
SGLang's own). No file of SGLang is changed.

This module imports nothing of SGLang at import time; the classes live in ``conn.py``.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

SGLANG_VERSION = "0.5.23"
"""The one SGLang release this backend is built and tested against (its interfaces change often)."""

BACKEND = "transferd"


class UnsupportedSGLang(RuntimeError):
    """The installed SGLang is not the release this backend supports."""


def check_version(installed: str | None = None) -> str:
    """The installed SGLang version, or :class:`UnsupportedSGLang` naming both versions."""
    if installed is None:
        from importlib.metadata import PackageNotFoundError, version

        try:
            installed = version("sglang")
        except PackageNotFoundError:
            raise UnsupportedSGLang(f"transferd's SGLang backend needs sglang {SGLANG_VERSION}, and no sglang is "
                                    f"installed") from None
    if installed != SGLANG_VERSION:
        raise UnsupportedSGLang(f"transferd's SGLang backend supports sglang {SGLANG_VERSION} only, this environment "
                                f"has sglang {installed}: install sglang=={SGLANG_VERSION}, or a transferd release "
                                f"built for {installed}")
    return installed


def _with_transferd(old: Any) -> Any:
    """``TransferBackend`` with every member it has plus ``TRANSFERD`` (an Enum with members cannot be
    subclassed, so this is a new enum of the same name and module)."""
    if "TRANSFERD" in old.__members__:
        return old
    members = {m.name: m.value for m in old}
    members["TRANSFERD"] = BACKEND
    new = Enum(old.__name__, members, module=old.__module__, qualname=old.__qualname__)  # type: ignore[misc]
    new.__doc__ = old.__doc__
    return new


def kv_class(class_type: Any) -> Any:
    """What ``get_kv_class(TransferBackend.TRANSFERD, class_type)`` returns."""
    from sglang.srt.disaggregation.base import KVArgs
    from sglang.srt.disaggregation.common.conn import CommonKVBootstrapServer
    from sglang.srt.disaggregation.utils import KVClassType

    from .conn import TransferdKVManager, TransferdKVReceiver, TransferdKVSender

    return {
        KVClassType.KVARGS: KVArgs,
        KVClassType.MANAGER: TransferdKVManager,
        KVClassType.SENDER: TransferdKVSender,
        KVClassType.RECEIVER: TransferdKVReceiver,
        # the prefill server starts a bootstrap server for every backend; SGLang's own serves its
        # routes (health, rank table) for the router, transferd does not need it
        KVClassType.BOOTSTRAP_SERVER: CommonKVBootstrapServer,
    }.get(class_type)


def _around_get_kv_class(original: Any, transfer_backend: Any, class_type: Any) -> Any:
    if getattr(transfer_backend, "value", transfer_backend) == BACKEND:
        return kv_class(class_type)
    return original(transfer_backend, class_type)


def register() -> None:
    """The ``sglang.srt.plugins`` entry point (SGLang's ``load_plugins()`` calls it)."""
    check_version()
    from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES, add_disagg_transfer_backend_choices
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if BACKEND not in DISAGG_TRANSFER_BACKEND_CHOICES:
        add_disagg_transfer_backend_choices([BACKEND])
    from sglang.srt.disaggregation import utils

    HookRegistry.register("sglang.srt.disaggregation.utils.TransferBackend", _with_transferd(utils.TransferBackend),
                          HookType.REPLACE)
    HookRegistry.register("sglang.srt.disaggregation.utils.get_kv_class", _around_get_kv_class, HookType.AROUND)
