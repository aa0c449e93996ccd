"""Forward+backward throughput of our Llama vs Hugging Face's LlamaForCausalLM on the CPU.

Same weights (converted from the HF model), same batch, same threads, one process. The two are
measured alternately, several repeats; the printed figure is the median of ours / HF tokens/s.
A third model, ours with `model.fused_linear_cross_entropy: false` (the lm_head's full logits,
then the cross-entropy), runs in the same rotation: its line shows what the fused loss gains.

    .venv/bin/python bench/model_vs_hf.py [--threads 1] [--repeats 15] [--iters 1]

Each repeat times `iters` steps of one then of the other, so a busy shared machine slows both
alike; the per-repeat ratios' median is robust to the odd disturbed repeat.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import transformers

from nanotron_models import LlamaConfig, build_llama
from nanotron_models.hf import config_to_hf, hf_state_dict_to_ours
from nanotron_parallel.context import ParallelContext


def bench_config() -> LlamaConfig:
    return LlamaConfig(
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=4096,
        max_position_embeddings=512,
        rope_theta=500000.0,
    )


def _time(step, iters: int) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) for `iters` steps."""
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(iters):
        step()
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--iters", type=int, default=1)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    config = bench_config()
    hf_config = config_to_hf(config)
    hf_config._attn_implementation = "sdpa"  # HF's default on the CPU
    hf = transformers.LlamaForCausalLM(hf_config).float().train()
    pc = ParallelContext()
    ours = build_llama(config, pc, seed=0).train()
    ours.load_state_dict(hf_state_dict_to_ours(hf.state_dict(), config))
    unfused = build_llama(config, pc, seed=0).train()
    unfused.load_state_dict(ours.state_dict())
    unfused.set_fused_loss(False)

    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq + 1))
    input_ids, labels = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    batch = {
        "input_ids": input_ids,
        "label_ids": labels,
        "label_mask": torch.ones_like(labels, dtype=torch.bool),
    }

    def step_of(model):
        def step() -> None:
            model.zero_grad(set_to_none=True)
            model(None, batch).backward()

        return step

    step_ours, step_unfused = step_of(ours), step_of(unfused)

    def step_hf() -> None:
        hf.zero_grad(set_to_none=True)
        logits = hf(input_ids).logits
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()

    # Same loss before timing anything: the comparison is between equal computations.
    step_ours()
    step_unfused()
    step_hf()
    with torch.no_grad():
        loss_ours = float(ours(None, batch))
        assert abs(float(unfused(None, batch)) - loss_ours) <= 1e-5 * abs(loss_ours)
    with torch.no_grad():
        logits = hf(input_ids).logits
    loss_hf = float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()))
    assert abs(loss_ours - loss_hf) <= 1e-5 * abs(loss_hf), (loss_ours, loss_hf)

    tokens = args.iters * args.batch * args.seq
    ratios, cpu_ratios, fused_gains, ours_tps, hf_tps = [], [], [], [], []
    steps = [("ours", step_ours), ("hf", step_hf), ("unfused", step_unfused)]
    for r in range(args.repeats):
        # Rotate which goes first so slow drifts of the machine hit all alike.
        order = steps[r % 3 :] + steps[: r % 3]
        seconds = {name: _time(step, args.iters) for name, step in order}
        ours_tps.append(tokens / seconds["ours"][0])
        hf_tps.append(tokens / seconds["hf"][0])
        ratios.append(ours_tps[-1] / hf_tps[-1])
        cpu_ratios.append(seconds["hf"][1] / seconds["ours"][1])
        fused_gains.append(seconds["unfused"][0] / seconds["ours"][0])
    pc.destroy()
    print(
        f"config: hidden={config.hidden_size} layers={config.num_hidden_layers} "
        f"heads={config.num_attention_heads}/{config.num_key_value_heads} "
        f"vocab={config.vocab_size} batch={args.batch} seq={args.seq} threads={args.threads}"
    )
    print(f"ours tokens/s (median): {statistics.median(ours_tps):.0f}")
    print(f"HF   tokens/s (median): {statistics.median(hf_tps):.0f}")
    print(f"ratios: {' '.join(f'{x:.3f}' for x in ratios)}")
    # CPU time of this process is less disturbed by other jobs on a shared machine.
    print(f"ours / HF by CPU time (median): {statistics.median(cpu_ratios):.3f}")
    print(f"fused / unfused lm_head + loss, ours (median): {statistics.median(fused_gains):.3f}")
    print(f"ours / HF forward+backward tokens/s: {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
