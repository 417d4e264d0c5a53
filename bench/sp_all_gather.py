"""Sequence-parallel all-gathers: the process group's `all_gather_into_tensor` against DeepEP 2.1's
`ElasticBuffer.all_gather`, in one run, as ratios.

The trainer's sequence-parallel regions gather `[S / tp, ...]` parts into `[S, ...]` along the sequence
(`moe/layer/parallel/mappings.py` `_all_gather_seq`: one `all_gather_into_tensor` on the TP group). Measured here per
gather, on `--tp` processes (gloo on 127.0.0.1), for each hidden size of `--hidden` with `[seq_len / tp, rows,
hidden]` parts:

- `process group`: `dist.all_gather_into_tensor` into a fresh `[S, rows, hidden]` tensor (what the trainer runs);
- `agrs`: `all_gather` of an `ElasticBuffer` over the same ranks inside a session, waited on at once; its result is a
  view of the session area, valid until the area is reused, so the trainer (whose gathered activations live until the
  backward) would copy it out: `agrs + copy` adds that copy;
- `agrs in place`: the part written into `agrs_get_inplace_tensor`'s slot (the copy the layer would make instead of
  writing its output there), then `all_gather` of that slot, and the copy out.

Every rank runs the same gathers in turn (process group, agrs, agrs in place, ...), `--warmup` untimed then
`--iters` timed rounds; reported: the median over the rounds of the slowest rank's time, and the ratio to the process
group's. A session holds `--gathers-per-session` gathers (upstream's use: a session per layer or step); a new one
starts when it is full.

    .venv/bin/python bench/sp_all_gather.py                        # TP 2, hidden 256 and 2048, 128 tokens
    .venv/bin/python bench/sp_all_gather.py --tp 4 --seq-len 1024 --hidden 7168
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from _common import RESULTS_DIR, make_parser, print_table, run_ranks, save_run

METHODS = ("process group", "agrs", "agrs + copy", "agrs in place")


def _measure(rank: int, group, hidden: int, args) -> dict[str, list[float]]:
    """The timed rounds of every method for one hidden size (see the module docstring)."""
    from mtdeepep.elastic import ElasticBuffer

    part = torch.randn(args.seq_len // args.tp, args.rows, hidden, generator=torch.Generator().manual_seed(rank))
    session_bytes = args.gathers_per_session * ElasticBuffer.get_agrs_num_max_session_bytes(
        group, tuple(part.shape), part.dtype
    )
    buffer = ElasticBuffer(group, num_bytes=ElasticBuffer.get_agrs_buffer_size_hint(group, session_bytes),
                           explicitly_destroy=True)  # fmt: skip
    buffer.agrs_set_config(session_bytes, args.gathers_per_session)
    state = {"gathers": 0, "open": False}

    def session():
        if state["open"] and state["gathers"] == args.gathers_per_session:
            buffer.destroy_agrs_session()
            state["open"] = False
        if not state["open"]:
            buffer.create_agrs_session()
            state.update(open=True, gathers=0)
        state["gathers"] += 1

    def process_group():
        whole = part.new_empty((args.tp * part.size(0), *part.shape[1:]))
        dist.all_gather_into_tensor(whole, part, group=group)
        return whole

    def agrs(copy: bool):
        session()
        gathered, handle = buffer.all_gather(part)
        handle()
        return gathered.flatten(0, 1).clone() if copy else gathered

    def agrs_in_place():
        session()
        slot = buffer.agrs_get_inplace_tensor(tuple(part.shape), part.dtype)
        slot.copy_(part)
        gathered, handle = buffer.all_gather(slot)
        handle()
        return gathered.flatten(0, 1).clone()

    runs = {"process group": process_group, "agrs": lambda: agrs(False), "agrs + copy": lambda: agrs(True),
            "agrs in place": agrs_in_place}  # fmt: skip
    try:
        expected = process_group()
        for name, run in runs.items():  # the same bytes
            assert torch.equal(run().reshape(expected.shape), expected), name
        times: dict[str, list[float]] = {name: [] for name in METHODS}
        for index in range(args.warmup + args.iters):
            for name, run in runs.items():
                dist.barrier(group=group)
                start = time.perf_counter()
                run()
                elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
                if index >= args.warmup:
                    times[name].append(float(elapsed[0]))
        if state["open"]:
            buffer.destroy_agrs_session()
    finally:
        buffer.destroy()
    return times


def _worker(rank: int, world: int, group, args) -> dict:
    del world
    return {hidden: _measure(rank, group, hidden, args) for hidden in args.hidden}


def main() -> None:
    parser = make_parser(__doc__)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--rows", type=int, default=1, help="sequences per micro-batch")
    parser.add_argument("--hidden", type=lambda text: [int(v) for v in text.split(",")], default=[256, 2048])
    parser.add_argument("--gathers-per-session", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--json", type=Path, default=RESULTS_DIR / "sp_all_gather.json")
    args = parser.parse_args()
    if args.seq_len % args.tp:
        parser.error(f"--seq-len {args.seq_len} must be a multiple of --tp {args.tp}")
    times = run_ranks(_worker, args.tp, (args,), timeout_s=1800)[0]
    rows, results = [], {}
    for hidden, per_method in times.items():
        base = statistics.median(per_method["process group"])
        results[hidden] = {}
        for name in METHODS:
            median = statistics.median(per_method[name])
            results[hidden][name] = {"median_s": median, "vs_process_group": median / base, "all_s": per_method[name]}
            rows.append([str(hidden), name, f"{median * 1e6:.0f}", f"{median / base:.2f}x"])
    part_bytes = args.seq_len // args.tp * args.rows * 4
    print(f"tp {args.tp}, parts of [{args.seq_len // args.tp}, {args.rows}, hidden] float32 ({part_bytes} x hidden "
          f"bytes), {args.iters} rounds after {args.warmup}")  # fmt: skip
    print_table(("hidden", "method", "us / gather", "vs process group"), rows,
                "median over the rounds of the slowest rank's time; agrs + copy: what the trainer would run",
                )  # fmt: skip
    save_run(args.json, args, results=results)


if __name__ == "__main__":
    main()
