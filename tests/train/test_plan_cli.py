"""The layout planner's command: every layout the config checks accept, predicted with the one
memory model the check before allocation uses, ranked by tokens/s among those that fit; what
does not fit says what overflows; the calibration fits the achievable FLOP/s to a run's step
time; a user's error is one line and exit status 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from nanotron_train.config import load_config, memory_estimate
from nanotron_train.config.checks import validate
from nanotron_train.plan import memory
from nanotron_train.plan.cli import main
from nanotron_train.plan.devices import DEVICES
from nanotron_train.plan.enumerate import _params_rank, predict, with_overrides

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny-llama-cpu.yaml"


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["--config-file", str(TINY), *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def layouts() -> list[dict]:
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["--config-file", str(TINY), "--world", "4", "--device", "cpu", "--json"]) == 0
    return json.loads(buf.getvalue())["layouts"]


def test_every_layout_is_valid_and_predicted_by_the_check_s_memory_model(layouts):
    assert memory_estimate.estimate is memory.estimate  # one model, not two
    cfg = load_config(TINY)
    seen = set()
    for lay in layouts:
        o = lay["overrides"]
        candidate = validate(with_overrides(cfg, o), "test", 4)
        assert lay["memory_bytes"]["total"] == memory.estimate(candidate).total
        par = candidate.parallelism
        assert par.dp * par.tp * par.pp * par.context_parallel_size == 4
        batch = par.dp * candidate.tokens.micro_batch_size
        assert batch * candidate.tokens.batch_accumulation_per_replica == 8  # the config's
        seen.add((par.tp, par.pp, par.context_parallel_size, par.pp_engine if par.pp > 1 else "-",
                  candidate.optimizer.zero_stage, par.recompute_layer))  # fmt: skip
    engines = {s[3] for s in seen}
    assert engines == {"-", "afab", "1f1b", "interleaved-1f1b", "zb-h1", "zbv"}
    assert {s[4] for s in seen} == {0, 1, 2, 3} and {s[5] for s in seen} == {False, True}
    # tp=4 is refused by the checks (2 kv heads), so it is not listed
    assert {s[0] for s in seen} == {1, 2} and {s[2] for s in seen} == {1, 2, 4}


def test_ranked_by_tokens_per_second_and_parts_add_up(layouts):
    speeds = [lay["tokens_per_s_per_device"] for lay in layouts if lay["fits"]]
    assert speeds == sorted(speeds, reverse=True) and speeds
    for lay in layouts:
        t = lay["step_time_s"]
        parts = t["compute"] + t["exposed_comm"] + t["pipeline_idle"] + t["optimizer"]
        assert t["total"] == pytest.approx(parts, rel=1e-12)
        # 8 sequences of 64 tokens per step over 4 devices
        assert lay["tokens_per_s_per_device"] == pytest.approx(8 * 64 / t["total"] / 4)


def test_table_and_overrides_to_paste(capsys):
    code, out, err = run(capsys, "--world", "2", "--device", "cpu", "--top", "3")
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].startswith("device cpu (placeholder") and " fit, " in lines[0]
    assert lines[1].split()[:4] == ["#", "dp", "tp", "pp"] and len(lines[2:5]) == 3
    flags = lines[lines.index("best layout's overrides:") + 1].split()
    overrides = [flags[i + 1] for i in range(0, len(flags), 2)]
    assert all(f == "--override" for f in flags[::2])
    cfg = load_config(TINY, overrides, world_size=2)  # pastes into a run of 2 ranks
    assert cfg.parallelism.dp * cfg.parallelism.tp * cfg.parallelism.pp == 2


def test_what_does_not_fit_says_what_overflows(tmp_path, capsys):
    small = {k: v for k, v in DEVICES["cpu"].__dict__.items() if k not in ("name", "source")}
    small["memory_bytes"] = 6 * 2**20  # below every layout of the tiny model
    path = tmp_path / "small.yaml"
    path.write_text(yaml.safe_dump(small))
    code, out, _ = run(capsys, "--world", "2", "--device", str(path))
    assert code == 0
    assert ": 0 fit, " in out.splitlines()[0]
    assert (
        "smallest that does not fit: needs " in out
        and "(/ 0.95 margin) of 0.0 GiB (largest part: " in out
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--world", "0"], "error: --world, --gpus-per-node and --top must be >= 1"),
        (["--world", "2", "--device", "tpu9"], "error: --device: 'tpu9' is neither one of"),
        (["--world", "3", "--override", "tokens.micro_batch_size=x"], "error: "),
        (["--world", "2", "--calibrate", "/nonexistent.jsonl"], "error: --calibrate /nonexistent"),
    ],
)
def test_bad_input_is_one_line_and_status_2(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith(message), err


def test_bad_device_file_names_the_key(tmp_path, capsys):
    path = tmp_path / "d.yaml"
    path.write_text("peak_flops: 1.0e12\nwarp_speed: 9\n")
    code, _, err = run(capsys, "--world", "2", "--device", str(path))
    assert code == 2 and err.startswith(f"error: --device {path}: unknown key 'warp_speed'")


def test_calibration_fits_the_run_s_step_time(tmp_path):
    from nanotron_train.plan.calibrate import calibrate

    cfg = load_config(TINY)
    metrics = tmp_path / "metrics.jsonl"
    rows = [{"step": 1, "time_per_iteration_ms": 900.0}]  # start-up: left out
    rows += [
        {"step": s, "time_per_iteration_ms": ms} for s, ms in ((2, 40.0), (3, 50.0), (4, 45.0))
    ]
    metrics.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    fitted = calibrate(DEVICES["cpu"], cfg, str(metrics))
    assert fitted.achievable != DEVICES["cpu"].achievable
    assert predict(cfg, fitted, 1, 1).time.total == pytest.approx(0.045, rel=1e-9)


def test_routed_expert_parameters_match_the_built_experts():
    """The memory model counts each routed expert's matrices as the experts hold them: three
    for gated SwiGLU experts (Qwen2-MoE), two for Nemotron-H's relu2 experts (an E layer)."""
    from nanotron_models.families import family_of
    from nanotron_parallel.context import ParallelContext
    from nanotron_train.config import config_from_dict

    raw = yaml.safe_load((REPO / "configs" / "tiny-hybrid-cpu.yaml").read_text())
    raw["model"]["model_config"].update(
        hybrid_override_pattern="M*-E", n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=48, moe_shared_expert_intermediate_size=32,
    )  # fmt: skip
    mc = config_from_dict(raw).model.model_config
    row = family_of(mc)
    pc = ParallelContext()
    try:
        stage = row.build_stage(mc, pc, row.block_names(mc), seed=1)
        built = sum(p.numel() for n, p in stage.named_parameters() if ".experts." in n)
    finally:
        pc.destroy()
    assert memory._routed_expert_parameters(mc) == built == 4 * 2 * mc.hidden_size * 48


def test_busiest_pp2_rank_sends_and_zero3_gathers_hide_behind_compute(layouts):
    """pp = 2: the busiest rank (both ends) still sends an activation or a gradient per
    micro-batch; ZeRO-3's gathers are prefetched, so only what the compute cannot hide is
    exposed (they were counted twice: in full and again past the compute)."""
    from nanotron_train.plan.step_time import step_time

    cfg = load_config(TINY)
    pp2 = zero3 = 0
    for lay in layouts:
        c = validate(with_overrides(cfg, lay["overrides"]), "test", 4)
        par = c.parallelism
        chunks = 2 if par.pp_engine == "zbv" else max(1, par.pp_virtual_stages)
        if par.pp == 2 and chunks == 1:
            pp2 += 1
            per_mb = c.tokens.micro_batch_size * c.tokens.sequence_length
            per_mb = per_mb // par.context_parallel_size * c.model.model_config.hidden_size * 4
            assert (
                lay["comm_bytes_per_step"]["pp"] == per_mb * c.tokens.batch_accumulation_per_replica
            )
        if c.optimizer.zero_stage == 3 and par.dp * par.context_parallel_size > 1:
            zero3 += 1
            t = step_time(c, DEVICES["cpu"], 4, _params_rank(c))
            hidden = max(0.0, t.comm_by_kind["zero_gather"] - t.compute)
            assert t.exposed_by_kind["zero_gather"] == pytest.approx(hidden, rel=1e-12)
    assert pp2 and zero3
