"""The mixture-of-experts block in one process, by value: against Hugging Face's
Qwen2MoeSparseMoeBlock with the same weights (outputs and gradients), the grouped matmul
against the loop over experts and a dense per-expert reference (also when the router sends
every token to one expert: nothing dropped), the balance losses against a hand computation and
HF's load_balancing_loss_func, their gradient reaching the router, recompute counting a
micro-batch once, the sigmoid_bias router (its bias picks, the scores weigh; the update moves
against the load), and the whole Qwen2-MoE model against transformers (logits, greedy decoding,
the state dict both ways)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from models_helpers import rel_err

from nanotron_models import KVCache, Qwen2Config, build_llama, full_state_dict
from nanotron_models.families import family_of_hf
from nanotron_models.hf import hf_state_dict_to_ours, our_full_state_dict_to_hf
from nanotron_models.hf_qwen2_moe import qwen2_moe_config_to_hf
from nanotron_models.moe import MoEBlock, MoEConfig, begin_moe_step, moe_blocks
from nanotron_models.moe.experts import grouped_mm_runs
from nanotron_parallel.tensor_parallel import TensorParallelLinearMode

H, E, K, I_MOE, I_SHARED = 32, 4, 2, 16, 24


def moe_qwen2(layers=(-1,), **moe) -> Qwen2Config:
    """hidden 32, 4 heads / 2 kv heads, 2 layers; 4 experts of 16, top-2, a shared expert."""
    fields = dict(num_experts=E, top_k=K, moe_intermediate_size=I_MOE,
                  shared_expert_intermediate_size=I_SHARED, enable_shared_expert=True,
                  layers=list(layers), router_aux_loss_coef=0.0)  # fmt: skip
    fields.update(moe)
    return Qwen2Config(
        hidden_size=H, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=97, max_position_embeddings=64,
        _attn_implementation="sdpa", attention_bias=True, moe_config=MoEConfig(**fields),
    )  # fmt: skip


def block(pc, config: Qwen2Config, seed: int = 0) -> MoEBlock:
    """A standalone MoEBlock with random weights (std 0.2: routing far from ties)."""
    b = MoEBlock(config, 0, pc.tp_group, TensorParallelLinearMode.ALL_REDUCE)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in b.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return b


def hf_block(ours: MoEBlock, norm_topk_prob: bool):
    """transformers' Qwen2MoeSparseMoeBlock holding our block's weights."""
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    hc = qwen2_moe_config_to_hf(moe_qwen2(norm_topk_prob=norm_topk_prob))
    hf = Qwen2MoeSparseMoeBlock(hc)
    with torch.no_grad():
        hf.gate.weight.copy_(ours.router.weight)
        hf.experts.gate_up_proj.copy_(ours.experts.gate_up_proj.transpose(1, 2))
        hf.experts.down_proj.copy_(ours.experts.down_proj.transpose(1, 2))
        gate, up = ours.shared_expert.gate_up.weight.chunk(2)
        hf.shared_expert.gate_proj.weight.copy_(gate)
        hf.shared_expert.up_proj.weight.copy_(up)
        hf.shared_expert.down_proj.weight.copy_(ours.shared_expert.down.weight)
        hf.shared_expert_gate.weight.copy_(ours.shared_expert_gate.weight)
    return hf


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_block_equals_transformers_outputs_and_gradients(pc1, norm_topk_prob):
    ours = block(pc1, moe_qwen2(norm_topk_prob=norm_topk_prob))
    theirs = hf_block(ours, norm_topk_prob)
    x = torch.randn(7, 3, H, generator=torch.Generator().manual_seed(1))  # [s, b, h]
    g = torch.randn(7, 3, H, generator=torch.Generator().manual_seed(2))
    xa, xb = x.clone().requires_grad_(), x.transpose(0, 1).contiguous().requires_grad_()
    out_a, out_b = ours(xa), theirs(xb)
    assert rel_err(out_a.detach(), out_b.detach().transpose(0, 1)) < 1e-6
    (out_a * g).sum().backward()
    (out_b * g.transpose(0, 1)).sum().backward()
    assert rel_err(xa.grad, xb.grad.transpose(0, 1)) < 1e-6
    pairs = [
        (ours.router.weight.grad, theirs.gate.weight.grad),
        (ours.experts.gate_up_proj.grad, theirs.experts.gate_up_proj.grad.transpose(1, 2)),
        (ours.experts.down_proj.grad, theirs.experts.down_proj.grad.transpose(1, 2)),
        (ours.shared_expert_gate.weight.grad, theirs.shared_expert_gate.weight.grad),
        (ours.shared_expert.down.weight.grad, theirs.shared_expert.down_proj.weight.grad),
    ]
    for a, b in pairs:
        assert rel_err(a, b) < 1e-6


def dense_reference(b: MoEBlock, x: torch.Tensor) -> torch.Tensor:
    """Every token through each of its top-k experts, one token at a time (no sorting)."""
    flat = x.reshape(-1, H)
    r = b.router(flat)
    out = torch.zeros_like(flat)
    for t in range(flat.shape[0]):
        for slot in range(K):
            e = int(r.topk_idx[t, slot])
            gate, up = (flat[t] @ b.experts.gate_up_proj[e]).chunk(2)
            out[t] += r.topk_weight[t, slot] * ((F.silu(gate) * up) @ b.experts.down_proj[e])
    shared = torch.sigmoid(flat @ b.shared_expert_gate.weight.T) * b.shared_expert(x).reshape(-1, H)
    return (out + shared).view_as(x)


@pytest.mark.parametrize("skewed", [False, True])
def test_grouped_mm_equals_loop_equals_dense_reference(pc1, skewed):
    b = block(pc1, moe_qwen2())
    x = torch.randn(6, 2, H, generator=torch.Generator().manual_seed(3))
    if skewed:  # every token's first choice is expert 0 (a common direction the gate favours)
        direction = torch.randn(H, generator=torch.Generator().manual_seed(4))
        x = x + 3 * direction
        with torch.no_grad():
            b.router.weight[0] = direction
    with torch.no_grad():
        counts = torch.bincount(b.router(x.reshape(-1, H)).topk_idx.flatten(), minlength=E)
        reference = dense_reference(b, x)
        grouped = b(x)
        b.experts.use_grouped_mm = False
        looped = b(x)
    assert grouped_mm_runs(x, b.experts.gate_up_proj, b.experts.down_proj)  # torch 2.13, CPU
    assert int(counts.sum()) == x.shape[0] * x.shape[1] * K  # every (token, slot) routed
    if skewed:
        assert int(counts[0]) == x.shape[0] * x.shape[1]
    assert rel_err(grouped, reference) < 1e-6 and rel_err(looped, reference) < 1e-6


def test_balance_losses_values_gradient_and_stats(pc1):
    from transformers.models.qwen2_moe.modeling_qwen2_moe import load_balancing_loss_func

    aux_coef, z_coef, scale = 0.05, 0.01, 0.25
    config = moe_qwen2(router_aux_loss_coef=aux_coef, router_z_loss_coef=z_coef)
    b = block(pc1, config)
    b.aux_scale = scale
    x = torch.randn(5, 2, H, generator=torch.Generator().manual_seed(5))
    g = torch.randn(5, 2, H, generator=torch.Generator().manual_seed(6))
    (b(x) * g).sum().backward()
    with_scaler = {n: p.grad.clone() for n, p in b.named_parameters()}
    # by hand: E * sum_e (slots routed to e / T) * mean probability of e; mean lse^2
    logits = x.reshape(-1, H) @ b.router.weight.T
    probs = logits.softmax(-1)
    counts = torch.bincount(probs.topk(K).indices.flatten(), minlength=E).float()
    aux = E * (counts / probs.shape[0] * probs.mean(0)).sum()
    z = torch.logsumexp(logits, -1).square().mean()
    hf_aux = load_balancing_loss_func((logits.detach(),), E, K)
    assert abs(float(b.stats.aux_loss) - float(aux.detach())) < 1e-6
    assert abs(float(b.stats.aux_loss) - float(hf_aux)) < 1e-6
    assert abs(float(b.stats.z_loss) - float(z.detach())) < 1e-6
    assert b.stats.load.tolist() == counts.tolist() and b.stats.micro_batches == 1
    # the same gradients as adding scale * (coef * aux + z_coef * z) to the loss by hand
    b.zero_grad()
    b.aux_coef = b.z_coef = 0.0
    explicit = (b(x) * g).sum() + scale * (aux_coef * aux + z_coef * z)
    explicit.backward()
    for name, p in b.named_parameters():
        assert rel_err(with_scaler[name], p.grad) < 1e-6, name


def test_recompute_counts_a_micro_batch_once_and_gives_the_same_gradients(pc1):
    config = moe_qwen2(router_aux_loss_coef=0.1)
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(7))
    batch = {"input_ids": ids, "label_ids": ids, "label_mask": torch.ones(2, 9, dtype=torch.bool)}
    runs = []
    for recompute in (False, True):
        model = build_llama(config, pc1, seed=3)
        model.set_recompute(recompute)
        begin_moe_step(moe_blocks(model), 2)
        for _ in range(2):  # two micro-batches of one step
            model(None, batch).backward()
        runs.append(model)
    (_, plain), (_, again) = moe_blocks(runs[0])[1], moe_blocks(runs[1])[1]
    assert again.stats.micro_batches == plain.stats.micro_batches == 2
    assert torch.equal(again.stats.load, plain.stats.load)
    assert float(plain.stats.load.sum()) == 2 * 18 * K and plain.aux_scale == 0.5
    grads = dict(runs[0].named_parameters())
    for name, p in runs[1].named_parameters():
        assert rel_err(p.grad, grads[name].grad) < 1e-6, name


@pytest.fixture(scope="module")
def hf_moe():
    """A random transformers Qwen2MoeForCausalLM (layer 0 dense, layer 1 sparse), its gate
    weights made large enough that routing is far from ties."""
    import transformers

    config = moe_qwen2(layers=(1,), norm_topk_prob=True)
    torch.manual_seed(0)
    hc = qwen2_moe_config_to_hf(config)
    hc._attn_implementation = "eager"
    model = transformers.Qwen2MoeForCausalLM(hc).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "experts" in name or name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.3)
            elif name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


def test_qwen2_moe_against_transformers_logits_generate_and_back(pc1, hf_moe):
    config = family_of_hf(hf_moe.config).hf.config_from_hf(hf_moe.config)
    assert config.moe_config.moe_layers(2) == [1] and config.moe_config.norm_topk_prob
    hf_sd = {k: v.detach() for k, v in hf_moe.state_dict().items()}
    ours = build_llama(config, pc1)
    ours.load_state_dict(hf_state_dict_to_ours(hf_sd, config), strict=True)
    ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        assert rel_err(ours.logits(ids), hf_moe(ids).logits) < 1e-5
    prompt = ids[:1, :5]
    expected = hf_moe.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8,
                               do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
    cache, tokens = KVCache(), prompt
    step = ours.logits(tokens, kv_cache=cache)
    for _ in range(8):
        nxt = step[:, -1].argmax(-1, keepdim=True)
        tokens = torch.cat((tokens, nxt), dim=1)
        step = ours.logits(nxt, kv_cache=cache)
    assert tokens.tolist() == expected.tolist()
    back = our_full_state_dict_to_hf(full_state_dict(ours), config)
    per_expert = hf_moe.config.num_experts * 3
    assert len(back) == len(hf_sd) - 2 + per_expert  # fused experts written per expert
    assert torch.equal(back["model.layers.1.mlp.experts.3.up_proj.weight"],
                       hf_sd["model.layers.1.mlp.experts.gate_up_proj"][3, I_MOE:])  # fmt: skip
    again = hf_state_dict_to_ours(back, config)  # the per-expert (Hub) layout reads back
    assert all(torch.equal(t, again[n]) for n, t in full_state_dict(ours).items())
    no_shared = dataclasses.replace(config.moe_config, enable_shared_expert=False)
    assert (
        qwen2_moe_config_to_hf(
            dataclasses.replace(config, moe_config=no_shared)
        ).shared_expert_intermediate_size
        == 0
    )


def test_sigmoid_bias_router_steers_the_choice_not_the_weights_and_updates_against_load(pc1):
    from nanotron_models.moe import update_expert_biases

    b = block(pc1, moe_qwen2(router="sigmoid_bias", norm_topk_prob=True))
    b.router.bias_update_rate = 0.01
    x = torch.randn(5, 2, H, generator=torch.Generator().manual_seed(9))
    flat = x.reshape(-1, H)
    with torch.no_grad():
        scores = torch.sigmoid(flat @ b.router.weight.T)
        b.router.expert_bias.copy_(torch.tensor([10.0, 0.0, 0.0, 0.0]))
        r = b.router(flat)
    assert (r.topk_idx[:, 0] == 0).all()  # the bias decides the choice...
    chosen = scores.gather(1, r.topk_idx)
    assert rel_err(r.topk_weight, chosen / chosen.sum(1, keepdim=True)) < 1e-6  # ...not the weights
    with torch.no_grad():
        assert rel_err(b(x), dense_reference(b, x)) < 1e-6
    b(x).sum().backward()  # a training forward: the step's load
    load = b.stats.load.clone()
    assert float(load[0]) == 10 and float(load.sum()) == 10 * K
    update_expert_biases([(0, b)], [None])
    expected = torch.tensor([10.0, 0.0, 0.0, 0.0]) + 0.01 * torch.sign(load.mean() - load)
    assert torch.equal(b.router.expert_bias, expected)


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")  # transformers' init
def test_a_model_without_shared_expert_exports_with_one_of_size_zero(pc1, tmp_path):
    """Hugging Face's Qwen2-MoE always has a shared expert: ours without one is written with
    one of width 0, and transformers computes the same logits from that folder."""
    import transformers
    from safetensors.torch import save_file

    config = moe_qwen2(layers=(1,), enable_shared_expert=False)
    ours = build_llama(config, pc1, seed=2)
    hc = qwen2_moe_config_to_hf(config)
    hc.architectures = ["Qwen2MoeForCausalLM"]
    hc.save_pretrained(tmp_path)
    hf_sd = our_full_state_dict_to_hf(full_state_dict(ours), config)
    save_file(hf_sd, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    assert hf.config.shared_expert_intermediate_size == 0
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        assert rel_err(ours.logits(ids), hf.float().eval()(ids).logits) < 1e-5
