"""Autoconfig: choose the layout and knobs for a memory budget and a cluster, before
anything runs (cluster.py: the machines; step_cost.py: one candidate's memory and time;
search.py: the candidates, the choice and why)."""
