"""Every rank's model runner: the only code that touches the step's tensors (the KV pool, the step's description and
the attention backends every layer calls, the compiled decode step) and, on the rank that samples, the code that
turns scores into token ids. It runs the steps it is given and never imports the engine."""
