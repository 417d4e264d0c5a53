"""Per-step decode latency of expert-parallel DeepSeek-V3 generation on CPU ranks: the low-latency dispatcher
('flex_ll') against normal mode ('flex') and the all-to-all dispatcher, with and without the two-micro-batch overlap.

Setting: `examples/deepseek_v3/configs/<config>.toml`'s model (tiny: hidden 256, 4 layers, 8 routed experts of
which top-2 ... as configured) in bfloat16 with seeded random weights, on R gloo ranks of this host (R = 2 and 4), each
rank decoding `batch` sequences (1, 16, 64, 128 per rank) after an 8-token prefill on 'flex'. The MoE layers of a
decode step run on the dispatcher of the row (`decode_dispatch.DecodeDispatchers`); with the overlap the rank's batch
is split in two micro-batches interleaved at their MoE communications (generation.py `decode_step`).

Per row: the median step time over `--steps` timed steps (after `--warmup`) of the slowest rank; the ratio to
'flex_ll' without overlap at the same R and batch (in the same processes, so the machine's noise is shared); the
share of the step a rank spent inside dispatch / combine (the layers' `PhaseTimer`: without the overlap the whole
communication, with it only the exposed wait, since the other micro-batch computes during the rest).

On 2 cores the ranks share the cores (4 ranks: 2 per core), so the figures rank the dispatchers on this host; they
are not a GPU's latency. A timeline of one overlapped step (PNG and Perfetto JSON) is written for the largest R at
batch 16 on 'flex_ll'.

    .venv/bin/python bench/decode.py                         # table + bench/results/decode.json, decode_timeline.*
    .venv/bin/python bench/decode.py --ranks 2 --batches 1,16 --steps 5
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import make_parser, parse_int_list, print_table, save_run  # noqa: E402
from moe.layer.dispatcher import EPBuffers  # noqa: E402
from moe.layer.interleave import Interleaver  # noqa: E402
from moe.layer.phase_timer import PHASES, PhaseTimer  # noqa: E402
from moe.trainer.models.deepseek_v3 import DeepseekV3Config, DeepseekV3ForCausalLM, decode_timeline  # noqa: E402
from moe.trainer.models.deepseek_v3.decode import prefill  # noqa: E402
from moe.trainer.models.deepseek_v3.decode_dispatch import DecodeDispatch, DecodeDispatchers  # noqa: E402
from moe.trainer.models.deepseek_v3.generation import DecodeTrace, decode_step  # noqa: E402
from mtdeepep.utils.testing import run_ranks  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO / "bench" / "results"
DISPATCHERS = ("flex_ll", "flex", "alltoall")
PROMPT_LEN = 8


def _time_case(model, dispatchers, batch: int, overlap: bool, args, timer: PhaseTimer) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(args.seed + batch)
    vocab = model.config.vocab_size
    prompts = [torch.randint(0, vocab, (PROMPT_LEN,), generator=gen) for _ in range(batch)]
    cache, _ = prefill(model, prompts, PROMPT_LEN + args.warmup + args.steps)
    halves = (cache.rows(0, (batch + 1) // 2), cache.rows((batch + 1) // 2, batch)) if overlap else None
    interleaver = Interleaver(names=("A", "B")) if overlap else None
    trace = DecodeTrace()
    wait = 0.0
    try:
        with dispatchers.decode():
            for step in range(args.warmup + args.steps):
                timer.take()
                decode_step(model, torch.randint(0, vocab, (batch,), generator=gen), cache, halves, interleaver, trace)
                seconds, _, _ = timer.take()
                if step >= args.warmup:
                    wait += seconds[PHASES.index("dispatch")] + seconds[PHASES.index("combine")]
    finally:
        if interleaver is not None:
            interleaver.close()
    timed = trace.step_seconds[args.warmup :]
    return {
        "step_s": statistics.median(timed),
        "wait_share": wait / sum(timed),
        "last_events": trace.events[-1] if trace.events else None,
    }


def _worker(rank: int, world: int, group: dist.ProcessGroup, args) -> dict[str, Any]:
    torch.manual_seed(args.seed)
    config = DeepseekV3Config.from_toml(REPO / "examples" / "deepseek_v3" / "configs" / f"{args.config}.toml")
    ep_buffers = EPBuffers()
    options = {"moe_token_dispatcher_type": "flex"}
    if config.n_shared_experts:
        options["moe_shared_expert_overlap"] = True
    model = DeepseekV3ForCausalLM(
        config, ep_group=group, ep_buffers=ep_buffers, dtype=torch.bfloat16, moe_options=options
    ).eval()
    timer = PhaseTimer()
    for layer in model.moe_layers():
        layer.set_phase_timer(timer)
    T_max = max(args.batches)
    sets = {
        name: DecodeDispatchers(model, DecodeDispatch(decode=name, num_max_dispatch_tokens_per_rank=T_max), ep_buffers)
        for name in DISPATCHERS
    }
    rows = []
    with torch.no_grad():
        for batch in args.batches:
            for overlap in (False, True) if batch >= 2 else (False,):
                for name in DISPATCHERS:
                    result = _time_case(model, sets[name], batch, overlap, args, timer)
                    rows.append({"batch": batch, "dispatcher": name, "overlap": overlap, **result})
    ep_buffers.destroy()
    return {"rank": rank, "rows": rows}


def main() -> None:
    parser = make_parser(__doc__)
    parser.add_argument("--config", default="tiny", help="examples/deepseek_v3/configs/<name>.toml")
    parser.add_argument("--ranks", type=parse_int_list, default=[2, 4])
    parser.add_argument("--batches", type=parse_int_list, default=[1, 16, 64, 128], help="sequences per rank")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    parser.add_argument("--json", type=Path, default=RESULTS_DIR / "decode.json")
    args = parser.parse_args()
    table, results = [], {}
    for world in args.ranks:
        per_rank = run_ranks(_worker, world, (args,), timeout_s=1800, threads=args.threads)
        results[world] = per_rank
        rows = [r["rows"] for r in per_rank]
        base = {}
        for i, row in enumerate(rows[0]):
            step = max(rank_rows[i]["step_s"] for rank_rows in rows)  # the slowest rank's median
            wait = statistics.mean(rank_rows[i]["wait_share"] for rank_rows in rows)
            key = (row["batch"], row["overlap"])
            if row["dispatcher"] == "flex_ll" and not row["overlap"]:
                base[row["batch"]] = step
            ratio = step / base[row["batch"]]
            table.append([str(world), str(row["batch"]), row["dispatcher"], "yes" if key[1] else "no",
                          f"{step * 1e3:.2f}", f"{ratio:.2f}x", f"{wait:.0%}"])  # fmt: skip
        timeline_rows = [r for r in rows[0] if r["last_events"] and r["dispatcher"] == "flex_ll"]
        if world == max(args.ranks) and timeline_rows:
            batch = 16 if any(r["batch"] == 16 for r in timeline_rows) else timeline_rows[0]["batch"]
            index = next(i for i, r in enumerate(rows[0]) if r["last_events"] and r["dispatcher"] == "flex_ll"
                         and r["batch"] == batch)  # fmt: skip
            events = [rank_rows[index]["last_events"] for rank_rows in rows]
            out = args.json.parent / "decode_timeline"
            out.parent.mkdir(parents=True, exist_ok=True)
            title = f"{args.config}, ep {world}, {batch} sequences per rank, flex_ll, two micro-batches"
            decode_timeline.plot_step(out.with_suffix(".png"), events, title)
            decode_timeline.write_chrome_trace(out.with_suffix(".json"), events, {"batch": batch, "ranks": world})
            print(f"timeline: {out}.png, {out}.json")
    for per_rank in results.values():
        for r in per_rank:
            for row in r["rows"]:
                row.pop("last_events")
    print_table(
        ("ranks", "batch/rank", "decode dispatcher", "overlap", "step ms", "vs flex_ll", "in dispatch+combine"),
        table,
        "step ms: median decode step of the slowest rank; vs flex_ll: that over flex_ll without overlap (same ranks, "
        "batch, run); in dispatch+combine: the ranks' mean share of the step inside the MoE dispatch and combine "
        "(with the overlap: the exposed wait only).",
    )
    save_run(args.json, args, results={str(k): v for k, v in results.items()})


if __name__ == "__main__":
    main()
