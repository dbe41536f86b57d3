"""The planner's view of apps/qwen3_next: its FLOPs per token against a hand count and against
the matmuls torch's FLOP counter sees in the chunked delta rule, and the activation rule of its
two kinds of block (lingua/launch/plan_activations.py, for the shapes App.block_shape declares
by layer) against the tensors real blocks keep on CPU, as tests/test_plan.py checks lingua's."""

import pytest
import torch

from apps.qwen3_next.model import CHUNK, Qwen3NextArgs, Transformer, chunk_gated_delta_rule
from apps.qwen3_next.train import APP, TrainArgs
from lingua.config import from_dict
from lingua.launch.plan_activations import block_activation_bytes
from lingua.parallel.distributed import apply_ac
from tests.test_plan import per_layer_bytes_per_token

# 2 key heads of 16 serve 4 value heads of 24 (repeated twice, as the published 16 : 32)
SHAPE = dict(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, linear_key_heads=2,
             linear_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=24,
             vocab_size=512, max_seq_len=256, n_experts=8, top_k=2, expert_hidden_dim=64,
             shared_expert_hidden_dim=64)


def test_flops_per_token_is_the_hand_count():
    args = TrainArgs(model=from_dict(Qwen3NextArgs, SHAPE))
    args.data.seq_len = 256
    h, s, c = 128, 256, CHUNK
    # A full-attention layer's matmuls: q_proj h x (4 x 32 x 2, the gate), k and v h x 64 each,
    # o_proj 128 x h; its QK^T and AV: 2 x 2 x 4 heads x 32 x s a token.
    full = h * 256 + 2 * h * 64 + 128 * h
    attention = 4 * 4 * 32 * s
    # A Gated DeltaNet layer's: q, k h x 32; v, z h x 96; b, a h x 4; out_proj 96 x h. Its
    # convolutions: 2 x 4 taps over 32 + 32 + 96 channels. Its delta rule per value head (4) and
    # chunk: k.k^T, q.k^T 2 x 2 c^2 16; the solves c^2 (16 + 24); scores x u 2 c^2 24; the
    # state's two reads and its update 3 x 2 c 16 x 24.
    linear = 2 * h * 32 + 2 * h * 96 + 2 * h * 4 + 96 * h
    conv = 2 * 4 * (32 + 32 + 96)
    rule = 4 * (4 * c * c * 16 + c * c * (16 + 24) + 2 * c * c * 24 + 6 * c * 16 * 24) / c
    # Every layer's MoE: the router 8 x h, top-2 of 8 experts of 3 x h x 64, the shared expert
    # 3 x h x 64 and its gate h; the output projection 512 x h (the embedding is a lookup).
    moe = 8 * h + 2 * 3 * h * 64 + 3 * h * 64 + h
    forward = (2 * (full + 3 * linear + 4 * moe + 512 * h) + attention + 3 * (conv + rule))
    assert APP.flops_per_token(args) == pytest.approx(3 * forward, rel=1e-12)


def test_the_delta_rule_flops_are_the_chunked_forms_matmuls_and_solves():
    """The rule's term against torch's FLOP counter over model.chunk_gated_delta_rule's forward
    (its matmuls; the counter has no rule for triangular solves: c^2 a right-hand column)."""
    from torch.utils.flop_counter import FlopCounterMode

    b, s, hk, hv, dk, dv, c = 1, 2 * CHUNK, 1, 2, 16, 8, CHUNK
    q, k = torch.randn(b, s, hk, dk), torch.randn(b, s, hk, dk)
    v, g, beta = torch.randn(b, s, hv, dv), -torch.rand(b, s, hv), torch.rand(b, s, hv)
    with FlopCounterMode(display=False) as counter:
        chunk_gated_delta_rule(q, k, v, g, beta)
    solves = b * hv * (s // c) * c * c * (dk + dv)
    per_token = hv * (6 * dk * dv + c * (5 * dk + 3 * dv))   # apps/qwen3_next/train.py's
    assert counter.get_total_flops() + solves == b * s * per_token


def small_model(dtype, full: bool):
    """SHAPE with every block full attention (full_attention_every 1) or none (every 100)."""
    args = from_dict(Qwen3NextArgs, dict(SHAPE, full_attention_every=1 if full else 100))
    torch.manual_seed(0)
    model = Transformer(args).to(dtype)
    model.rope_cos, model.rope_sin = model.rope_cos.float(), model.rope_sin.float()
    return model, args


@pytest.mark.parametrize("kind,dtype,ac", [
    ("linear", "fp32", "none"), ("linear", "bf16", "none"), ("linear", "bf16", "op"),
    ("linear", "fp32", "full"), ("full", "fp32", "none"), ("full", "bf16", "none"),
    ("full", "bf16", "op")])
def test_activation_formula_matches_what_qwen3_next_blocks_keep(kind, dtype, ac):
    """The Gated DeltaNet's chunked rule keeps fp32 C x C matrices and a state per chunk; 4
    chunks a sequence here (the first chunk's two state operands, which it skips reading a zero
    state, are the rule's 0.5% over)."""
    torch_dtype = torch.float32 if dtype == "fp32" else torch.bfloat16
    model, args = small_model(torch_dtype, kind == "full")
    apply_ac(model.layers, ac)
    tokens = (2, 256)
    x = torch.randn(*tokens, args.dim, dtype=torch_dtype, requires_grad=True)
    measured = per_layer_bytes_per_token(model, x, tokens)
    shapes = APP.block_shape(args)
    assert bool(shapes[3].linear_value_heads) == (kind == "linear")
    predicted = block_activation_bytes(shapes[3], True, ac, 4 if dtype == "fp32" else 2,
                                       grouped_kv=True)
    assert measured == pytest.approx(predicted, rel=0.01, abs=1.0)


def test_block_shapes_follow_the_layer_pattern():
    shapes = APP.block_shape(from_dict(Qwen3NextArgs, dict(SHAPE, n_layers=8)))
    assert [bool(shapes[i].linear_value_heads) for i in range(8)] == [True, True, True, False] * 2
    assert all(s.gated and s.experts == 8 and s.shared_experts == 1 for s in shapes.values())
