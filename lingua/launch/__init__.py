"""Starting runs: stool (submitit/Slurm), the planner (memory, FLOPs, days before a run)
and the environment doctor. The top layer: it may import every other."""
