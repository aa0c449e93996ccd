"""Real tensor parallelism (gloo processes on the CPU), in one launch of 4 ranks:

- tp=4 and tp=2: the same seed gives bitwise the same full weights as tp=1;
- dp=2 x tp=2: replica 0 runs ALL_REDUCE, replica 1 REDUCE_SCATTER; each checks logits, loss
  and every gradient against Hugging Face (tied and untied), KV-cache decoding against a full
  forward, and greedy decoding against `generate`.
"""

from __future__ import annotations

import torch
from models_helpers import hf_model, hf_reference, rel_err, tiny_config

from nanotron_models import KVCache, build_llama, full_state_dict
from nanotron_models.hf import hf_state_dict_to_ours, our_full_state_dict_to_hf
from nanotron_parallel.testing import run_distributed
from nanotron_train.inference.decoding import generate

INIT_SEED = 123
PROMPT, NEW_TOKENS = 5, 6


def _init_config():
    # 4 kv heads so that tp=4 is allowed; vocab 101 is padded differently for tp 1, 2 and 4.
    return tiny_config(True, num_attention_heads=8, num_key_value_heads=4)


def _tp_worker(cases: dict) -> dict:
    from nanotron_parallel.context import ParallelContext

    torch.set_num_threads(1)
    out: dict = {}
    pc4 = ParallelContext(tp=4)
    full4 = full_state_dict(build_llama(_init_config(), pc4, seed=INIT_SEED))
    pc = ParallelContext(dp=2, tp=2)
    full2 = full_state_dict(build_llama(_init_config(), pc, seed=INIT_SEED))
    if pc.rank == 0:
        out["init"] = {"tp4": full4, "tp2": full2}
    mode = ("ALL_REDUCE", "REDUCE_SCATTER")[pc.dp_rank]
    out["mode"] = mode
    for tie, case in cases.items():
        config, batch = tiny_config(tie), case["batch"]
        model = build_llama(config, pc, tp_mode=mode, seed=0)
        model.load_state_dict(hf_state_dict_to_ours(case["hf_sd"], config, pc.tp_rank, 2))
        logits = model.logits(batch["input_ids"])
        loss = model(None, batch)
        loss.backward()
        grads = our_full_state_dict_to_hf(full_state_dict(model, grads=True), config)
        ids = batch["input_ids"]
        cache = KVCache()
        steps = [model.logits(ids[:, :PROMPT], kv_cache=cache)]
        steps += [model.logits(ids[:, i : i + 1], kv_cache=cache) for i in range(PROMPT, 8)]
        steps.append(model.logits(ids[:, 8:], kv_cache=cache))
        cached_err = rel_err(torch.cat(steps, dim=1), logits)
        prompt = ids[:, :PROMPT]
        new = generate(model, prompt.tolist(), NEW_TOKENS).tokens  # greedy
        tokens = torch.cat((prompt, torch.tensor(new)), dim=1)
        out[tie] = {
            "logits": logits,
            "loss": loss.detach(),
            "grads": grads,
            "cached_err": cached_err,
            "tokens": tokens,
        }
    return out


def test_tp_layouts_match_hf_and_init_is_topology_independent(pc1):
    cases, expected_tokens = {}, {}
    for tie in (False, True):
        ref = hf_reference(tiny_config(tie), seed=tie)
        cases[tie] = {"hf_sd": ref["hf_sd"], "batch": ref["batch"]}
        prompt = ref["batch"]["input_ids"][:, :PROMPT]
        expected_tokens[tie] = hf_model(tiny_config(tie), seed=tie).generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        cases[tie]["ref"] = ref
    refs = {tie: cases[tie].pop("ref") for tie in cases}

    results = run_distributed(_tp_worker, 4, cases, timeout=240)

    full1 = full_state_dict(build_llama(_init_config(), pc1, seed=INIT_SEED))
    for name in ("tp4", "tp2"):
        other = results[0]["init"][name]
        assert set(other) == set(full1)
        for key, tensor in full1.items():
            assert torch.equal(other[key], tensor), f"{name} {key}"
    assert sorted(r["mode"] for r in results) == ["ALL_REDUCE"] * 2 + ["REDUCE_SCATTER"] * 2
    for rank, res in enumerate(results):
        for tie, ref in refs.items():
            got, where = res[tie], f"rank {rank} {res['mode']} tie={tie}"
            assert rel_err(got["logits"], ref["logits"]) < 1e-5, where
            assert rel_err(got["loss"], ref["loss"]) < 1e-5, where
            assert set(got["grads"]) == set(ref["grads"])
            for key, grad in ref["grads"].items():
                assert rel_err(got["grads"][key], grad) < 1e-5, f"{where} {key}"
            assert got["cached_err"] < 1e-5, where
            assert torch.equal(got["tokens"], expected_tokens[tie]), where
