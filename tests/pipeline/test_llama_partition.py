"""Llama stage placement from the model's own block names and costs."""

from __future__ import annotations

import pytest

from nanotron_models import LlamaConfig, llama_block_costs, llama_block_names
from nanotron_parallel.pipeline import PipelineConfigError, stage_block_names


def _stages(config: LlamaConfig, pp: int, seq: int = 256) -> list[list[str]]:
    names, costs = llama_block_names(config), llama_block_costs(config, seq)
    return [stage_block_names(names, costs, pp, r) for r in range(pp)]


@pytest.mark.parametrize("pp", range(1, 9))
def test_every_pp_up_to_the_layer_count_places_every_block_once(pp: int) -> None:
    config = LlamaConfig(
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=8,
        num_attention_heads=4,
        vocab_size=32000,
    )
    stages = _stages(config, pp)
    assert [n for s in stages for n in s] == llama_block_names(config)
    assert stages[0][0] == "embedding"
    assert stages[-1][-3:] == ["final_norm", "lm_head", "loss"]
    assert all(any(n.startswith("decoder.") for n in s) for s in stages)


def test_a_large_vocab_moves_layers_off_the_last_stage() -> None:
    # lm_head (2*s*V*h) costs about as much as 4 decoder layers here.
    config = LlamaConfig(
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=8,
        num_attention_heads=4,
        vocab_size=32000,
    )
    layers = [sum(n.startswith("decoder.") for n in s) for s in _stages(config, 2)]
    assert layers[0] > layers[1] and sum(layers) == 8


def test_pp_beyond_the_layer_count_is_refused() -> None:
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        vocab_size=100,
    )
    with pytest.raises(PipelineConfigError, match=r"pp=4 .* use pp <= 3"):
        _stages(config, 4)
