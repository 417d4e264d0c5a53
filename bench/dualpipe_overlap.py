"""DualPipeV's MoE communication overlap (moe/trainer/pipeline/overlap.py): how much of the MoE dispatch / combine time
of an overlapped forward-backward (F&B) chunk is hidden behind the other micro-batch's compute, and what it does to the
step time.

Setting: a DeepSeek-V3 config (default `tiny`), PP 2 x EP 2 x DP 2 (4 processes, gloo on 127.0.0.1; EP over the two
data-parallel ranks of a stage, mtdeepep's 'flex' dispatcher), DualPipeV with `--micro-batches` micro-batches of
`--rows` sequences of `--seq-len` random tokens per data-parallel rank. Three runners from the same weights, their
steps alternated (a noisy machine's drifts hit all three alike):

- off:         torch's runtime runs each F&B's forward, then its backward;
- sequential:  our F&B function with the two sides run one after the other (the same code and event records as
               `overlap`, no hand-over): each MoE communication's wait is fully exposed;
- overlap:     the sides interleaved at their communication points (`--overlap-moe-expert-parallel-comm`).

Per mode (medians over the timed steps): the step time (slowest rank), and over every F&B of every rank: their
time, the MoE communications' time from the moment their side reached its wait point ('issue') to the end of the
wait ('done'; with the overlap the other side computes in between), the part the side was blocked ('exposed'), and
the share of the sequential mode's exposed time that the overlap hid: 1 - exposed(overlap) / exposed(sequential).
Writes the overlap mode's step timeline (F&B slots, 'comm' slots) and one F&B in detail (compute and communication
lanes of both sides) as PNGs, and the results as JSON.

    .venv/bin/python bench/dualpipe_overlap.py                  # tiny, 8 micro-batches; about a minute

On a 2-core CPU the 4 ranks (and their mtdeepep comm threads) take turns on the cores: the communication is CPU
work (shared-memory copies and FP32 sums), so hiding it behind compute saves less than it would where a copy engine
or a NIC moves the data.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
from _common import RESULTS_DIR, add_pipeline_run_arguments, make_parser, print_table, run_ranks, save_run

REPO = Path(__file__).resolve().parents[1]
MODES = ("off", "sequential", "overlap")


def _worker(rank: int, world: int, group, args) -> dict:
    from moe import EPBuffers
    from moe.trainer.models.deepseek_v3 import DeepseekV3Config, DeepseekV3ForCausalLM
    from moe.trainer.pipeline import PipelineRunner, TimelineRecorder, gather_timelines, pipeline_moe_options
    from moe.trainer.pipeline.overlap import install_overlapped_forward_backward, summarize
    from moe.trainer.pipeline.split import split_layers
    from moe.trainer.pipeline.timeline import plot_timeline, write_chrome_trace
    from moe.trainer.train.parallel_state import Layout, ParallelState
    from moe.trainer.train.trainer import target_counts

    del rank, world
    cfg = DeepseekV3Config.from_toml(REPO / "examples" / "deepseek_v3" / "configs" / f"{args.config}.toml")
    layout = Layout(world=4, pp=2, ep=2, pp_schedule="dualpipev")
    parallel = ParallelState.from_process_group(layout)
    ep_buffers = EPBuffers(timeout_s=300)
    runners, recorders = {}, {}
    for mode in MODES:
        torch.manual_seed(args.seed)
        model = DeepseekV3ForCausalLM(cfg, ep_group=parallel.ep_group, ep_buffers=ep_buffers,
                                      aux_loss_group=parallel.token_group,
                                      moe_options=pipeline_moe_options("dualpipev"))  # fmt: skip
        recorders[mode] = TimelineRecorder(parallel.pp_rank, enabled=mode == "overlap")
        runner = PipelineRunner(model, parallel, schedule="dualpipev", split=split_layers(cfg.num_hidden_layers, 4),
                                micro_batches=args.micro_batches, micro_rows=args.rows, seq_len=args.seq_len,
                                mtp_loss_weight=cfg.mtp_loss_weight, num_mtp=cfg.num_nextn_predict_layers,
                                recorder=recorders[mode], overlap_moe_comm=mode == "overlap")  # fmt: skip
        if mode == "sequential":
            runner.overlap = install_overlapped_forward_backward(runner.schedule, runner, interleave=False)
        runners[mode] = runner
    gen = torch.Generator().manual_seed(args.seed)
    rows = args.micro_batches * args.rows
    global_BS = torch.randint(0, cfg.vocab_size, (layout.dp * rows, args.seq_len), generator=gen)
    counts = target_counts(global_BS, cfg.num_nextn_predict_layers)
    tokens = global_BS[parallel.dp_rank * rows : (parallel.dp_rank + 1) * rows]
    steps: dict[str, list[dict]] = {mode: [] for mode in MODES}
    sums = {}
    for index in range(args.warmup + args.steps):
        for mode, runner in runners.items():
            for p in runner.model.parameters():
                p.grad = None
            torch.distributed.barrier(group=group)
            start = time.perf_counter()
            sums[mode], _ = runner.step(tokens, counts, index + 1)
            elapsed = torch.tensor([time.perf_counter() - start])
            torch.distributed.all_reduce(elapsed, op=torch.distributed.ReduceOp.MAX, group=group)
            if index >= args.warmup:
                row = {"step_s": float(elapsed)}
                if runner.overlap is not None:
                    row.update(summarize(runner.overlap.records))
                    row["records"] = runner.overlap.records
                steps[mode].append(row)
    identical = all(torch.equal(sums["off"], sums[m]) for m in MODES)
    timelines = gather_timelines(recorders["overlap"], parallel.pp_group)
    if torch.distributed.get_rank() == 0:
        out = args.out_dir / "dualpipe_overlap_timeline"
        meta = {"schedule": "dualpipev", "pp": 2, "ep": 2, "micro_batches": args.micro_batches, "overlap": True}
        write_chrome_trace(out.with_suffix(".json"), timelines, metadata=meta)
        plot_timeline(out.with_suffix(".png"), timelines, f"dualpipev + MoE comm overlap, pp 2 x ep 2 ({args.config})")
    result = {"identical_loss_sums": identical, "pp_rank": parallel.pp_rank}
    for mode in MODES:
        rows_ = steps[mode]
        result[mode] = {"step_s": statistics.median(r["step_s"] for r in rows_)}
        if mode != "off":
            for key in ("fb_s", "comm_in_flight_s", "comm_exposed_s", "comm_hidden_s", "actions", "comms"):
                result[mode][key] = statistics.median(r[key] for r in rows_)
            result[mode]["last_records"] = rows_[-1]["records"]
    ep_buffers.destroy()
    return result


def main() -> None:
    parser = make_parser(__doc__)
    parser.add_argument("--config", default="tiny", help="examples/deepseek_v3/configs/<name>.toml")
    add_pipeline_run_arguments(parser)
    parser.add_argument("--json", type=Path, default=RESULTS_DIR / "dualpipe_overlap.json")
    args = parser.parse_args()
    args.out_dir = args.json.parent
    args.out_dir.mkdir(parents=True, exist_ok=True)
    results = run_ranks(_worker, 4, (args,), timeout_s=1800)

    from moe.trainer.pipeline.overlap import plot_fb

    # One F&B of pipeline rank 1 (stages 1 and 2: both sides communicate) of the last overlapped step: the median.
    records = [r for r in results[2]["overlap"]["last_records"] if r.interleaved and len(r.comms()) >= 4]
    if records:
        record = sorted(records, key=lambda r: r.duration)[len(records) // 2]
        plot_fb(args.out_dir / "dualpipe_overlap_fb.png", record, f"pp rank 1, {args.config}")
    table = []
    for mode in MODES:
        per_rank = [r[mode] for r in results]
        step = max(r["step_s"] for r in per_rank)
        row = [mode, f"{step * 1e3:.1f}"]
        if mode == "off":
            row += ["-"] * 5
        else:
            fb = sum(r["fb_s"] for r in per_rank)
            in_flight = sum(r["comm_in_flight_s"] for r in per_rank)
            exposed = sum(r["comm_exposed_s"] for r in per_rank)
            hidden = sum(r["comm_hidden_s"] for r in per_rank)
            row += [f"{fb * 1e3:.1f}", f"{in_flight * 1e3:.1f}", f"{exposed * 1e3:.1f}", f"{hidden * 1e3:.1f}"]
            base = sum(r["sequential"]["comm_exposed_s"] for r in results)
            row.append(f"{1 - exposed / base:.0%}" if mode == "overlap" and base > 0 else "-")
        table.append(row)
    for r in results:
        for mode in ("sequential", "overlap"):
            r[mode].pop("last_records")
    identical = all(r["identical_loss_sums"] for r in results)
    print(f"{args.config}, pp 2 x ep 2 x dp 2, dualpipev, {args.micro_batches} micro-batches of {args.rows} x "
          f"{args.seq_len} tokens; loss sums identical across modes: {identical}")  # fmt: skip
    print_table(
        ("mode", "step ms", "F&B ms", "comm issue->done ms", "exposed ms", "under other side ms", "hidden"),
        table,
        "F&B and comm columns: summed over the F&B actions of all 4 ranks (median step); hidden: 1 - exposed / "
        f"exposed of 'sequential'. PNGs: {args.out_dir}/dualpipe_overlap_timeline.png, dualpipe_overlap_fb.png",
    )  # fmt: skip
    save_run(args.json, args, results=results)


if __name__ == "__main__":
    main()
