"""Between the ranks: the one message per step rank 0 broadcasts, and the watchdog that finds a step that failed on
some ranks only."""
