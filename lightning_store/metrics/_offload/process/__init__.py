"""``worker="process"``: one worker process, fed through a pipe and shared memory, runs the offloaded updates."""
