"""Errors for bad user input.

A ConfigError carries a message meant for a person: what was wrong and how to fix it. Entry points
catch it and print the message alone (no traceback), before any process group, checkpoint write
or job submission happens.
"""


class ConfigError(ValueError):
    pass
