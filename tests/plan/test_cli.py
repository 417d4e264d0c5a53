"""examples/deepseek_v3/plan.py: the ranked table, --top, the rejection summary, the device table, and clear errors
(exit status 2) for bad arguments."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from moe.trainer.plan import cli
from moe.trainer.plan.devices import SPECS, load_device_spec, source_rows

REPO = Path(__file__).resolve().parents[2]
PLAN_PY = REPO / "examples" / "deepseek_v3" / "plan.py"
TINY = str(REPO / "examples" / "deepseek_v3" / "configs" / "tiny.toml")


@pytest.fixture(scope="module")
def plan_main():
    return cli.main


def _ranked_rows(text: str) -> list[str]:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("#  layout")) + 2
    rows = []
    for line in lines[start:]:
        if not line.strip():
            break
        rows.append(line)
    return rows


def test_top_k_table_and_rejections(plan_main, capsys, tmp_path):
    out_json = tmp_path / "plan.json"
    argv = ["--config", TINY, "--devices", "4", "--device-spec", "cpu", "--top", "3", "--json", str(out_json)]
    code = plan_main(argv)
    text = capsys.readouterr().out
    assert code == 0
    rows = _ranked_rows(text)
    assert [r.split()[0] for r in rows] == ["1", "2", "3"]
    assert "rejected:" in text and "etp > 1" in text and "--config" in text.split("the best layout's train.py")[1]
    header = next(line for line in text.splitlines() if line.startswith("#  layout"))
    assert "etp" not in header.split()  # the column shows only when a shown layout has etp > 1 (tests/plan/test_etp.py)
    saved = json.loads(out_json.read_text())
    steps = [r["time_s"]["step"] for r in saved["ranked"]]
    assert len(steps) == 3 and steps == sorted(steps)  # fastest first
    assert [r["layout"] for r in saved["ranked"]] == [r.split(None, 1)[1].split("  ")[0].rstrip(" *") for r in rows]
    assert sum(saved["rejected"].values()) > 0


def test_overrides_change_the_batch(plan_main, capsys):
    code = plan_main(["--config", TINY, "--devices", "2", "--device-spec", "h100", "--top", "1", "--micro-batches",
                      "8", "--global-batch", "64", "--seq-len", "64", "--dtype", "bfloat16"])  # fmt: skip
    text = capsys.readouterr().out
    assert code == 0 and "global batch 64 x 64 tokens, 8 micro-batches per dp rank, bfloat16" in text


def test_no_layout_fits_exits_1(plan_main, capsys, tmp_path):
    small = tmp_path / "small_gpu.json"
    fields = {k: v for k, v in SPECS["h100"].to_dict().items() if k not in ("sources", "estimated")}
    small.write_text(json.dumps({**fields, "name": "tiny-gpu", "memory_gib": 0.01}))
    code = plan_main(["--config", TINY, "--devices", "2", "--device-spec", str(small)])
    text = capsys.readouterr().out
    assert code == 1 and "no layout fits" in text and "exceeds the device memory" in text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--devices", "4", "--device-spec", "z100"], "unknown device spec 'z100'; built-in: h100, h200, h800, b200"),
        (["--devices", "0", "--device-spec", "cpu"], "--devices must be >= 1"),
        (["--devices", "4", "--device-spec", "cpu", "--top", "0"], "--top must be >= 1"),
        (["--devices", "4", "--device-spec", "h100", "--calibrate"], "--calibrate measures this machine"),
        (["--devices", "4", "--device-spec", "missing.json"], "device spec file missing.json does not exist"),
    ],
)
def test_bad_arguments_exit_2(plan_main, capsys, argv, message):
    assert plan_main(["--config", TINY, *argv]) == 2
    assert message in capsys.readouterr().err


def test_missing_arguments_and_bad_config_exit_2(plan_main, capsys, tmp_path):
    assert plan_main(["--devices", "4"]) == 2
    assert "--config, --device-spec" in capsys.readouterr().err
    bad = tmp_path / "bad.toml"
    bad.write_text("[model]\nhidden_size = 'wide'\n")
    assert plan_main(["--config", str(bad), "--devices", "4", "--device-spec", "cpu"]) == 2
    assert "hidden_size" in capsys.readouterr().err


def test_cli_process_exit_status():
    """The script itself (a fresh interpreter): a bad spec is exit status 2 with the message on stderr."""
    proc = subprocess.run([sys.executable, str(PLAN_PY), "--config", TINY, "--devices", "4", "--device-spec", "z900"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2
    assert "plan.py: error: unknown device spec 'z900'" in proc.stderr


def test_list_devices_cites_every_figure(plan_main, capsys):
    assert plan_main(["--list-devices"]) == 0
    text = capsys.readouterr().out
    for name in ("h100", "h200", "mtt-s4000", "mtt-s5000", "cpu"):
        assert f"{name}: " in text
    assert "nvidia.com" in text and "Moore Threads" in text and "(est.)" in text


@pytest.mark.parametrize("name", sorted(SPECS))
def test_every_figure_has_a_source(name):
    spec = SPECS[name]
    cited = set(spec.sources)
    needed = {"memory_gib", "memory_gbps", "intra_node_gbps", "inter_node_gbps", "comm_latency_us", "runtime_gib",
              "allocator_overhead"} | {f"tflops.{d}" for d in spec.tflops}  # fmt: skip
    assert needed <= cited, needed - cited
    assert spec.estimated <= set(spec.sources)
    assert all(value != "" for _, value, _ in source_rows(spec))


def test_device_spec_validation(tmp_path):
    with pytest.raises(ValueError, match="memory_gib must be a positive number"):
        SPECS["h100"].replace(memory_gib=0)
    with pytest.raises(ValueError, match="gemm_efficiency"):
        SPECS["h100"].replace(gemm_efficiency={"bfloat16": 1.5})
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"name": "x", "warp_drive": 1}))
    with pytest.raises(ValueError, match="unknown fields \\['warp_drive'\\]"):
        load_device_spec(str(bad))
    assert SPECS["mtt-s4000"].has_fp8() is False and SPECS["mtt-s5000"].has_fp8()
    cpu = SPECS["cpu"]  # single-threaded ranks on 2 cores: one core each, turns beyond 2 ranks; RAM split
    assert (cpu.share(1), cpu.share(2), cpu.share(4)) == (0.5, 0.5, 0.25) and SPECS["h100"].share(8) == 1.0
    assert cpu.memory_capacity_bytes(4) == cpu.memory_capacity_bytes(1) / 4
