"""Every rank's model runner: the only code that touches the batch's tensors (the KV pool, the step's description,
the attention every layer calls, the compiled decode step, the pool's size)."""
