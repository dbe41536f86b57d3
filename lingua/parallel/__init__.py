"""Processes and parallelism: the mesh and its groups, FSDP2/HSDP, tensor/sequence, context,
pipeline and expert parallel, and the plans' coverage check. Imports lingua.model only."""
