"""Capture and replay of the decode steps: keys and stats, the graph policy, the fingerprint, hooks, the runner."""
