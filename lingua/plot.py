"""The command `python -m lingua.plot`: it runs lingua.observe.plot (see there)."""

from lingua.observe.plot import main

if __name__ == "__main__":
    main()
