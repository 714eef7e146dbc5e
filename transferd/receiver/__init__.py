"""The decode-side receiver: a shell around :mod:`transferd.protocol.receiver_core`."""

from .agent import Receiver

__all__ = ["Receiver"]
