"""A Qwen2-MoE layer's weights between Hugging Face's names and layout and ours (hf.py calls
these for the sparse layers; hf_qwen2_moe.py says why each is laid out so)."""

from __future__ import annotations

import torch


def moe_mlp_from_hf(take, has, hf: str, ours: str, config) -> dict[str, torch.Tensor]:
    """One sparse layer's HF tensors (`hf` = "model.layers.i") under our names."""
    m = config.moe_config
    out = {f"{ours}.mlp.router.weight": take(f"{hf}.mlp.gate.weight")}
    if has(f"{hf}.mlp.experts.gate_up_proj"):  # fused, as transformers 5 holds them
        gate_up = take(f"{hf}.mlp.experts.gate_up_proj")
        down = take(f"{hf}.mlp.experts.down_proj")
    else:  # per expert, as the Hub stores them
        experts = [f"{hf}.mlp.experts.{j}" for j in range(m.num_experts)]
        gate_up = torch.stack(
            [
                torch.cat((take(f"{e}.gate_proj.weight"), take(f"{e}.up_proj.weight")))
                for e in experts
            ]
        )
        down = torch.stack([take(f"{e}.down_proj.weight") for e in experts])
    out[f"{ours}.mlp.experts.gate_up_proj"] = gate_up.transpose(1, 2).contiguous()
    out[f"{ours}.mlp.experts.down_proj"] = down.transpose(1, 2).contiguous()
    if m.enable_shared_expert:
        shared = [take(f"{hf}.mlp.shared_expert.{p}_proj.weight") for p in ("gate", "up")]
        out[f"{ours}.mlp.shared_expert.gate_up.weight"] = torch.cat(shared)
        out[f"{ours}.mlp.shared_expert.down.weight"] = take(
            f"{hf}.mlp.shared_expert.down_proj.weight"
        )
        out[f"{ours}.mlp.shared_expert_gate.weight"] = take(f"{hf}.mlp.shared_expert_gate.weight")
    return out


def moe_mlp_to_hf(full_sd, hf: str, ours: str, config) -> dict[str, torch.Tensor]:
    """One sparse layer's tensors under HF's per-expert names (the Hub's layout)."""
    m, h = config.moe_config, config.hidden_size
    out = {f"{hf}.mlp.gate.weight": full_sd[f"{ours}.mlp.router.weight"]}
    gate_up = full_sd[f"{ours}.mlp.experts.gate_up_proj"].transpose(1, 2)  # [E, 2I, H]
    down = full_sd[f"{ours}.mlp.experts.down_proj"].transpose(1, 2)  # [E, H, I]
    for j in range(m.num_experts):
        gate, up = gate_up[j].chunk(2, dim=0)
        out[f"{hf}.mlp.experts.{j}.gate_proj.weight"] = gate
        out[f"{hf}.mlp.experts.{j}.up_proj.weight"] = up
        out[f"{hf}.mlp.experts.{j}.down_proj.weight"] = down[j]
    if m.enable_shared_expert:
        gate, up = full_sd[f"{ours}.mlp.shared_expert.gate_up.weight"].chunk(2, dim=0)
        down_shared = full_sd[f"{ours}.mlp.shared_expert.down.weight"]
        gate_w = full_sd[f"{ours}.mlp.shared_expert_gate.weight"]
    else:  # HF always has one: size 0 adds nothing
        gate = up = gate_up.new_zeros(0, h)
        down_shared, gate_w = gate_up.new_zeros(h, 0), gate_up.new_zeros(1, h)
    out[f"{hf}.mlp.shared_expert.gate_proj.weight"] = gate
    out[f"{hf}.mlp.shared_expert.up_proj.weight"] = up
    out[f"{hf}.mlp.shared_expert.down_proj.weight"] = down_shared
    out[f"{hf}.mlp.shared_expert_gate.weight"] = gate_w
    return out
