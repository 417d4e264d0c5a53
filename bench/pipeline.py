"""Pipeline schedules side by side: 1F1B, ZB-H1, DualPipeV, and 1F1B and ZB-H1 interleaved over 2 virtual stages
per rank (`1f1b-v2`, `zbh1-v2`: torch's `ScheduleInterleaved1F1B` / `ScheduleInterleavedZeroBubble`, pp * 2 stages
placed round-robin) on the same model, micro-batches and ranks, in one run: step time, measured bubble, the analytic
bubble of the DualPipe table from the measured F / B / W times, Megatron's formula for (interleaved) 1F1B, and the
peak memory of a step per rank.

Each schedule runs with each P2P transport of `--transports` (moe/trainer/pipeline/p2p.py): `torch` (torch.distributed's
isend / irecv, as torch's schedules post them) and `deepep` (`pp_send` / `pp_recv` of an `mtdeepep.ElasticBuffer`
over the pipeline group); the rows of one schedule compare them: step time against the torch transport's, and the P2P
share, the `p2p` phase (moe/layer/phase_timer.py: the schedule's step outside its F / B / I / W actions, i.e. posting
the sends and receives and waiting for them and for the neighbours) over the step, the mean over the ranks. The two
transports move the same bytes: each schedule's gradients after the last step are compared between them, bitwise.

Setting: a DeepSeek-V3 config (default `tiny`), `--pp` processes (gloo on 127.0.0.1, one per pipeline rank, no data
or expert parallelism), `--micro-batches` micro-batches of `--rows` sequences of `--seq-len` random tokens per step
(the same tokens for every schedule). Each schedule gets a fresh model from the same seed, `--warmup` steps, then
`--steps` timed steps (forward + backward of every micro-batch through `moe.trainer.pipeline.PipelineRunner`, gradients
zeroed before each; no optimizer step: the schedules differ only in the forward/backward). The schedules take turns
step by step (all are built first), so a shared machine's load drifts over them alike. A `-vN` schedule splits the
layers into pp * N stages (tiny's 4 layers at PP2 x 2: one layer a stage; at PP4 x 2 half of the 8 stages are
empty placeholders, so use bench/configs/pipeline8.toml there).

Measured per step (reported: the median step time, the median bubble over the steps, and the timeline and unit
times of the median-time step; on 2 shared cores a step's bubble varies by several points, hence the median of many):
- step time: the slowest rank's wall time of `PipelineRunner.step`;
- bubble: from every rank's timeline of F / B / I / W actions (`moe.trainer.pipeline.timeline`): idle time over the
  common span, all ranks together;
- analytic bubble (DualPipe's table, per rank): 1F1B (P-1)(F+B), ZB-H1 (P-1)(F+B-2W), DualPipeV (P-1)(F&B+B-3W)
  for its half-size chunks (DualPipe's "(PP/2-1)" with PP = 2P stages), with F, B, W the measured mean action
  times (B = I + W when the backward is split), as a fraction of (bubble + that rank's measured compute); the
  interleaved rows use the same entry over their chunks (V chunks per rank, V m chunk actions of compute);
- formula: Megatron's (P-1)/(V m) of (interleaved) 1F1B relative to the ideal step, as a share of the step
  ((P-1)/(V m + P-1)); it assumes equal stages and free communication, and depends on no measured time;
- peak memory: the largest rank's resident-set high-water mark during the step above its resident set before it
  (`moe.layer.peak_memory.peak_memory_bytes`): activations in flight, gradients and p2p buffers. The gradients are the
  same for every schedule, so the differences between rows are activation memory. Measured in a second set of rank
  processes (one step per schedule after the warm-up), because that accounting makes glibc map and unmap every
  allocation of 64 KiB or more: every fresh tensor then page-faults, which on this CPU slowed the steps by ~25% and
  unevenly (more where more memory is live), so the timed steps run in other processes.

The timed ranks run with glibc told to keep freed memory for reuse (`--allocator caching`, the default:
MALLOC_MMAP_MAX_=0, MALLOC_TRIM_THRESHOLD_ and MALLOC_TOP_PAD_ large), as a GPU's caching allocator does. By default
glibc returns every block above its mmap threshold (at most 32 MiB) to the system when it is freed, so each new
activation or gradient page-faults in fresh zeroed pages: a cost of the CPU allocator, not of the schedule, that
falls unevenly on the schedules (it grows with the memory held between actions: ZB-H1's queued weight-gradient
operands). `--allocator glibc` keeps glibc's defaults.

    .venv/bin/python bench/pipeline.py                       # PP 2, 8 micro-batches, tiny; ~4 minutes
    .venv/bin/python bench/pipeline.py --schedules 1f1b,dualpipev --transports torch,deepep
    .venv/bin/python bench/pipeline.py --pp 4 --micro-batches 8
    .venv/bin/python bench/pipeline.py --config bench/configs/pipeline8.toml   # equal stages for every schedule
    .venv/bin/python bench/pipeline.py --config bench/configs/pipeline8.toml --pp 4 --schedules 1f1b,1f1b-v2,zbh1-v2
    .venv/bin/python bench/pipeline.py --config bench/configs/pipeline8_wide.toml --warmup 1   # GEMM-bound; ~5 min

On a 2-core CPU with `--pp 2` each rank has one core; more ranks than cores make the ranks take turns and the
timeline shows the operating system's scheduling as much as the pipeline's.
"""

from __future__ import annotations

import functools
import statistics
import time
from pathlib import Path

import torch
from _common import (
    RESULTS_DIR,
    add_pipeline_run_arguments,
    environment_variables,
    make_parser,
    parse_choices,
    print_table,
    run_ranks,
    save_run,
)

REPO = Path(__file__).resolve().parents[1]
SCHEDULES = ("1f1b", "zbh1", "dualpipev", "1f1b-v2", "zbh1-v2")
# moe.trainer.pipeline.p2p.P2P_TRANSPORTS (main checks it; moe is imported lazily here)
TRANSPORTS = ("torch", "deepep")
# glibc's environment for `--allocator caching`: no block is ever handed back to the system (read when a process
# starts: the spawned ranks inherit it).
CACHING_MALLOC_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 40), "MALLOC_TOP_PAD_": str(1 << 28)}


def _config_path(config: str) -> Path:
    """A config name of examples/deepseek_v3/configs/ or a TOML file's path."""
    return (
        Path(config) if config.endswith(".toml") else REPO / "examples" / "deepseek_v3" / "configs" / f"{config}.toml"
    )


def schedule_of(name: str) -> tuple[str, int]:
    """'1f1b' -> ('1f1b', 1); 'zbh1-v2' -> ('zbh1', 2): the torch schedule and its virtual stages per rank."""
    schedule, _, virtual = name.partition("-v")
    if schedule not in ("1f1b", "zbh1", "dualpipev") or (virtual and not virtual.isdigit()):
        raise ValueError(f"unknown schedule {name!r}: 1f1b, zbh1, dualpipev, or 1f1b-vN / zbh1-vN")
    return schedule, int(virtual or 1)


def _build(name: str, transport: str, args):
    """A fresh model from the seed, pruned to this rank's stages of schedule `name`, and its runner on `transport`."""
    from moe.layer.phase_timer import PHASES, PhaseTimer
    from moe.trainer.models.deepseek_v3 import DeepseekV3Config, DeepseekV3ForCausalLM
    from moe.trainer.pipeline import PipelineRunner, TimelineRecorder, pipeline_moe_options
    from moe.trainer.pipeline.split import split_layers, stages_per_rank

    assert "p2p" in PHASES
    from moe.trainer.train.parallel_state import Layout, ParallelState

    schedule, virtual = schedule_of(name)
    cfg = DeepseekV3Config.from_toml(_config_path(args.config))
    layout = Layout(world=args.pp, pp=args.pp, pp_schedule=schedule, vpp=virtual)
    parallel = ParallelState.from_process_group(layout)
    torch.manual_seed(args.seed)
    model = DeepseekV3ForCausalLM(cfg, moe_options=pipeline_moe_options(schedule))
    num_stages = args.pp * stages_per_rank(schedule, virtual)
    first = args.decoder_first_pipeline_num_layers if num_stages == args.pp else None
    split = split_layers(cfg.num_hidden_layers, num_stages, first_stage_layers=first, virtual_stages=virtual)
    runner = PipelineRunner(model, parallel, schedule=schedule, split=split, micro_batches=args.micro_batches,
                            micro_rows=args.rows, seq_len=args.seq_len, mtp_loss_weight=cfg.mtp_loss_weight,
                            num_mtp=cfg.num_nextn_predict_layers, recorder=TimelineRecorder(parallel.pp_rank),
                            virtual_stages=virtual, p2p_transport=transport)  # fmt: skip
    runner.set_phase_timer(PhaseTimer())
    return cfg, parallel, model, runner


def _one_step(group, name: str, built, tokens, counts, step: int, args) -> dict:
    from moe.layer.phase_timer import PHASES
    from moe.trainer.pipeline import bubble_fraction, gather_timelines
    from moe.trainer.pipeline.timeline import analytic_bubble, analytic_bubble_fraction, expected_bubble_fraction

    schedule, virtual = schedule_of(name)
    _, parallel, model, runner = built
    # Gradients zeroed in place, as persistent gradient buffers are (Megatron's main_grad, ZeRO-1's buckets): a fresh
    # .grad per step would put its first-touch allocation into the first micro-batches' backward.
    model.zero_grad(set_to_none=False)
    torch.distributed.barrier(group=group)
    runner.phase_timer.take()
    start = time.perf_counter()
    runner.step(tokens, counts, step)
    elapsed = time.perf_counter() - start
    seconds = runner.phase_timer.take()[0]
    measured = torch.tensor([elapsed], dtype=torch.float64)
    torch.distributed.all_reduce(measured, op=torch.distributed.ReduceOp.MAX, group=group)
    p2p_share = torch.tensor([seconds[PHASES.index("p2p")] / elapsed], dtype=torch.float64)
    torch.distributed.all_reduce(p2p_share, group=group)
    timelines = gather_timelines(runner.recorder, parallel.pp_group)
    report = bubble_fraction(timelines)
    units = report.unit_times()
    w = units["W"] or 0.0
    analytic = [
        analytic_bubble_fraction(schedule, args.pp, args.micro_batches, units["F"], units["B"], w, units["F_and_B"],
                                 compute=rank.busy, virtual_stages=virtual)
        for rank in report.per_rank
    ]  # fmt: skip
    formula = expected_bubble_fraction(args.pp, args.micro_batches, virtual) if schedule == "1f1b" else None
    return {
        "step_s": float(measured[0]), "p2p_share": float(p2p_share[0]) / group.size(),
        "bubble": report.fraction, "formula_bubble": formula,
        "analytic_bubble": statistics.mean(analytic), "units": units, "timelines": timelines,
        "analytic_bubble_s": analytic_bubble(schedule, args.pp, units["F"], units["B"], w, units["F_and_B"]),
    }  # fmt: skip


def _inputs(cfg, args):
    from moe.trainer.train.trainer import target_counts

    gen = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, cfg.vocab_size, (args.micro_batches * args.rows, args.seq_len), generator=gen)
    return tokens, target_counts(tokens, cfg.num_nextn_predict_layers)


def _memory_worker(rank: int, world: int, group, args) -> dict[str, float]:
    """Per schedule, the largest rank's peak memory of one step after one warm-up step (see the docstring)."""
    from moe.layer.peak_memory import peak_memory_bytes

    del rank, world
    built = {run: _build(*run, args) for run in _runs(args)}
    tokens, counts = _inputs(next(iter(built.values()))[0], args)
    peaks = {}
    for run, (_, _, model, runner) in built.items():
        for step in (1, 2):
            for p in model.parameters():
                p.grad = None
            torch.distributed.barrier(group=group)
            peak = peak_memory_bytes(functools.partial(runner.step, tokens, counts, step))
        measured = torch.tensor([float(peak)], dtype=torch.float64)
        torch.distributed.all_reduce(measured, op=torch.distributed.ReduceOp.MAX, group=group)
        peaks[_label(*run)] = float(measured[0])
    for _, _, _, runner in built.values():
        runner.close()
    return peaks


def _runs(args) -> list[tuple[str, str]]:
    """(schedule, transport) of every run, a schedule's transports side by side."""
    return [(schedule, transport) for schedule in args.schedules for transport in args.transports]


def _label(schedule: str, transport: str) -> str:
    return schedule if transport == "torch" else f"{schedule}/{transport}"


def _grads_digest(model) -> torch.Tensor:
    """This rank's gradients as one float64 vector (the transports' comparison, bitwise)."""
    return torch.cat([p.grad.detach().reshape(-1).double() for p in model.parameters() if p.grad is not None])


def _worker(rank: int, world: int, group, args) -> dict:
    """All schedules built once; then step by step in turn (1F1B, ZB-H1, DualPipeV, 1F1B, ...), so that the load of
    a shared machine drifts over all of them alike."""
    from moe.trainer.pipeline.timeline import plot_timeline, write_chrome_trace

    del rank, world
    built = {run: _build(*run, args) for run in _runs(args)}
    tokens, counts = _inputs(next(iter(built.values()))[0], args)
    steps: dict[tuple[str, str], list[dict]] = {run: [] for run in built}
    for index in range(args.warmup + args.steps):
        for run in built:
            record = _one_step(group, run[0], built[run], tokens, counts, index + 1, args)
            if index >= args.warmup:
                steps[run].append(record)
    # The same steps from the same weights: each transport's gradients after the last one are the torch transport's.
    digests = {run: _grads_digest(built[run][2]) for run in built}
    same = {run: bool(torch.equal(digests[run], digests[(run[0], args.transports[0])])) for run in built}
    agreed = torch.tensor([all(same.values())], dtype=torch.int32)
    torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MIN, group=group)
    out = {}
    for run, records in steps.items():
        schedule, transport = run
        median = sorted(records, key=lambda s: s["step_s"])[len(records) // 2]
        runner = built[run][3]
        if built[run][1].pp_rank == 0:
            path = args.out_dir / f"pipeline_{_label(*run).replace('/', '_')}_pp{args.pp}"
            meta = {"schedule": schedule, "pp": args.pp, "micro_batches": args.micro_batches,
                    "virtual_stages": runner.virtual_stages}  # fmt: skip
            write_chrome_trace(path.with_suffix(".json"), median["timelines"], metadata=meta)
            plot_timeline(path.with_suffix(".png"), median["timelines"], f"{runner.describe()} ({args.config})")
        median.pop("timelines")
        median["bubble_all_steps"] = [r["bubble"] for r in records]
        median["bubble_of_median_step"] = median["bubble"]
        median["bubble"] = statistics.median(median["bubble_all_steps"])
        median["step_s_all_steps"] = [r["step_s"] for r in records]
        median["p2p_share"] = statistics.median(r["p2p_share"] for r in records)
        median["schedule"], median["transport"] = schedule, transport
        median["grads_equal_to_first_transport"] = bool(agreed[0])
        out[_label(*run)] = median
        runner.close()
    return out


def main() -> None:
    from moe.trainer.pipeline.p2p import P2P_TRANSPORTS
    from moe.trainer.pipeline.split import check_schedule

    assert TRANSPORTS == P2P_TRANSPORTS

    parser = make_parser(__doc__)
    parser.add_argument("--config", default="tiny", help="a name of examples/deepseek_v3/configs/ or a .toml path")
    parser.add_argument("--pp", type=int, default=2)
    add_pipeline_run_arguments(parser)
    parser.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None,
                        help="1F1B / ZB-H1: layers of the first stage (the last also runs the head and MTP); "
                        "DualPipeV's V puts the first and last stage on one rank")  # fmt: skip
    parser.add_argument("--schedules", default=",".join(SCHEDULES),
                        help="comma-separated: 1f1b, zbh1, dualpipev, 1f1b-vN, zbh1-vN (N stages a rank)")  # fmt: skip
    parser.add_argument("--transports", type=lambda text: parse_choices(text, TRANSPORTS), default=TRANSPORTS,
                        help="comma-separated P2P transports, each schedule runs on each: torch, deepep")  # fmt: skip
    parser.add_argument("--allocator", choices=("caching", "glibc"), default="caching",
                        help="the timed ranks' glibc settings (see the docstring)")  # fmt: skip
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory processes (a quick run)")
    parser.add_argument("--json", type=Path, default=RESULTS_DIR / "pipeline.json")
    args = parser.parse_args()
    args.schedules = [s.strip() for s in args.schedules.split(",") if s.strip()]
    for name in args.schedules:  # before any rank starts: a bad name, or micro-batches a schedule cannot run
        try:
            schedule, virtual = schedule_of(name)
            check_schedule(schedule, args.pp, args.micro_batches, virtual)
        except ValueError as exc:
            parser.error(f"--schedules {name}: {exc}")
    args.out_dir = args.json.parent
    args.out_dir.mkdir(parents=True, exist_ok=True)
    with environment_variables(CACHING_MALLOC_ENV if args.allocator == "caching" else {}):
        results = run_ranks(_worker, args.pp, (args,), timeout_s=1800)[0]
    peaks = {} if args.no_memory else run_ranks(_memory_worker, args.pp, (args,), timeout_s=1800)[0]
    for label, r in results.items():
        r["peak_bytes"] = peaks.get(label)
    base = results.get("1f1b")
    rows = []
    for r in results.values():
        vs = f"{r['bubble'] / base['bubble']:.2f}x" if base and base["bubble"] > 0 else "-"
        first = results[_label(r["schedule"], args.transports[0])]
        r["step_vs_first_transport"] = r["step_s"] / first["step_s"]
        rows.append([
            r["schedule"], r["transport"], f"{r['step_s'] * 1e3:.0f}", f"{r['step_vs_first_transport']:.2f}x",
            f"{100 * r['p2p_share']:.1f}%", f"{100 * r['bubble']:.1f}%", vs,
            f"{100 * r['analytic_bubble']:.1f}%",
            "-" if r["formula_bubble"] is None else f"{100 * r['formula_bubble']:.1f}%",
            f"{r['analytic_bubble_s'] * 1e3:.1f}",
            f"{r['units']['F'] * 1e3:.1f}", f"{r['units']['B'] * 1e3:.1f}",
            "-" if r["units"]["W"] is None else f"{r['units']['W'] * 1e3:.1f}",
            "-" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**20:.1f}",
        ])  # fmt: skip
    print(f"{args.config}, pp {args.pp}, {args.micro_batches} micro-batches of {args.rows} x {args.seq_len} tokens, "
          f"first stage layers {args.decoder_first_pipeline_num_layers or 'even'}, "
          f"allocator {args.allocator}")  # fmt: skip
    print_table(
        ("schedule", "p2p", "step ms", f"vs {args.transports[0]}", "p2p share", "bubble", "vs 1f1b", "analytic",
         "formula", "analytic ms/rank", "F ms", "B ms", "W ms", "peak MiB"),
        rows,
        f"vs {args.transports[0]}: step time over the same schedule's on the {args.transports[0]} transport; "
        "p2p share: the schedule's step outside its compute actions over the step (sends, receives, waits; median "
        "over the steps, mean over the ranks); gradients after the last step equal across the transports: "
        f"{all(r['grads_equal_to_first_transport'] for r in results.values())}",
        "bubble: idle / span over all ranks (median over the steps); analytic: DualPipe's formula from the measured "
        "F/B/W (per chunk); formula: (P-1)/(V m) of (interleaved) 1F1B as a share of the step, (P-1)/(V m + P-1); "
        f"traces and PNGs in {args.out_dir}/pipeline_<schedule>[_deepep]_pp{args.pp}.*",
    )  # fmt: skip
    save_run(args.json, args, results=results)


if __name__ == "__main__":
    main()
