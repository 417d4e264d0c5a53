"""The issue's FP8 headline: the tiny config trained 200 steps in FP8 ends within 1.5% of the unquantised loss.

Each run is `bench/fp8_convergence.py --one RUN` (moe.trainer.train's own Trainer.train_step, one thread, 200 steps of 4
x 128 tokens of the python-stdlib corpus, seed 1234): FP32, per-tensor delayed scaling and DeepSeek-V3 block-wise,
three processes at once (about 2.5 minutes on 2 cores), each bounded by a timeout. The measure is the held-out loss
of the final weights (32 fixed validation sequences).

Why 1.5% is a fair bar and what it cannot see: MoE routing makes training chaotic, so two FP32 runs that differ by
one BF16-sized perturbation of the initial weights end up to ~1.5% apart at a given step (bench/fp8_convergence.py's
'fp32-perturbed' run measures it), and one seed measured +2.6% for block-wise at 8 x 128 tokens where two other seeds
gave -0.7% and -0.3% (see the issue note). The bar catches defects that cost more than that; the SQNR tests
(test_fp8_numerics.py) catch the small ones.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from moe.trainer.data.token_file import prepare_tokens
from moe.trainer.train.job_config import job_from_args

pytestmark = pytest.mark.slow  # slow: two 120-step trainings

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "fp8_convergence.py"
RUNS = ("fp32", "delayed", "blockwise")
TOLERANCE = 0.015
TINY = ROOT / "examples" / "deepseek_v3" / "configs" / "tiny.toml"


@pytest.mark.timeout(900)
def test_fp8_training_ends_within_1_5_percent_of_fp32(tmp_path):
    # The three runs read one token file (the python-stdlib corpus in tiny's BPE vocabulary, the trainer's cache):
    # on a machine without it, it is built here once, not by the three processes at once (each would train the
    # tokenizer and encode the corpus: ~30 s of CPU apiece on 2 cores). The same data flags as the bench's runs.
    job = job_from_args(TINY, ["--corpus", "python-stdlib", "--tokenizer", "bpe"])
    prepare_tokens(job.data, job.model.vocab_size)
    procs = {}
    for run in RUNS:
        out = tmp_path / f"{run}.json"
        cmd = [sys.executable, str(BENCH), "--one", run, "--batch", "4", "--steps", "200", "--json", str(out)]
        procs[run] = (subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True), out)
    results = {}
    try:
        for run, (proc, out) in procs.items():
            text, _ = proc.communicate(timeout=800)
            assert proc.returncode == 0, f"{run} failed:\n{text[-3000:]}"
            results[run] = json.loads(out.read_text())["results"][0]
    finally:
        for proc, _ in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    ref = results["fp32"]["val_loss"]
    assert 3.0 < ref < 6.0, f"FP32 held-out loss {ref}: the run did not train (tiny starts at ln(512) = 6.24)"
    for recipe in ("delayed", "blockwise"):
        rel = results[recipe]["val_loss"] / ref - 1
        assert abs(rel) <= TOLERANCE, f"{recipe}: held-out loss {results[recipe]['val_loss']:.4f} vs FP32 {ref:.4f}"
