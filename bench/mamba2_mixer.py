"""The Mamba-2 mixer against an attention layer of the same width, and a hybrid's decoding
state against a Llama's KV cache.

1. Forward + backward time and peak memory of one layer (fp32, micro-batch 1, the PyTorch
   paths: the CPU) at sequence lengths 512..8192, as Mamba-2 / attention ratios in one run:
   the Mamba-2 mixer (expand 2, heads of 64, state 128, one group, chunk 256) and a causal
   GQA attention layer (q/k/v/o, PyTorch's scaled_dot_product_attention, 8 heads, 2 kv
   heads). Time: the process's CPU time of one forward + backward (one thread: what the work
   costs, not how long a loaded machine made it wait), the least of `--repeats` after a
   warm-up. Memory: the peak of the live tensors' bytes (bench/cp_memory.py's LiveBytes;
   weights excluded, their gradients included), in a separate pass.
2. Decoding memory: the bytes a decoding state holds after n tokens (one sequence), measured
   on built models through their family row (`new_decode_state`, the stage's `logits`): a
   hybrid in Nemotron-H's proportions (one `*` layer in six, the rest `M` and `-`) and a Llama
   with the same width, depth and attention heads. The hybrid holds a fixed conv + SSM state
   per `M` layer and a KV cache for its `*` layers only; the Llama a KV cache per layer. The
   slope (bytes per token) and the fixed part are read from two lengths; then the same counts
   at Nemotron-H-8B's and Llama-3.1-8B's published shapes by the same per-layer sizes.

Context-parallel bytes per Mamba-2 layer against the formula: bench/mamba2_cp_bytes.py.

    .venv/bin/python bench/mamba2_mixer.py [--seqs 512 1024 2048 4096 8192] [--hidden 512]
        [--repeats 2] [--threads 1]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from cp_memory import LiveBytes  # bench/ is the script's folder, so on sys.path
from torch import nn

from nanotron_models.config import LlamaConfig
from nanotron_models.families import family
from nanotron_models.mamba2_hybrid.config import Mamba2HybridConfig
from nanotron_models.mixers import Mamba2Dims, Mamba2Mixer
from nanotron_parallel.context import ParallelContext

MIB = 2**20


class Attention(nn.Module):
    """A causal GQA attention layer: the layer a Mamba-2 layer replaces."""

    def __init__(self, hidden: int, heads: int = 8, kv_heads: int = 2) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.dim = heads, kv_heads, hidden // heads
        self.qkv = nn.Linear(hidden, (heads + 2 * kv_heads) * self.dim, bias=False)
        self.o_proj = nn.Linear(heads * self.dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).split([self.heads * self.dim, *(2 * [self.kv_heads * self.dim])], -1)
        q, k, v = (t.view(b, s, -1, self.dim).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).flatten(2))


def measure(layer: nn.Module, seq: int, hidden: int, repeats: int) -> tuple[float, int]:
    """(least CPU seconds of a forward + backward, peak live bytes)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, seq, hidden, generator=g).requires_grad_()
    grad = torch.randn(1, seq, hidden, generator=g)
    layer(x).backward(grad)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        layer(x).backward(grad)
        best = min(best, time.process_time() - start)
    layer.zero_grad(set_to_none=True)
    x.grad = None
    with LiveBytes(x, grad) as tracker:
        layer(x).backward(grad)
        tracker._update()
    layer.zero_grad(set_to_none=True)
    return best, tracker.peak


def compare(seqs: list[int], hidden: int, repeats: int) -> None:
    attention = Attention(hidden)
    mamba = Mamba2Mixer(Mamba2Dims(hidden, 2 * hidden // 64, 64, 1, 128))
    print(f"hidden {hidden}, fp32, micro-batch 1, {torch.get_num_threads()} thread(s)")
    print("seq    | fwd+bwd CPU s: attention  Mamba-2  Mamba-2/attn | peak MiB: attention  "
          "Mamba-2  Mamba-2/attn")  # fmt: skip
    for seq in seqs:
        ta, ma = measure(attention, seq, hidden, repeats)
        tm, mm = measure(mamba, seq, hidden, repeats)
        print(f"{seq:6d} | {ta:23.3f} {tm:8.3f} {tm / ta:13.2f} | {ma / MIB:18.1f} "
              f"{mm / MIB:8.1f} {mm / ma:13.2f}", flush=True)  # fmt: skip


# ---- decoding state ----------------------------------------------------------------------------


def nemotron_pattern(layers: int) -> str:
    """Nemotron-H's proportions: every sixth layer attention, the others alternating M and -."""
    return "".join("*" if i % 6 == 5 else "M-"[i % 2] for i in range(layers))


def hybrid_config(hidden: int, layers: int, heads: int, kv_heads: int) -> Mamba2HybridConfig:
    return Mamba2HybridConfig(
        hybrid_override_pattern=nemotron_pattern(layers), num_hidden_layers=layers,
        vocab_size=256, hidden_size=hidden, num_heads=2 * hidden // 64, head_dim=64, n_groups=8,
        state_size=128, chunk_size=128, num_attention_heads=heads, num_key_value_heads=kv_heads,
        attention_head_dim=hidden // heads, intermediate_size=4 * hidden,
        max_position_embeddings=8192,
    )  # fmt: skip


def llama_config(hidden: int, layers: int, heads: int, kv_heads: int) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, intermediate_size=4 * hidden, vocab_size=256,
        max_position_embeddings=8192,
    )  # fmt: skip


def state_bytes(name: str, config, tokens: int, pc) -> int:
    """Bytes of the decoding state after a prompt of `tokens` tokens (one sequence)."""
    row = family(name)
    stage = row.build_stage(config, pc, row.block_names(config), seed=1).eval()
    state = row.new_decode_state(config)
    stage.logits(torch.randint(0, 256, (1, tokens)), None, state)
    if name == "mamba2":
        return state.nbytes()  # conv + SSM per M layer, keys and values per * layer
    return sum(t.nbytes for d in (state.keys, state.values) for t in d.values())


def decoding(hidden: int, layers: int, heads: int, kv_heads: int) -> None:
    pc = ParallelContext()
    models = {"mamba2": hybrid_config(hidden, layers, heads, kv_heads),
              "llama": llama_config(hidden, layers, heads, kv_heads)}  # fmt: skip
    print(f"\ndecoding state, one sequence, fp32: hidden {hidden}, {layers} layers, {heads} heads "
          f"({kv_heads} kv); hybrid pattern {models['mamba2'].pattern}")  # fmt: skip
    print("model  | bytes at 64 tokens | at 576 tokens | bytes per token | fixed bytes")
    slopes = {}
    for name, config in models.items():
        small, large = (state_bytes(name, config, n, pc) for n in (64, 576))
        slope = (large - small) / 512
        slopes[name] = (slope, small - 64 * slope)
        print(
            f"{name:6s} | {small:18,} | {large:13,} | {slope:15,.0f} | {small - 64 * slope:11,.0f}"
        )
    (sh, fh), (sl, _) = slopes["mamba2"], slopes["llama"]
    print(
        f"per token: hybrid / llama = {sh / sl:.3f}; the hybrid holds less from "
        f"{fh / (sl - sh):,.0f} tokens on"
    )
    pc.destroy()


def published_sizes() -> None:
    """The same per-layer counts at published shapes (bf16 conv state and cache, the SSM state
    in fp32 as the scan keeps it; one sequence)."""
    # Nemotron-H-8B: hidden 4096, 52 layers of which 4 attention (8 kv heads of 128), 24 Mamba-2
    # (128 heads of 64, 8 groups, state 128, conv 4); Llama-3.1-8B: 32 layers, 8 kv heads of 128.
    m_layers, a_layers, e = 24, 4, 2
    conv = (2 * 4096 + 2 * 8 * 128) * 3  # conv_dim x (K - 1)
    ssm = 128 * 64 * 128
    fixed = m_layers * (conv * e + ssm * 4)
    hybrid_token = a_layers * 2 * 8 * 128 * e
    llama_token = 32 * 2 * 8 * 128 * e
    print("\npublished shapes, bf16 (SSM state fp32), one sequence: Nemotron-H-8B state "
          f"{fixed / MIB:.1f} MiB fixed + {hybrid_token:,} bytes/token; Llama-3.1-8B KV cache "
          f"{llama_token:,} bytes/token (x{llama_token / hybrid_token:.0f}); at 8k tokens "
          f"{(fixed + 8192 * hybrid_token) / MIB:.0f} MiB against "
          f"{8192 * llama_token / MIB:.0f} MiB")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    compare(args.seqs, args.hidden, args.repeats)
    decoding(hidden=256, layers=12, heads=8, kv_heads=2)
    published_sizes()


if __name__ == "__main__":
    main()
