"""decode_timeline.py on hand-made interleaver events of two ranks: the summary's sums, the trace's lanes and
times, the PNG. (The real step's timeline is drawn by the torchrun test of generate.py and by bench/decode.py.)"""

from __future__ import annotations

import json

import pytest

from moe.layer.interleave import Event
from moe.trainer.models.deepseek_v3 import decode_timeline

# Rank r's clock is offset by r ms. A issues its dispatch at 10 ms, B computes until 20 ms and issues its own, A waits
# from 20 to 25 ms (5 ms exposed of 15 in flight), ends at 30; B's wait 30 -> 31 ms (1 of 11), ends at 40.
_STEP = [("A", "start", "", 0), ("A", "issue", "dispatch", 10), ("B", "start", "", 10), ("B", "issue", "dispatch", 20),
         ("A", "resume", "dispatch", 20), ("A", "done", "dispatch", 25), ("A", "end", "", 30),
         ("B", "resume", "dispatch", 30), ("B", "done", "dispatch", 31), ("B", "end", "", 40)]  # fmt: skip


def _rank(offset_ms: float) -> list[Event]:
    return [Event(side, kind, name, (t + offset_ms) / 1e3) for side, kind, name, t in _STEP]


def test_summary_trace_and_png(tmp_path):
    per_rank = [_rank(0), _rank(1)]
    summary = decode_timeline.step_summary(per_rank[0])
    assert summary["step"] == pytest.approx(0.040)
    assert summary["in_flight"] == pytest.approx(0.015 + 0.011)
    assert summary["exposed"] == pytest.approx(0.005 + 0.001)
    assert summary["hidden"] == pytest.approx(0.020)

    decode_timeline.write_chrome_trace(tmp_path / "t.json", per_rank, {"batch": 4})
    doc = json.loads((tmp_path / "t.json").read_text())
    slices = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in slices} == {0, 1}
    comms = sorted(
        (e["pid"], e["name"], e["ts"], e["dur"], e["args"]["exposed_us"]) for e in slices if e["cat"] == "comm"
    )
    assert [c[:2] for c in comms] == [(0, "A dispatch"), (0, "B dispatch"), (1, "A dispatch"), (1, "B dispatch")]
    # Times from the earliest event of all ranks: rank 1's A dispatch issued at 11 ms, in flight 15 ms, 5 exposed.
    assert comms[2][2:] == pytest.approx((11_000.0, 15_000.0, 5_000.0))
    computes = [e for e in slices if e["cat"] == "compute" and e["pid"] == 0 and e["name"] == "A compute"]
    assert [(e["ts"], e["dur"]) for e in computes] == [
        pytest.approx((0.0, 10_000.0)),
        pytest.approx((25_000.0, 5_000.0)),
    ]
    assert doc["otherData"]["batch"] == 4 and len(doc["otherData"]["ranks"]) == 2

    decode_timeline.plot_step(tmp_path / "t.png", per_rank, "two ranks")
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_no_events_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="overlap=True"):
        decode_timeline.write_chrome_trace(tmp_path / "t.json", [[], []])
