"""The command `python -m lingua.plan`: it runs lingua.launch.plan (see there)."""

import sys

from lingua.launch.plan import main

if __name__ == "__main__":
    sys.exit(main())
