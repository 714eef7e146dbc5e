"""transferd: move KV cache and per-request state from prefill CP ranks to decode workers."""

__version__ = "0.1.0"
