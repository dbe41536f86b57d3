"""The model's building blocks: attention, feed-forward, norms, RoPE, the decoder shell,
the MoE layer, the loss and weight initialisation. Plain nn.Modules and functions: no
process group, no parallelism (lingua.parallel applies that from outside)."""
