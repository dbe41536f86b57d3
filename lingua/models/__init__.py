"""Architectures that several apps train unchanged, kept once (apps/llama and apps/sft both train
models/llama). A fork that changes an architecture copies it into its own app folder instead
(docs/forking.md, "Forking an app")."""
