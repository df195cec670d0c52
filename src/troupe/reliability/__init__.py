"""Surviving faults: non-finite gradient detection (`nonfinite`) and atomic, verified
checkpoints (`checkpoint`: save, also in the background, and the public API; behind it
`manifest`, `restore`, `background`, `state`, `dcp_files`). The watchdog that names dead or
stalled peers is part of the runtime (`troupe.runtime.watchdog`), since every collective
waits under it."""
