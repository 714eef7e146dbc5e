"""Tools around the daemons: the launcher, the demo, the benchmark, operator commands. Nothing
in the daemons imports them.

``procs`` is the one process harness (the launcher, the bench and the integration tests start and
stop children through it); ``rooms`` the one room record, aux guard writer and byte-exact check
(the demo, the bench and the tests); ``faults`` the one ``--fault`` parser."""
