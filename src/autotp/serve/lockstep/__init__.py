"""Between the engine and the ranks: the messages (step.py), the one broadcast per step (wire.py), rank 0's executor
and the other ranks' loop (executor.py), and the watchdog that finds a step that failed on some ranks only."""
