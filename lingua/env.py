"""The command `python -m lingua.env`: it runs lingua.launch.env (see there)."""

from lingua.launch.env import main

if __name__ == "__main__":
    main()
