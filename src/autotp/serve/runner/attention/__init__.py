"""The attention backends over the paged KV pool: the step's description they share (step.py), one module per backend
(sdpa.py, flex.py, varlen.py), and the table that names them (backends.py)."""
