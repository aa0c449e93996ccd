"""Live push over a real socket: a point ingested reaches a subscribed browser within a second."""

from __future__ import annotations

import json
import time

from websockets.sync.client import connect


def test_points_reach_subscriber_within_a_second(any_live_dashboard):
    d = any_live_dashboard
    ws_base = d.url.replace("http://", "ws://")
    d.post("/api/ingest", {"type": "run_start", "run_id": "live-1"})
    with (
        connect(ws_base + "/ws/runs/live-1", legacy=True) as sub,
        connect(ws_base + "/ws/ingest", legacy=True) as ing,
    ):
        time.sleep(0.2)  # subscription registered
        ing.send("{broken")  # an invalid message gets an error reply; the connection lives on
        assert json.loads(ing.recv(timeout=5))["ok"] is False
        latencies = []
        for step in range(1, 6):
            t0 = time.perf_counter()
            ing.send(
                json.dumps(
                    {
                        "type": "metrics",
                        "run_id": "live-1",
                        "step": step,
                        "values": {"lm_loss": 1.0 / step, "grad_norm": float("nan")},
                    }
                )
            )
            while True:
                msg = json.loads(sub.recv(timeout=5))
                if msg["type"] == "points":
                    break
            latencies.append(time.perf_counter() - t0)
            assert msg["points"]["lm_loss"][0][:2] == [step, 1.0 / step]
            assert msg["points"]["grad_norm"][0][1] == "NaN"
        assert max(latencies) < 1.0, latencies
