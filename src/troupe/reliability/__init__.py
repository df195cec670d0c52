"""Surviving faults: non-finite gradient detection (`nonfinite`) and atomic, verified
checkpoints (`checkpoint`). The watchdog that names dead or stalled peers is part of the
runtime (`troupe.runtime.watchdog`), since every collective waits under it."""
