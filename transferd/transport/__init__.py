"""Sockets and data planes. Nothing here decides anything about a room: the cores in
:mod:`transferd.protocol` decide, and these modules move bytes where they were told."""
