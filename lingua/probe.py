"""The command `python -m lingua.probe plot <dump_dir>`: it runs lingua.observe.probe_report."""

import sys

from lingua.observe.probe_report import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m lingua.probe"))
