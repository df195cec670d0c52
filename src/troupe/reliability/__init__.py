"""Surviving faults: the watchdog (heartbeats, stall and failure reports), non-finite
gradient detection (`nonfinite`) and atomic, verified checkpoints (`checkpoint`)."""
