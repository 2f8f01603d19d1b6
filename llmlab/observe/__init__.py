"""Observation: step events and snapshots, recording them, vLLM-style metrics from them."""
