"""Errors for bad user input.

A ConfigError carries a message meant for a person: what was wrong and how to fix it. Entry points
catch it and print the message alone (no traceback), before any process group, checkpoint write
or job submission happens.
"""


class ConfigError(ValueError):
    pass


class RunError(RuntimeError):
    """A run had to stop for a reason outside the code (a full disk, a lost rank, non-finite
    values): the message says what happened, what is safe on disk and how to go on. Entry points
    print it without a traceback and exit 1."""
