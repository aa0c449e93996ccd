"""Telemetry pieces with values: config refusals, the throughput rule, the bubble
formula, the client's bounded telemetry queue, and losses bitwise unchanged by telemetry."""

from __future__ import annotations

import copy
import io
import json

import pytest
import torch

from nanotron_parallel.testing import run_distributed, shared_default_group
from nanotron_train.config import ConfigError, config_from_dict
from nanotron_train.reporting.dashboard_client import DashboardClient
from nanotron_train.telemetry.clock import offset_bounds, rebase, to_rank0_clock
from nanotron_train.telemetry.events import ThroughputWatch
from nanotron_train.telemetry.samples import MAX_SAMPLES_JSON_BYTES, fit_samples
from nanotron_train.telemetry.timeline import (
    bubble_formula,
    bubble_measured,
    order_violations,
    timeline_message,
)
from tests.train.test_checkpoint import tiny_config

ONE = {"dp": 1, "tp": 1, "pp": 1}


def raw_config(layout=ONE, **sections) -> dict:
    raw = tiny_config(layout, None, steps=4)
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    return raw


@pytest.mark.parametrize(
    ("sections", "key", "message"),
    [
        ({"logging": {"rank_stats_interval": -1}}, "logging.rank_stats_interval", "must be >= 0"),
        ({"logging": {"pipeline_timeline_interval": -2}}, "logging.pipeline_timeline_interval",
         "must be >= 0"),
        ({"logging": {"straggler_margin": 0}}, "logging.straggler_margin", "must be > 0"),
        ({"logging": {"straggler_intervals": 0}}, "logging.straggler_intervals", "must be >= 1"),
        ({"logging": {"throughput_drop_fraction": 1.5}}, "logging.throughput_drop_fraction",
         "must be in (0, 1)"),
        ({"logging": {"sample_max_new_tokens": 0}}, "logging.sample_max_new_tokens",
         "must be in [1, 4096]"),
        ({"logging": {"sample_prompts": ["a"]}}, "logging.sample_prompts",
         "needs tokenizer.tokenizer_name_or_path"),
        ({"logging": {"sample_prompts": [""]}}, "logging.sample_prompts.0", "1 to 4000 characters"),
        ({"logging": {"sample_prompts": ["a"] * 65}}, "logging.sample_prompts", "at most 64"),
        ({"logging": {"sample_prompts": ["\u00e9" * 4000] * 64}}, "logging.sample_prompts",
         "over the 262144-byte limit"),
        ({"logging": {"sample_prompts": "abc"}}, "logging.sample_prompts", "expected a list"),
        ({"logging": {"sample_prompts": ["a"]}, "tokenizer": {"tokenizer_name_or_path": "t"}},
         "logging.sample_prompts", "samples are made at each checkpoint"),
        ({"fault_tolerance": {"grad_norm_spike_window": 3}},
         "fault_tolerance.grad_norm_spike_window", "must be 0 (off) or >= 8"),
        ({"fault_tolerance": {"grad_norm_spike_zscore": 0}},
         "fault_tolerance.grad_norm_spike_zscore", "must be > 0"),
    ],
)  # fmt: skip
def test_bad_telemetry_keys_are_refused_in_one_line(sections, key, message):
    with pytest.raises(ConfigError) as err:
        config_from_dict(raw_config(**sections), "cfg.yaml")
    text = str(err.value)
    assert text.startswith(f"cfg.yaml: {key}: ") and message in text and "\n" not in text


@pytest.mark.parametrize(
    ("parallelism", "zero_stage"),
    [
        ({"pp": 2}, 0),
        ({"pp": 2, "pp_engine": "interleaved-1f1b", "pp_virtual_stages": 2}, 0),
        ({"context_parallel_size": 2}, 0),
        ({"dp": 2}, 3),
    ],
)
def test_samples_are_accepted_with_every_layout(parallelism, zero_stage):
    raw = raw_config(
        logging={"sample_prompts": ["x"]},
        tokenizer={"tokenizer_name_or_path": "tok"},
        checkpoints={"checkpoints_path": "ck", "checkpoint_interval": 2},
    )
    raw["parallelism"].update(parallelism)
    raw["model"]["model_config"]["num_hidden_layers"] = 4  # 4 virtual stages
    raw["optimizer"]["zero_stage"] = zero_stage
    # decoding is pipelined / runs with cp off / runs on gathered ZeRO-3 parameters
    cfg = config_from_dict(raw, "cfg.yaml")
    assert cfg.logging.sample_prompts == ["x"] and cfg.optimizer.zero_stage == zero_stage
    assert all(getattr(cfg.parallelism, k) == v for k, v in parallelism.items())


def test_samples_of_the_largest_allowed_size_fit_one_dashboard_message():
    from nanotron_dashboard.messages import parse_messages

    # the largest prompts the config allows (256 KiB as JSON) and long non-ASCII completions
    prompts = ["\u00e9" * 680] * 64
    full = ["\u20ac" * 16_000, "ab" * 9000] + ["x\u20acy" * 3000] * 62
    samples = fit_samples([{"prompt": p, "completion": c} for p, c in zip(prompts, full)])
    size = len(json.dumps(samples))
    assert 0.9 * MAX_SAMPLES_JSON_BYTES < size <= MAX_SAMPLES_JSON_BYTES
    for s, p, c in zip(samples, prompts, full):
        assert s["prompt"] == p and c.startswith(s["completion"]) and s["completion"]
    msg = {"type": "samples", "run_id": "r", "step": 2, "time": 1.0, "max_new_tokens": 4096,
           "samples": samples}  # fmt: skip
    (parsed,) = parse_messages(json.dumps(msg))
    assert [s.completion for s in parsed.samples] == [s["completion"] for s in samples]
    # a short list is left as it is
    small = [{"prompt": "p", "completion": "c" * 100}]
    assert fit_samples(small) == small


def test_throughput_drop_against_the_running_median():
    watch = ThroughputWatch(0.5)
    for v in (100, 110, 90, 105, 95):
        assert watch.observe(v) is None
    assert watch.observe(40) == (40, 100)
    assert watch.observe(30) is None  # the same drop
    assert watch.observe(100) is None
    assert watch.observe(45) == (45, 100)  # a new drop; the low values never entered


def test_bubble_formula_and_measure():
    assert bubble_formula(4, 1, 8) == pytest.approx(3 / 11)
    assert bubble_formula(4, 2, 8) == pytest.approx(3 / 19)
    # the zero-bubble engines' plans: B and W a slot each; zbv in half-stage slots
    assert bubble_formula(4, 1, 8, "zb-h1") == pytest.approx(3 / 27)
    assert bubble_formula(4, 2, 8, "zbv") == pytest.approx(3 / 51)
    spans = [
        {"stage": 0, "start_ms": 0.0, "end_ms": 2.0},
        {"stage": 0, "start_ms": 3.0, "end_ms": 4.0},
        {"stage": 1, "start_ms": 1.0, "end_ms": 3.0},
    ]
    assert bubble_measured(spans, 2) == pytest.approx(((1 - 3 / 4) + (1 - 2 / 4)) / 2)


def test_clock_offset_is_bounded_by_the_rounds_windows():
    """Rank r's clock runs 5 ms ahead of rank 0's; each round's windows (in each one's own
    clock) bound the offset, and the rounds together pin it down."""
    theta = 0.005
    # real times of entering and leaving each round, per rank (rank 0, rank r)
    rounds = [((0.0, 0.0030), (0.0010, 0.0031)), ((0.0100, 0.0102), (0.0099, 0.0103))]
    w0 = [r[0] for r in rounds]
    wr = [(a + theta, b + theta) for _, (a, b) in rounds]
    lo, hi = offset_bounds(w0, wr)
    assert lo <= theta <= hi and hi - lo == pytest.approx(0.0006), (lo, hi)  # round 2 binds
    # a span of rank r at 2 ms of its clock after its origin, in rank 0's clock
    (s,) = to_rank0_clock([{"start_ms": 2.0, "end_ms": 3.0}], origin=1.0 + theta, theta=theta)
    assert s["start_ms"] == pytest.approx(1002.0) and s["end_ms"] == pytest.approx(1003.0)
    spans, info = rebase(
        [{"start_ms": 1000.5, "end_ms": 1001.0}], [(1000.0, 0.0), (999.0, 0.2)], 1000.0
    )
    assert spans[0]["start_ms"] == pytest.approx(0.5)  # from rank 0's origin
    assert info == {"offsets_ms": [0.0, -1.0], "uncertainty_ms": [0.0, 0.2]}


def _span(stage, mb, kind, a, b, chunk=0):
    return {"stage": stage, "chunk": chunk, "micro_batch": mb, "kind": kind,
            "start_ms": a, "end_ms": b}  # fmt: skip


def test_zbv_spans_are_ordered_along_the_v():
    """zbv: rank 1 turns the V (chunk 1 = virtual stage 2), rank 0's chunk 1 is the last: in
    order along the V, out of order read as interleaved (chunk * pp + rank)."""
    spans = [_span(0, 0, "forward", 0, 1), _span(1, 0, "forward", 1, 2),
             _span(1, 0, "forward", 2, 3, chunk=1), _span(0, 0, "forward", 3, 4, chunk=1)]  # fmt: skip
    assert order_violations(spans, 2, "zbv") == 0
    assert order_violations(spans, 2, "interleaved-1f1b") == 1


def test_a_timeline_that_violates_send_receive_order_is_flagged_without_a_bubble():
    ok = [_span(0, 0, "forward", 0, 10), _span(1, 0, "forward", 10.5, 20),
          _span(1, 0, "backward", 20, 40), _span(0, 0, "backward", 40.2, 60)]  # fmt: skip
    msg = timeline_message(4, 1.0, "1f1b", 2, 1, 1, ok)
    assert msg["clock"] == {"order_violations": 0} and msg["bubble_measured"] > 0
    # the loaded machine's timeline: stage 1's forward at 1.1 ms, stage 0's ends at 13.3 ms
    bad = [_span(0, 0, "forward", 0, 13.3), _span(1, 0, "forward", 1.1, 9.0),
           _span(1, 0, "backward", 9.0, 30), _span(0, 0, "backward", 31, 50)]  # fmt: skip
    msg = timeline_message(4, 1.0, "1f1b", 2, 1, 1, bad)
    assert msg["clock"] == {"order_violations": 1} and msg["bubble_measured"] is None
    assert order_violations(bad[:1] + bad[2:], 2) == 0  # without the forward it received
    # interleaved: virtual stage chunk * pp + stage; chunk 1 of stage 0 follows stage 1's chunk 0
    chain = [_span(1, 0, "forward", 0, 5), _span(0, 0, "forward", 4, 8, chunk=1)]
    assert order_violations(chain, 2) == 1
    from nanotron_dashboard.messages import parse_messages

    (parsed,) = parse_messages(json.dumps({**msg, "run_id": "r"}))  # the dashboard takes it
    assert parsed.clock.order_violations == 1 and parsed.bubble_measured is None


def test_client_keeps_events_and_bounds_waiting_telemetry():
    client = DashboardClient("http://127.0.0.1:9", run_id="r", heartbeat_s=60)  # nobody there
    try:
        client.telemetry_queue = 5
        for step in range(8):
            client.telemetry({"type": "rank_stats", "step": step, "ranks": []})
            client.event("straggler", "warning", "x" * 3000, step, {"rank": 1})
        with client._cv:
            items = list(client._items)
        telemetry = [m["step"] for kind, m in items if m["type"] == "rank_stats"]
        events = [m for kind, m in items if m["type"] == "event"]
        assert telemetry == [3, 4, 5, 6, 7] and client.dropped_telemetry == 3
        assert [e["step"] for e in events] == list(range(8))
        assert len(events[0]["message"]) == 2000 and events[0]["run_id"] == "r"
    finally:
        client.close(timeout=0.1)


LAYOUTS = [
    {"dp": 1, "tp": 1, "pp": 2, "engine": "interleaved-1f1b"},  # v = 2 chunks, m = 2
    {"dp": 1, "tp": 2, "pp": 1},
    {"dp": 1, "tp": 1, "pp": 1, "cp": 2},
    {"dp": 2, "tp": 1, "pp": 1, "zero": 3},
]


def _losses_and_weights(layout: dict, telemetry: bool):
    from nanotron_parallel.context import ParallelContext
    from nanotron_train.trainer import Trainer

    raw = tiny_config(layout, None, steps=4)
    raw["parallelism"]["context_parallel_size"] = layout.get("cp", 1)
    if layout.get("engine") == "interleaved-1f1b":
        raw["parallelism"]["pp_virtual_stages"] = 2
        raw["model"]["model_config"]["num_hidden_layers"] = 4
    raw["logging"].update(
        rank_stats_interval=2 if telemetry else 0,
        pipeline_timeline_interval=1 if telemetry else 0,
    )
    pc = ParallelContext(dp=layout["dp"], tp=layout["tp"], pp=layout["pp"], cp=layout.get("cp", 1))
    try:
        trainer = Trainer(config_from_dict(copy.deepcopy(raw)), pc, stream=io.StringIO())
        records: list[dict] = []
        trainer.train(on_record=records.append, every_step=True)
        with trainer.grads.full_parameters():  # ZeRO-3: gathered (collective)
            weights = [p.detach().clone() for p in trainer.state.model.parameters()]
        tm = trainer.telemetry
        return [r["lm_loss"] for r in records], weights, tm.last_rank_stats, tm.last_timeline
    finally:
        pc.destroy()


def _compare_on_rank() -> list:
    torch.set_num_threads(1)
    out = []
    with shared_default_group():
        for layout in LAYOUTS:
            off = _losses_and_weights(layout, False)
            on = _losses_and_weights(layout, True)
            assert off[0] == on[0] and len(off[0]) == 4
            assert all(torch.equal(a, b) for a, b in zip(off[1], on[1], strict=True))
            out.append(on[2:])
    return out


def test_losses_and_weights_bitwise_unchanged_with_telemetry_on():
    """Interleaved pp=2 (v=2), tp=2, cp=2 and dp=2 ZeRO-3: the same losses and weights with rank stats every 2
    steps and a timeline every step as without; rank 0 measured tp time and chunk spans."""
    results = run_distributed(_compare_on_rank, 2)[0]
    (pp_stats, timeline), (tp_stats, no_timeline), (cp_stats, _), (z3_stats, _) = results
    assert [r["dp"] for r in z3_stats] == [0, 1] and all(r["dp_wait_ms"] > 0 for r in z3_stats)
    assert [(r["cp"], r["dp"], r["tp"], r["pp"]) for r in cp_stats] == [(0, 0, 0, 0), (1, 0, 0, 0)]
    assert no_timeline is None  # pp = 1: no timeline
    assert [r["tp_comm_ms"] > 0 for r in tp_stats] == [True, True]
    assert [r["tp"] for r in tp_stats] == [0, 1] and [r["pp"] for r in pp_stats] == [0, 1]
    assert [r["tp_comm_ms"] for r in pp_stats] == [0.0, 0.0]
    assert timeline["step"] == 4 and timeline["schedule"] == "interleaved-1f1b"
    assert (timeline["chunks"], timeline["micro_batches"]) == (2, 2)
    assert timeline["bubble_formula"] == pytest.approx(1 / 5)
    keys = sorted((s["stage"], s["chunk"], s["micro_batch"], s["kind"]) for s in timeline["spans"])
    assert keys == sorted(
        (st, c, mb, k)
        for st in (0, 1)
        for c in (0, 1)
        for mb in (0, 1)
        for k in ("forward", "backward")
    )


class _FakeNvml:
    """The few pynvml calls telemetry/system.py makes, with fixed readings."""

    def __init__(self) -> None:
        self.opened: list[int] = []

    def nvmlInit(self) -> None:
        pass

    def nvmlDeviceGetHandleByIndex(self, index: int):
        self.opened.append(index)
        return index

    def nvmlDeviceGetUtilizationRates(self, handle):
        return type("Rates", (), {"gpu": 87})()

    def nvmlDeviceGetMemoryInfo(self, handle):
        return type("Mem", (), {"used": 3 * 2**30})()

    def nvmlDeviceGetPowerUsage(self, handle):
        raise RuntimeError("not supported on this board")  # an NVML error: value absent


def test_nvml_readings_follow_cuda_visible_devices(monkeypatch):
    import sys

    from nanotron_train.telemetry.system import Nvml, SystemMetrics

    fake = _FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert Nvml.open(torch.device("cpu")) is None  # only on CUDA
    nvml = Nvml.open(torch.device("cuda", 1))
    assert fake.opened == [5]  # CUDA device 1 is the machine's GPU 5
    assert (nvml.utilization_pct(), nvml.memory_used_bytes(), nvml.power_w()) == (
        87.0,
        3 * 2**30,
        None,
    )
    metrics = SystemMetrics(torch.device("cuda", 0))
    values = metrics.values()
    assert values["system/gpu_util_pct"] == 87.0 and values["system/gpu_mem_bytes"] == 3 * 2**30
    assert "system/gpu_power_w" not in values and values["system/rss_bytes"] > 0


def _wait_for_a_late_rank_in_the_optimizer(collective: str) -> dict:
    import time

    import torch.distributed as dist

    from nanotron_parallel.clip import global_grad_norm
    from nanotron_parallel.data_parallel import build_data_parallel
    from nanotron_parallel.phase_timer import PhaseTimer, activate, deactivate
    from nanotron_train.telemetry.rank_stats import FIELDS, local_row

    timer = PhaseTimer(torch.device("cpu"))
    with shared_default_group():
        rank = dist.get_rank()
        param = torch.nn.Parameter(torch.full((8,), float(rank)))
        zero = build_data_parallel(1, [param], None, 2, rank)
        dist.barrier()
        if rank == 1:
            time.sleep(0.5)  # late at the collective: rank 0 waits for it there
        activate(timer)
        try:
            with timer.span("optimizer"):
                if collective == "norm":
                    result = float(
                        global_grad_norm([torch.full((4,), 1.0)], None, torch.device("cpu"))
                    )
                else:  # ZeRO-1's all-gather of the updated shards
                    zero.gather_params()
                    result = param.detach().tolist()
        finally:
            deactivate()
    totals, _ = timer.collect()
    row = dict(zip(FIELDS, local_row(totals, 1, torch.device("cpu"), {"cpu_util_pct": None})))
    return {"result": result, **row}


@pytest.mark.parametrize("collective", ["norm", "zero1_gather"])
def test_the_wait_in_the_optimizers_collectives_is_not_optimizer_work(collective):
    """Found end to end (tests/dashboard/test_browser_straggler_e2e.py): the ranks that reach
    the world-wide grad-norm all-reduce (or ZeRO's all-gather) first wait there for a slowed
    rank; booked as optimizer time, that wait made them look busier than the slowed rank itself
    (a wrong straggler)."""
    early, late = run_distributed(_wait_for_a_late_rank_in_the_optimizer, 2, collective)
    if collective == "norm":
        assert early["result"] == late["result"] == pytest.approx(8**0.5)  # 2 ranks x 4 ones
    else:  # each rank's owned half comes from that rank
        assert early["result"] == late["result"] == [0.0] * 4 + [1.0] * 4
    assert early["dp_wait_ms"] > 250  # rank 1 came 500 ms after the barrier
    assert early["optimizer_ms"] < early["dp_wait_ms"] / 5
    assert early["dp_wait_ms"] > late["dp_wait_ms"] + 200
