"""Seeing what a run does: metrics and MFU, profiling windows, activation/gradient probes,
their reports and run-comparison plots. Reads lingua.model and lingua.parallel; the
loop in lingua.train calls it."""
