"""The model's building blocks (attention, FFN, norms, RoPE, decoder shell, MoE, loss, weight
init): plain nn.Modules and functions, no process groups (lingua.parallel works from outside)."""
