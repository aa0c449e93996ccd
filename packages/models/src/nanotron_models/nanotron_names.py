"""Llama's and Qwen2's parameter names in Nanotron's module tree (its LlamaForTraining and
Qwen2 models, Qwen2-MoE included): our name -> Nanotron's. The family rows carry them
(`ModelFamily.nanotron_names`); nanotron_train.interop.nanotron_names maps with them."""

from __future__ import annotations

# Inside a layer: `decoder.{i}.<ours>` <-> `model.decoder.{i}.pp_block.<theirs>`
LLAMA_NANOTRON_LAYER_NAMES = {
    "input_norm.weight": "input_layernorm.weight",
    "post_attn_norm.weight": "post_attention_layernorm.weight",
    "attn.qkv.weight": "attn.qkv_proj.weight",
    "attn.qkv.bias": "attn.qkv_proj.bias",
    "attn.o_proj.weight": "attn.o_proj.weight",
    "attn.o_proj.bias": "attn.o_proj.bias",
    "mlp.gate_up.weight": "mlp.gate_up_proj.weight",
    "mlp.down.weight": "mlp.down_proj.weight",
    # A Qwen2 MoE layer (Nanotron's nn/moe.py): the experts stacked the same way, [E, H, 2I]
    "mlp.router.weight": "mlp.router.weight",
    "mlp.experts.gate_up_proj": "mlp.experts.merged_gate_up_proj",
    "mlp.experts.down_proj": "mlp.experts.merged_down_proj",
    "mlp.shared_expert.gate_up.weight": "mlp.shared_expert.gate_up_proj.weight",
    "mlp.shared_expert.down.weight": "mlp.shared_expert.down_proj.weight",
    "mlp.shared_expert_gate.weight": "mlp.shared_expert_gate.weight",
}
LLAMA_NANOTRON_TOP_NAMES = {
    "embedding.weight": "model.token_position_embeddings.pp_block.token_embedding.weight",
    "final_norm.weight": "model.final_layer_norm.pp_block.weight",
    "lm_head.weight": "model.lm_head.pp_block.weight",
}
