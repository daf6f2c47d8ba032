"""Rank 0's decisions: the step loop, the planner and its block pool, speculation's drafts, and what a step's scores
become (tokens, log-probabilities, text, answers). It drives the runner through the steps it sends and never
imports it."""
