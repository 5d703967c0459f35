"""What a target's forward costs: FLOPs per document, for the producer's and the benches' throughput figures."""

from __future__ import annotations


def flops_per_document(config, num_layers: int, length: int, with_lm_head: bool = False) -> float:
    """Forward FLOPs of one document: 2 * (matmul params used) * tokens + token mixing.

    Matmul params per layer: the attention projections (q doubled where a gate rides on it, as in
    Qwen3.5's gated attention) or a Gated-DeltaNet layer's in/out projections, and the gated MLP (a
    mixture-of-experts layer counts the experts a token uses and the shared expert). Norms, the
    convolution and embedding lookups are not matmuls. Token mixing per layer: causal attention,
    QK^T and PV over the L(L+1)/2 visible pairs, ``2 * 2 * L(L+1)/2 * heads * head_dim``; a
    Gated-DeltaNet layer reads and updates its ``[k, v]`` state per token and value head,
    ``4 * k * v`` FLOPs for each, plus the same for its output.
    """
    hidden = config.hidden_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv_heads = config.num_key_value_heads
    layer_types = list(getattr(config, "layer_types", None) or [])[:num_layers]
    gated = getattr(config, "model_type", "") in ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
    q_width = heads * head_dim * (2 if gated else 1)
    attention_params = hidden * (q_width + 2 * kv_heads * head_dim) + heads * head_dim * hidden
    if getattr(config, "num_experts", None):
        ffn = config.num_experts_per_tok * config.moe_intermediate_size + getattr(
            config, "shared_expert_intermediate_size", 0
        )
    else:
        ffn = config.intermediate_size
    mlp_params = 3 * hidden * ffn
    num_linear = sum(t == "linear_attention" for t in layer_types)
    num_full = num_layers - num_linear
    linear_params = linear_mixing = 0.0
    if num_linear:
        key_dim = config.linear_num_key_heads * config.linear_key_head_dim
        value_dim = config.linear_num_value_heads * config.linear_value_head_dim
        linear_params = hidden * (2 * key_dim + 2 * value_dim + 2 * config.linear_num_value_heads) + value_dim * hidden
        linear_mixing = 2 * 4.0 * config.linear_key_head_dim * value_dim * length
    params = (
        num_full * attention_params
        + num_linear * linear_params
        + num_layers * mlp_params
        + (hidden * config.vocab_size if with_lm_head else 0)
    )
    attention = num_full * 2 * length * (length + 1) * heads * head_dim
    return 2.0 * params * length + attention + num_linear * linear_mixing
