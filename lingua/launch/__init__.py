"""Starting runs: the whole run composed (run.py: config schema, checks, hooks, `run`, the CLI
exit), stool (submitit/Slurm), the planner (memory, FLOPs, days before a run) and the
environment doctor. The top layer: it may import every other."""
