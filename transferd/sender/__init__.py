"""The prefill-side sender agent: a shell around :mod:`transferd.protocol.sender_core`."""

from .agent import SenderAgent

__all__ = ["SenderAgent"]
