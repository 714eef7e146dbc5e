"""Adapters that let a serving engine drive transferd: each engine's own transfer-backend interface
implemented over transferd's client API (``transferd.client``) and pools (``transferd.pool``).

* ``sglang`` — SGLang 0.5.23's disaggregation transfer backend, selected with
  ``--disaggregation-transfer-backend transferd`` through SGLang's plugin loader (docs/ENGINES.md).
"""
