"""Model profiles for planner tests."""

from __future__ import annotations

from planning.planner import MIB


def make_profile(
    n_layer: int = 8, block_mib: float = 200.0, output_mib: float = 300.0, n_kv: int = 8
) -> dict:
    """A llama-like profile with uniform blocks (real models are uniform up to quantisation mixes)."""
    return {
        "architecture": "llama",
        "name": "synthetic",
        "block_count": n_layer,
        "context_length": 8192,
        "embedding_length": 4096,
        "feed_forward_length": 14336,
        "head_count": [32] * n_layer,
        "head_count_kv": [n_kv] * n_layer,
        "key_length": [128] * n_layer,
        "value_length": [128] * n_layer,
        "sliding_window": 0,
        "swa_layers": [False] * n_layer,
        "expert_count": 0,
        "vocab_size": 32000,
        "block_weight_bytes": [int(block_mib * MIB)] * n_layer,
        "output_bytes": int(output_mib * MIB),
        "input_embedding_bytes": int(output_mib * MIB),
        "other_bytes": 0,
        "weights_total_bytes": int((n_layer * block_mib + 2 * output_mib) * MIB),
    }


def make_moe_profile(
    n_layer: int = 8,
    dense_mib: float = 20.0,
    expert_mib: float = 160.0,
    output_mib: float = 50.0,
    experts: tuple[int, int] = (8, 2),
) -> dict:
    """A mixture of experts with uniform blocks: `dense_mib` of attention, router and norms per block and
    `expert_mib` of routed experts, of which a token reads experts[1] / experts[0]."""
    profile = make_profile(n_layer, dense_mib + expert_mib, output_mib)
    profile.update(
        expert_count=experts[0],
        expert_used_count=experts[1],
        block_expert_bytes=[int(expert_mib * MIB)] * n_layer,
        feed_forward_length=1024,
    )
    return profile
