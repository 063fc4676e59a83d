"""Placement simulator: Tessera's planner and router against Petals and Parallax.

Modules: gpus (card table), models (Llama 2 shapes), regions (RTTs and access lines),
churn (session-length traces), swarm (nodes + the performance model), serving (admission,
latency, tokens/s), upper_bound, tessera / petals_greedy / parallax (the systems),
scenarios, evaluate, report. `bench/placement.py` is the command that runs it all.
"""
