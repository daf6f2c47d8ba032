"""Rank 0's engine, no torch: the requests (request.py), the scheduler that owns them and their blocks (scheduler.py,
blocks.py, lookup.py), the output processor that turns their tokens into text and answers (output.py, text.py), the
loop that ties them to an executor (loop.py), and what it reports (stats.py). It hands steps to the runners through
the executor and never imports them."""
