"""Pipeline parallelism: stages of tensor-parallel ranks, each holding a run of the decoder layers, that hand each step
and its hidden states on to the next stage (links.py), rank 0's executor and every other rank's loop over them
(executor.py), and the liveness every rank of a pipeline keeps across hosts (liveness.py)."""
