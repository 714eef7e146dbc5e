"""Tools around the daemons: the launcher, the demo, the benchmark, operator commands. Nothing
in the daemons imports them."""
