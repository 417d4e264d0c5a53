"""Rank cases of test_pipeline_overlap.py: DualPipeV at PP2 x EP2 x DP2 (4 ranks) on tiny's model, one step with the
MoE communication overlap off and one with it on, from the same weights and tokens."""

from __future__ import annotations

from pathlib import Path

import torch

from moe import EPBuffers
from moe.layer.interleave import compute_spans
from moe.trainer import run
from moe.trainer.models.deepseek_v3 import DeepseekV3Config
from moe.trainer.train.job_config import job_from_args
from moe.trainer.train.parallel_state import Layout, ParallelState
from moe.trainer.train.trainer import target_counts

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "examples" / "deepseek_v3" / "configs" / "tiny.toml"
MICRO_BATCHES, ROWS, SEQ_LEN = 4, 1, 32  # per data-parallel rank


def _step(parallel, ep_buffers, recompute_modules, overlap: bool, tokens_BS, counts, seed: int):
    # tiny's model in its DualPipeV stages as train.py builds it (moe/trainer/run.py), the timeline recorded.
    recompute = ["--recompute-granularity", "selective", "--recompute-modules", *recompute_modules] \
        if recompute_modules else []  # fmt: skip
    job = job_from_args(TINY, [
        "--pp", "2", "--ep", "2", "--pp-schedule", "dualpipev", "--micro-batches", str(MICRO_BATCHES),
        "--global-batch-size", str(parallel.layout.dp * MICRO_BATCHES * ROWS), "--seq-length", str(SEQ_LEN),
        "--pipeline-timeline", *(["--overlap-moe-expert-parallel-comm"] if overlap else []), *recompute,
    ], world=parallel.layout.world)  # fmt: skip
    model, runner = run.build_model(job, parallel, ep_buffers, seed=seed)
    recorder = runner.recorder
    sums, loads = runner.step(tokens_BS, counts, step=1)
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    slots = [(s.kind, s.stage, s.microbatch) for s in recorder.slots]
    if runner.overlap is not None:
        runner.overlap.close()
    del loads  # keyed by the layers' ids: the same loads in the stages' order
    loads = [load.clone() for module in runner.modules for load in module.loads]
    return sums, grads, loads, runner, slots


def _order_facts(record) -> dict:
    """Per interleaved F&B: for every communication of a side started while the other side had not finished,
    whether the other side computed between its start and its wait ('hidden'), and each side's communications."""
    facts = {"comms": {"F": [], "B": []}, "covered": [], "uncovered": []}
    ended = {e.side: e.t for e in record.events if e.kind == "end"}
    for comm in record.comms():
        facts["comms"][comm.side].append(comm.name)
        other = "B" if comm.side == "F" else "F"
        if ended[other] <= comm.issue:
            continue  # the other side was done: nothing left to overlap with
        spans = compute_spans(record.events, other)
        ran = any(comm.issue <= start and end <= comm.resume and end > start for start, end in spans)
        (facts["covered"] if ran else facts["uncovered"]).append((comm.side, comm.name))
    return facts


def overlap_case(ctx, recompute_modules: tuple[str, ...] | None) -> dict:
    """One step with the overlap off and one with it on (fresh models, same seed and tokens). Returns, per rank:
    whether the loss sums, the gradients (bitwise) and the expert loads are identical, the F&B records' facts, and
    the timeline slots of the overlapped step."""
    cfg = DeepseekV3Config.from_toml(TINY)
    layout = Layout(world=4, pp=2, ep=2, pp_schedule="dualpipev")
    parallel = ParallelState.from_process_group(layout)
    ep_buffers = EPBuffers(timeout_s=60)
    gen = torch.Generator().manual_seed(11)
    dp = layout.dp
    global_BS = torch.randint(0, cfg.vocab_size, (dp * MICRO_BATCHES * ROWS, SEQ_LEN), generator=gen)
    counts = target_counts(global_BS, cfg.num_nextn_predict_layers)
    rows = MICRO_BATCHES * ROWS
    tokens_BS = global_BS[parallel.dp_rank * rows : (parallel.dp_rank + 1) * rows]
    try:
        off = _step(parallel, ep_buffers, recompute_modules, False, tokens_BS, counts, seed=5)
        on = _step(parallel, ep_buffers, recompute_modules, True, tokens_BS, counts, seed=5)
    finally:
        ep_buffers.destroy()
    sums_off, grads_off, loads_off, _, slots_off = off
    sums_on, grads_on, loads_on, runner, slots_on = on
    records = runner.overlap.records
    return {
        "pp_rank": parallel.pp_rank,
        "reason": runner.overlap.reason,
        "sums_equal": torch.equal(sums_off, sums_on),
        "sums": sums_on.tolist(),
        "grad_names_equal": grads_off.keys() == grads_on.keys(),
        "num_grads": len(grads_on),
        "grads_differ": sorted(k for k in grads_off if k in grads_on and not torch.equal(grads_off[k], grads_on[k])),
        "loads_equal": len(loads_off) == len(loads_on) and all(map(torch.equal, loads_off, loads_on)),
        "records": [
            {"stages": r.stages, "microbatches": r.microbatches, "interleaved": r.interleaved, **_order_facts(r)}
            for r in records
        ],
        "slots_off": slots_off,
        "slots_on": slots_on,
        "one_record": next((r for r in records if len(r.comms()) >= 4), None),
    }
