"""Forward+backward throughput of the MoE layer at expert-parallel 1, 2 and 4: the 'flex' dispatcher (mtdeepep)
against the 'alltoall' baseline, and grouped vs padded-batch vs loop experts.

Setting (modest, for a small CPU; every size is a flag): hidden 1024, expert FFN 512, 16 experts, top-4 softmax
routing, 2048 tokens per rank, float32, dropless, no shared expert. One process per EP rank (torch.multiprocessing
spawn, gloo on 127.0.0.1, joined with a timeout); EP 1 is one process with a one-rank group, so 'flex' still goes
through an `mtdeepep.Buffer` (one rank) and 'alltoall' through its single-process path.

Variants (table rows): every dispatcher with grouped experts, then the 'flex' dispatcher with every other expert
implementation ('padded' = one `torch.bmm` over experts padded to the largest count, dropless; 'loop' = one matmul
per expert). `--grid` runs every (dispatcher, experts) pair instead. All variants hold the same weights and see the
same tokens; before timing, each variant's output and input gradient are compared with the first variant's.

Timing: one iteration = parameter grads set to None, `out = layer(x)`, `out.backward(grad_out)`; a gloo barrier
before every iteration so all ranks start together; variants alternate iteration by iteration (drifts of a noisy
machine hit them alike); each rank's median over `--iters` iterations after `--warmup`. The table shows the slowest
rank's median and tokens/s = tokens of all ranks / that time. Every rank runs `max(1, cores // ranks)` intra-op
threads (EP 4 on 2 cores oversubscribes: ranks take turns).

Run (about 2 minutes on a 2-core machine):

    .venv/bin/python bench/moe_layer.py                    # EP 1, 2, 4; table + bench/results/moe_layer.json
    .venv/bin/python bench/moe_layer.py --ep 2 --tokens 512 --iters 3

Communication overlap (`--overlap`; EP 2 and 4 by default; bench/results/moe_layer_overlap.json): how much of the
'flex' layer's communication time the compute placed beside it hides, forward and backward, with a shared expert
of `--shared-ffn`. A layer call has four communication phases, each from the call that starts it to the return of
the wait that ends it (the "window"):

    fwd dispatch      `dispatch_begin` -> the wait in `dispatch_end`; beside it: the shared expert's forward
                      (`moe_shared_expert_overlap`)
    fwd combine       `combine_begin` -> the wait in `combine_end`; nothing beside it
    bwd of combine    the combine's backward, a dispatch of the output gradients (synchronous); nothing beside it
    bwd of dispatch   the dispatch's backward, an asynchronous combine of the input gradients -> its wait; beside it:
                      the experts' delayed weight-gradient GEMMs (`overlap_dispatch_backward_with_experts_wgrad`)

Three layers with the same weights alternate iteration by iteration (barrier before each, as above):
- off: both options off: nothing runs in any window;
- serial: both options on, but the benchmark waits for each communication as soon as it has started (wrapping the
  start calls), so the compute meant to overlap it runs after it: per phase, the communication alone `C` (the
  window) and the compute alone `W` (the shared expert's forward timed by module hooks, the delayed GEMMs by
  wrapping `moe.layer.wgrad.WeightGradStore.run`, which the dispatch's backward runs at its in-flight point);
- on: both options on: the window `T` holds the communication and the compute `W_in` (timed the same way).
Per phase, the communication still exposed on this rank's critical path is `T - W_in` (window time spent outside the
compute: starting the communication, then waiting after the compute ended), and hidden = clip(C - (T - W_in), 0, C)
where compute ran inside the window (W_in > 0), else 0 (all of 'off', and the two phases with nothing beside them).
Overlapped fraction of communication time = sum of hidden / sum of C over the four phases, from each rank's medians
(the table: means over ranks). A window includes waiting for slower peers (load imbalance), which counts as
communication too: compute beside it hides that wait as well. The same run gives each mode's forward+backward time
and checks that every mode's outputs and gradients are bitwise those of 'off'. On a CPU the comm thread shares the
cores with the compute (EP 2 on 2 cores: two compute threads and two comm threads), so the compute beside a
communication may run slower (compare W_in with W): the fraction says how much communication left the critical path,
the fwd+bwd times what that was worth.

    .venv/bin/python bench/moe_layer.py --overlap --ep 2,4 --tokens 1024 --iters 5

Legend: T tokens per rank, H hidden, F expert FFN hidden, E experts, K top-k, R ranks (EP size).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from _common import (
    RESULTS_DIR,
    MoELayerBenchConfig,
    add_config_arguments,
    add_json_option,
    config_from_args,
    environment,
    make_parser,
    median,
    num_cores,
    parse_choices,
    parse_int_list,
    print_table,
    run_ranks,
    save_results,
    slowest_rank,
    threads_per_rank,
    time_variants,
    train_step,
)

import moe.layer.wgrad
from moe import MoEConfig, MoELayer

DISPATCHERS = ("alltoall", "flex")
EXPERT_IMPLS = ("grouped", "padded", "loop")


@dataclass(frozen=True)
class BenchConfig(MoELayerBenchConfig):
    dispatchers: tuple[str, ...] = DISPATCHERS
    expert_impls: tuple[str, ...] = EXPERT_IMPLS
    grid: bool = False
    shared_ffn: int = 1024  # --overlap: the shared expert's FFN hidden size

    def variants(self) -> list[tuple[str, str]]:
        """(dispatcher, experts) pairs: each dispatcher with the first expert implementation, then the last
        dispatcher with each other implementation (or every pair with `grid`)."""
        if self.grid:
            return [(d, e) for d in self.dispatchers for e in self.expert_impls]
        first = [(d, self.expert_impls[0]) for d in self.dispatchers]
        return first + [(self.dispatchers[-1], e) for e in self.expert_impls[1:]]


def variant_name(dispatcher: str, experts: str) -> str:
    return f"{dispatcher}/{experts}"


# ---------------------------------------------------------------------------------------------------------------
# One rank


def seeded_layer(cfg: BenchConfig, group: dist.ProcessGroup, **settings: Any) -> MoELayer:
    """The benchmark's layer (H, E, F, top-k, no load balancing) with the `MoEConfig` `settings` of one variant,
    built under the benchmark's seed: the same router and expert weights for every variant (each rank holds its
    own experts)."""
    config = MoEConfig(
        hidden_size=cfg.hidden,
        num_moe_experts=cfg.experts,
        moe_ffn_hidden_size=cfg.ffn,
        moe_router_topk=cfg.topk,
        moe_router_load_balancing_type="none",
        **settings,
    )
    torch.manual_seed(cfg.seed)
    return MoELayer(config, ep_group=group)


def build_layer(cfg: BenchConfig, dispatcher: str, experts: str, group: dist.ProcessGroup) -> MoELayer:
    """The layer of the variant (`dispatcher`, `experts`)."""
    return seeded_layer(
        cfg,
        group,
        moe_token_dispatcher_type=dispatcher,
        moe_grouped_gemm=experts != "loop",
        moe_padded_batch_gemm=experts == "padded",
    )


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def bench_rank(rank: int, num_ranks: int, group: dist.ProcessGroup, cfg: BenchConfig) -> dict[str, Any]:
    """Builds every variant, checks them against the first one, then times them interleaved."""
    gen = torch.Generator().manual_seed(cfg.seed * 1000 + rank + 1)
    x_TH = torch.randn(cfg.tokens, cfg.hidden, generator=gen)
    grad_TH = torch.randn(cfg.tokens, cfg.hidden, generator=gen)
    layers = {variant_name(d, e): build_layer(cfg, d, e, group) for d, e in cfg.variants()}

    # Parity (also the first warm-up): every rank runs every variant once, in the same order.
    parity, reference, dropped = {}, None, {}
    for name, layer in layers.items():
        out_TH, x_grad_TH = train_step(layer, x_TH, grad_TH)
        if reference is None:
            reference = (out_TH, x_grad_TH)
        parity[name] = {
            "output_rel_err": relative_error(out_TH, reference[0]),
            "x_grad_rel_err": relative_error(x_grad_TH, reference[1]),
        }
        dropped[name] = layer.metrics.num_dropped_tokens
    del reference

    fns = {name: (lambda layer=layer: train_step(layer, x_TH, grad_TH)) for name, layer in layers.items()}
    return {**time_variants(fns, cfg.iters, cfg.warmup, group), "parity": parity, "dropped": dropped}


# ---------------------------------------------------------------------------------------------------------------
# Report


def summarize(cfg: BenchConfig, num_ranks: int, per_rank: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per variant: the slowest rank's median time and the group's tokens/s."""
    rows = []
    baseline = variant_name(*cfg.variants()[0])
    for dispatcher, experts in cfg.variants():
        name = variant_name(dispatcher, experts)
        seconds = [r["seconds"][name] for r in per_rank]
        slowest = slowest_rank(seconds)
        rows.append(
            {
                "ep": num_ranks,
                "dispatcher": dispatcher,
                "experts": experts,
                "time_ms": seconds[slowest] * 1e3,
                "slowest_rank": slowest,
                "tokens_per_s": cfg.tokens * num_ranks / seconds[slowest],
                "per_rank_ms": [s * 1e3 for s in seconds],
                "samples_ms": [[s * 1e3 for s in r["samples"][name]] for r in per_rank],
                "parity_vs_" + baseline: [r["parity"][name] for r in per_rank],
                "dropped_slots": [r["dropped"][name] for r in per_rank],
            }
        )
    base_ms = rows[0]["time_ms"]
    for row in rows:
        row["speedup_vs_" + baseline] = base_ms / row["time_ms"]
    return rows


TABLE_HEADERS = ("EP", "dispatcher", "experts", "fwd+bwd ms", "tokens/s", "vs first row")


def table_row(row: dict[str, Any]) -> list[str]:
    speedup = next(v for k, v in row.items() if k.startswith("speedup_vs_"))
    return [
        str(row["ep"]),
        row["dispatcher"],
        row["experts"],
        f"{row['time_ms']:.1f}",
        f"{row['tokens_per_s']:.0f}",
        f"{speedup:.2f}x",
    ]


def worst_parity(rows: list[dict[str, Any]]) -> float:
    return max(
        max(p["output_rel_err"], p["x_grad_rel_err"])
        for row in rows
        for key, per_rank in row.items()
        if key.startswith("parity_vs_")
        for p in per_rank
    )


# ---------------------------------------------------------------------------------------------------------------
# Communication overlap (--overlap)

OVERLAP_MODES = ("off", "serial", "on")
PHASES = ("fwd dispatch", "fwd combine", "bwd of combine", "bwd of dispatch")


class PhaseClock:
    """Times the communication windows and the compute beside them of the layer running now (see the docstring).

    `start(mode)` before a layer call, `take()` after it: per phase, summed over the call, the window, the compute
    meant to overlap it wherever it ran ("compute") and the part of it that ran inside the open window
    ("compute_in"). `serial` makes every asynchronous start wait at once. `in_backward` tells the buffer's dispatch
    and combine calls of the backward from those of the forward."""

    def __init__(self) -> None:
        self.serial = False
        self.in_backward = False
        self.open: set[str] = set()
        self.sums: dict[str, dict[str, float]] = {}

    def start(self, serial: bool) -> None:
        self.serial, self.in_backward, self.open = serial, False, set()
        self.sums = {kind: dict.fromkeys(PHASES, 0.0) for kind in ("window", "compute", "compute_in")}

    def take(self) -> dict[str, dict[str, float]]:
        return self.sums

    def add_compute(self, phase: str, seconds: float) -> None:
        self.sums["compute"][phase] += seconds
        if phase in self.open:
            self.sums["compute_in"][phase] += seconds

    def timed_async(self, phase: str, start: float, event) -> None:
        """The window of `phase` started at `start` and ends when `event`'s wait returns (at once if serial)."""
        wait = event.current_stream_wait
        self.open.add(phase)

        def timed_wait(*args, **kwargs):
            result = wait(*args, **kwargs)
            self.sums["window"][phase] += time.perf_counter() - start
            self.open.discard(phase)
            event.current_stream_wait = wait  # once
            return result

        event.current_stream_wait = timed_wait
        if self.serial:
            event.current_stream_wait()

    def instrument(self, layer: MoELayer) -> None:
        """Wraps (on the instances) the layer's dispatcher calls and its shared expert."""
        disp = layer.dispatcher
        for name, phase in (("dispatch_begin", "fwd dispatch"), ("combine_begin", "fwd combine")):
            begin = getattr(disp, name)

            def timed_begin(*args, _begin=begin, _phase=phase):
                start = time.perf_counter()
                pending = _begin(*args)
                self.timed_async(_phase, start, pending.event)
                return pending

            setattr(disp, name, timed_begin)
        shared_start = []
        layer.shared_experts.register_forward_pre_hook(lambda *_: shared_start.append(time.perf_counter()))

        def shared_done(*_):
            self.add_compute("fwd dispatch", time.perf_counter() - shared_start.pop())

        layer.shared_experts.register_forward_hook(shared_done)

    def instrument_buffer(self, buffer) -> None:
        """Wraps the buffer's dispatch and combine (the backward's two communications; the layers share the buffer)."""
        dispatch, combine = buffer.dispatch, buffer.combine

        def timed_dispatch(*args, **kwargs):
            start = time.perf_counter()
            out = dispatch(*args, **kwargs)
            if self.in_backward:  # the combine's backward: synchronous
                self.sums["window"]["bwd of combine"] += time.perf_counter() - start
            return out

        def timed_combine(*args, **kwargs):
            start = time.perf_counter()
            out = combine(*args, **kwargs)
            if self.in_backward and kwargs.get("async_finish"):  # the dispatch's backward
                self.timed_async("bwd of dispatch", start, out[-1])
            return out

        buffer.dispatch, buffer.combine = timed_dispatch, timed_combine

    def instrument_wgrad(self) -> None:
        """Times the delayed weight-gradient GEMMs where the dispatch's backward runs them."""
        run = moe.layer.wgrad.WeightGradStore.run

        def timed_run(store):
            start = time.perf_counter()
            count = run(store)
            if count:
                self.add_compute("bwd of dispatch", time.perf_counter() - start)
            return count

        moe.layer.wgrad.WeightGradStore.run = timed_run


def overlap_layer(cfg: BenchConfig, mode: str, group: dist.ProcessGroup) -> MoELayer:
    on = mode != "off"
    return seeded_layer(
        cfg,
        group,
        moe_token_dispatcher_type="flex",
        moe_shared_expert_intermediate_size=cfg.shared_ffn,
        moe_shared_expert_overlap=on,
        overlap_dispatch_backward_with_experts_wgrad=on,
    )


def bench_overlap_rank(rank: int, num_ranks: int, group: dist.ProcessGroup, cfg: BenchConfig) -> dict[str, Any]:
    """Each mode's phase windows and compute per iteration (interleaved), its fwd+bwd time, and parity."""
    gen = torch.Generator().manual_seed(cfg.seed * 1000 + rank + 1)
    x_TH = torch.randn(cfg.tokens, cfg.hidden, generator=gen)
    grad_TH = torch.randn(cfg.tokens, cfg.hidden, generator=gen)
    layers = {mode: overlap_layer(cfg, mode, group) for mode in OVERLAP_MODES}
    clock = PhaseClock()
    train_step(layers["off"], x_TH, grad_TH)  # creates the group's buffer
    clock.instrument_buffer(layers["off"].dispatcher.buffer)
    clock.instrument_wgrad()
    for layer in layers.values():
        clock.instrument(layer)

    samples: dict[str, list] = {mode: [] for mode in OVERLAP_MODES}
    results = {}

    def step(mode: str):
        layer = layers[mode]
        for param in layer.parameters():
            param.grad = None
        clock.start(serial=mode == "serial")
        x_in = x_TH.detach().requires_grad_()
        out_TH = layer(x_in)
        clock.in_backward = True
        out_TH.backward(grad_TH)
        clock.in_backward = False
        samples[mode].append(clock.take())
        results[mode] = [out_TH.detach(), x_in.grad] + [p.grad for p in layer.parameters()]

    timing = time_variants({mode: (lambda m=mode: step(m)) for mode in OVERLAP_MODES}, cfg.iters, cfg.warmup, group)
    bitwise = {
        mode: all(torch.equal(a, b) for a, b in zip(results[mode], results["off"], strict=True))
        for mode in OVERLAP_MODES
    }
    keep = slice(len(samples["off"]) - cfg.iters, None)  # time_variants' warm-up iterations are not kept
    phases = {
        mode: {
            kind: {phase: median([s[kind][phase] for s in samples[mode][keep]]) for phase in PHASES}
            for kind in ("window", "compute", "compute_in")
        }
        for mode in OVERLAP_MODES
    }
    return {"seconds": timing["seconds"], "phases": phases, "bitwise_vs_off": bitwise}


def overlap_fractions(rank_result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """One rank's per-phase numbers for modes 'off' and 'on' (seconds): C (communication alone, the 'serial' window),
    W (the compute meant to overlap it, alone, 'serial'), W_in (compute timed inside this mode's window), T (the
    window), exposed = T - W_in, hidden = clip(C - exposed, 0, C) where W_in > 0 (else nothing can hide anything:
    0); and the overlapped fraction sum(hidden) / sum(C)."""
    serial = rank_result["phases"]["serial"]
    out = {}
    for mode in ("off", "on"):
        measured = rank_result["phases"][mode]
        per_phase = {}
        for phase in PHASES:
            comm_s, window_s = serial["window"][phase], measured["window"][phase]
            inside_s = measured["compute_in"][phase]
            exposed = max(window_s - inside_s, 0.0)
            per_phase[phase] = {
                "comm": comm_s,
                "compute": serial["compute"][phase],
                "compute_in_window": inside_s,
                "window": window_s,
                "exposed": exposed,
                "hidden": min(max(comm_s - exposed, 0.0), comm_s) if inside_s > 0 else 0.0,
            }
        total_comm = sum(p["comm"] for p in per_phase.values())
        total_hidden = sum(p["hidden"] for p in per_phase.values())
        out[mode] = {
            "phases": per_phase,
            "comm": total_comm,
            "hidden": total_hidden,
            "fraction": total_hidden / total_comm if total_comm > 0 else 0.0,
            "fwd_bwd": rank_result["seconds"][mode],
        }
    return out


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


PHASE_KEYS = ("comm", "compute", "compute_in_window", "window", "exposed", "hidden")


def summarize_overlap(num_ranks: int, per_rank: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows (EP, mode): the ranks' mean of each phase's numbers (ms), the overlapped fraction, fwd+bwd time."""
    fractions = [overlap_fractions(r) for r in per_rank]
    rows = []
    for mode in ("off", "on"):
        row: dict[str, Any] = {"ep": num_ranks, "mode": mode, "phases_ms": {}}
        for phase in PHASES:
            row["phases_ms"][phase] = {
                key: _mean([f[mode]["phases"][phase][key] for f in fractions]) * 1e3 for key in PHASE_KEYS
            }
        row["comm_ms"] = _mean([f[mode]["comm"] for f in fractions]) * 1e3
        row["hidden_ms"] = _mean([f[mode]["hidden"] for f in fractions]) * 1e3
        row["fraction"] = row["hidden_ms"] / row["comm_ms"] if row["comm_ms"] > 0 else 0.0
        row["fraction_per_rank"] = [f[mode]["fraction"] for f in fractions]
        row["fwd_bwd_ms"] = _mean([f[mode]["fwd_bwd"] for f in fractions]) * 1e3
        row["serial_fwd_bwd_ms"] = _mean([r["seconds"]["serial"] for r in per_rank]) * 1e3
        row["bitwise_vs_off"] = all(r["bitwise_vs_off"][mode] for r in per_rank)
        rows.append(row)
    return rows


OVERLAP_HEADERS = ("EP", "mode", "phase", "C ms", "W ms", "W_in ms", "T ms", "exposed ms", "hidden ms", "hidden")


def overlap_table_rows(row: dict[str, Any]) -> list[list[str]]:
    lines = []
    for phase in PHASES:
        v = row["phases_ms"][phase]
        percent = f"{100 * v['hidden'] / v['comm']:.0f}%" if v["comm"] > 0 else "-"
        lines.append(
            [str(row["ep"]), row["mode"], phase]
            + [f"{v[key]:.1f}" for key in ("comm", "compute", "compute_in_window", "window", "exposed", "hidden")]
            + [percent]
        )
    fraction = f"{100 * row['fraction']:.0f}%"
    lines.append([str(row["ep"]), row["mode"], "all 4", f"{row['comm_ms']:.1f}", "", "", "", "", "", fraction])
    return lines


def run_overlap(cfg: BenchConfig, ep_sizes: list[int], args: argparse.Namespace) -> None:
    rows, wall = [], {}
    for num_ranks in ep_sizes:
        start = time.perf_counter()
        per_rank = run_ranks(bench_overlap_rank, num_ranks, (cfg,), timeout_s=args.timeout)
        wall[num_ranks] = time.perf_counter() - start
        rows.extend(summarize_overlap(num_ranks, per_rank))
    threads = {n: threads_per_rank(n) for n in ep_sizes}
    print(
        f"'flex' layer, T={cfg.tokens} per rank, H={cfg.hidden}, F={cfg.ffn}, E={cfg.experts}, K={cfg.topk}, shared "
        f"expert F={cfg.shared_ffn}, float32; {num_cores()} cores, threads per rank {threads}; medians of "
        f"{cfg.iters} iterations after {cfg.warmup} warm-up(s), mean over ranks"
    )
    print_table(
        OVERLAP_HEADERS,
        [line for row in rows for line in overlap_table_rows(row)],
        "C: the phase's communication alone ('serial' run); W: the compute placed beside it, alone ('serial'); W_in: "
        "that compute inside this mode's window T; exposed = T - W_in; hidden = clip(C - exposed, 0, C); 'all 4': "
        "sum of hidden / sum of C. Where no compute ran inside the window (W_in = 0) nothing is hidden.",
    )
    print(
        "fwd+bwd ms: "
        + ", ".join(f"EP {r['ep']} {r['mode']} {r['fwd_bwd_ms']:.1f}" for r in rows)
        + " (serial "
        + ", ".join(f"EP {r['ep']} {r['serial_fwd_bwd_ms']:.1f}" for r in rows if r["mode"] == "on")
        + "); gradients bitwise equal to 'off': "
        + ", ".join(f"EP {r['ep']} {r['mode']} {r['bitwise_vs_off']}" for r in rows)
    )
    save_results(
        args.json if args.json != RESULTS_DIR / "moe_layer.json" else RESULTS_DIR / "moe_layer_overlap.json",
        {
            "config": asdict(cfg),
            "threads_per_rank": threads,
            "wall_seconds_per_ep": wall,
            "environment": environment(),
            "rows": rows,
        },
    )
    if not all(row["bitwise_vs_off"] for row in rows):
        raise SystemExit("the overlapped layer's outputs or gradients differ from the layer without overlap")


# ---------------------------------------------------------------------------------------------------------------
# Entry point


def parse_args() -> argparse.Namespace:
    defaults = BenchConfig()
    parser = make_parser(__doc__)
    parser.add_argument(
        "--ep", default=None, help="comma-separated expert-parallel sizes (default: 1,2,4; with --overlap 2,4)"
    )
    parser.add_argument("--overlap", action="store_true", help="measure the communication overlap (see above)")
    helps = {
        "tokens": "tokens per rank",
        "ffn": "expert FFN hidden size",
        "experts": "routed experts in total",
        "iters": "timed iterations per variant",
        "warmup": "untimed iterations per variant",
    }
    add_config_arguments(parser, defaults, ("tokens", "hidden", "ffn", "experts", "topk"), helps)
    parser.add_argument(
        "--dispatchers",
        type=lambda s: parse_choices(s, DISPATCHERS),
        default=defaults.dispatchers,
        help="comma-separated, the first is the baseline (default: alltoall,flex)",
    )
    parser.add_argument(
        "--expert-impls",
        type=lambda s: parse_choices(s, EXPERT_IMPLS),
        default=defaults.expert_impls,
        help="comma-separated (default: grouped,padded,loop)",
    )
    parser.add_argument("--grid", action="store_true", help="every (dispatcher, experts) pair")
    add_config_arguments(parser, defaults, ("iters", "warmup", "seed"), helps)
    add_config_arguments(parser, defaults, ("shared_ffn",), {"shared_ffn": "--overlap: shared expert FFN hidden"})
    parser.add_argument("--timeout", type=float, default=400, help="seconds allowed per EP size")
    add_json_option(parser, "moe_layer", help="(--overlap: moe_layer_overlap.json)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    cfg = config_from_args(BenchConfig, args)
    ep_sizes = parse_int_list(args.ep or ("2,4" if args.overlap else "1,2,4"))
    if args.overlap:
        run_overlap(cfg, ep_sizes, args)
        return
    rows, wall = [], {}
    for num_ranks in ep_sizes:
        start = time.perf_counter()
        per_rank = run_ranks(bench_rank, num_ranks, (cfg,), timeout_s=args.timeout)
        wall[num_ranks] = time.perf_counter() - start
        rows.extend(summarize(cfg, num_ranks, per_rank))

    threads = {n: threads_per_rank(n) for n in ep_sizes}
    print(
        f"T={cfg.tokens} per rank, H={cfg.hidden}, F={cfg.ffn}, E={cfg.experts}, K={cfg.topk}, float32, dropless; "
        f"{num_cores()} cores, threads per rank {threads}; median of {cfg.iters} iterations after {cfg.warmup} "
        f"warm-up(s); slowest rank"
    )
    worst = worst_parity(rows)
    print_table(
        TABLE_HEADERS,
        [table_row(row) for row in rows],
        "'vs first row' = time of the first row of the same EP size / this row's time. Parity with the first "
        f"variant (output and input grad, every rank): worst relative error {worst:.1e}",
    )
    save_results(
        args.json,
        {
            "config": asdict(cfg),
            "threads_per_rank": threads,
            "wall_seconds_per_ep": wall,
            "environment": environment(),
            "rows": rows,
        },
    )
    if worst > 1e-4:
        raise SystemExit(f"parity check failed: relative error {worst:.1e} > 1e-4")


if __name__ == "__main__":
    main()
