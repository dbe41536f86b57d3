"""Processes and parallelism: the device mesh and its groups (distributed.py), FSDP2/HSDP
wrapping, tensor/sequence, context, pipeline and expert parallel, and the check that an
app's plans cover its model. Imports lingua.model only."""
