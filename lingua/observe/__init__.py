"""Seeing what a run does: metrics and MFU, profiling, activation/gradient probes, their reports,
run-comparison plots. Reads lingua.model and lingua.parallel; lingua.train's loop calls it."""
