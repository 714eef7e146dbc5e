"""The runtime both agents share: the event loop and its tasks, signals and drain, systemd
notify, metrics and counters, garbage-collector and allocator tuning."""
