"""`autotp serve`'s start-up decisions, each said in one line: the KV cache's size (budget.py) and the form the weights
are held and multiplied in (weight_form.py). The attention backend is chosen from its table
(runner/attention/backends.py), whose entries judge themselves."""
