"""``worker="thread"``: one background thread per process runs the offloaded updates, under the caller's state."""
