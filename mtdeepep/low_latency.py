"""DeepEP's low-latency mode (`low_latency_dispatch` / `low_latency_combine`) on CPU ranks.

`Buffer(..., low_latency_mode=True)` owns one `LowLatencyBuffer`. Its region (`num_rdma_bytes`, a POSIX
shared-memory segment; size it with `Buffer.get_low_latency_rdma_size_hint`) holds a control area and two halves;
consecutive calls alternate halves, so the results of two calls can be alive at once, as upstream's double
buffering. Received tensors (`recv_x` and its scales) are views into the current half: a third call overwrites
the first one's.

Transports (chosen once, at set-up):

- shared memory, when every rank is on one node (`Buffer(num_ranks_per_node=...)`): the sender casts its
  tokens (FP8 or not) and writes each (token, expert) row straight into the receiver's slot for that expert in
  the receiver's mapped region, then publishes a per-source signal; the receiver waits for every source's signal.
- collective, when the ranks span several nodes: the sender packs one message per (token, expert) row per
  destination and `torch.distributed.all_to_all_single` moves them over the group's backend; the receiver
  unpacks them into the same layout of its own region. Both transports give the same rows (each source's rows
  for an expert are one contiguous segment in token order; the collective transport orders segments by source
  rank, the shared-memory one by arrival) and bitwise the same combine.

Waits and errors: bad arguments raise ValueError before anything is sent. Every shared-memory wait is bounded by
the buffer's timeout and raises `CommTimeoutError` naming the ranks and phase that did not arrive; a peer that
exited or destroyed its buffer ends the wait at once (`CommError`); ranks that made different calls all raise
`GroupMismatchError` and the buffer stays usable. After a timeout, every rank calls `clean_low_latency_buffer`
to start over. The collective transport relies on the backend's timeout, which does not name the missing ranks,
and leaves the `*_wait_recv_cost_stats` tensors untouched.

Legend: T tokens of this rank (<= T_max = num_max_dispatch_tokens_per_rank), K top-k slots, H hidden,
R ranks, E experts, E_local = E / R experts per rank.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from . import _C
from ._checks import MAX_EXPERTS, check_tensor
from .event import EventOverlap

FP8_BLOCK = 128


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(f"mtdeepep: {message}")


def _check_int(name: str, value, minimum: int = 1) -> int:
    _require(isinstance(value, int) and not isinstance(value, bool) and value >= minimum,
             f"{name} must be an int >= {minimum}, got {value!r}")  # fmt: skip
    return value


class _Completion:
    """Finishes a collective-transport call once: `wait()` (the hook, or the event's wait) waits for the all-to-all
    and unpacks; `query()` does the same if the all-to-all already finished, and never blocks otherwise."""

    def __init__(self, work: dist.Work, finish: Callable[[], None], timeout_s: float, phase: str, rank: int) -> None:
        self._work, self._finish = work, finish
        self._timeout_s, self._phase, self._rank = timeout_s, phase, rank
        self._done = False

    def wait(self) -> None:
        if self._done:
            return
        _wait_work(self._work, self._timeout_s, self._phase, self._rank)
        self._done = True
        self._finish()

    def query(self) -> bool:
        if not self._done and self._work.is_completed():
            self.wait()
        return self._done


def _wait_work(work: dist.Work, timeout_s: float, phase: str, rank: int) -> None:
    try:
        finished = work.wait(timeout=timedelta(seconds=timeout_s))
    except RuntimeError as error:
        raise _C.CommTimeoutError(
            f"mtdeepep: rank {rank} failed in phase '{phase}' (collective transport): {error}"
        ) from error
    if finished is False:
        raise _C.CommTimeoutError(
            f"mtdeepep: rank {rank} timed out after {timeout_s} s in phase '{phase}' (collective transport): "
            "the all-to-all did not finish (the backend does not say which ranks are missing)"
        )


class LowLatencyBuffer:
    """The low-latency part of a `Buffer`; `Buffer` delegates its `low_latency_*` methods here.

    Set-up is two-step so that `Buffer` keeps one bootstrap gather: `setup_string()` goes into the gathered string,
    then `sync(entries, nodes)` with every rank's string and node id.
    """

    def __init__(self, group: dist.ProcessGroup, num_rdma_bytes: int, timeout_s: float) -> None:
        self.group = group
        self.rank = group.rank()
        self.num_ranks = group.size()
        self.num_rdma_bytes = int(num_rdma_bytes)
        self.timeout_s = float(timeout_s)
        self.transport: str | None = None  # "shared-memory" or "collective", set by sync()
        self.runtime = _C.LowLatencyRuntime(
            self.rank, self.num_ranks, self.num_rdma_bytes, self.timeout_s, torch.get_num_threads()
        )

    # ---------------------------------------------------------------------------------------------------------
    # Set-up and lifetime

    @staticmethod
    def size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int) -> int:
        """Bytes of the region for these arguments: a control area (signals and counters) and two halves, each
        with the dispatch receive slots (`[E_local, R * T_max]` rows of `H` bfloat16 plus float32 scales, source
        indices and per-source ranges) and the combine receive area (`[E, T_max, H]` bfloat16)."""
        return _C.LowLatencyRuntime.size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)

    def setup_string(self) -> str:
        return f"{self.runtime.segment_name()}\t{self.runtime.pid()}\t{self.num_rdma_bytes}"

    def sync(self, entries: list[str], nodes: list[int]) -> None:
        """Every rank's `setup_string()` and node id: map the peers' regions when all ranks are on one node, else
        use the collective transport (only this rank's region is used)."""
        fields = [entry.split("\t") for entry in entries]
        sizes = sorted({int(size) for _, _, size in fields})
        _require(len(sizes) == 1, f"ranks disagree on num_rdma_bytes ({sizes}) in low-latency mode")
        if len(set(nodes)) > 1:
            self.runtime.sync_local()
            self.transport = "collective"
        else:
            self.runtime.sync([name for name, _, _ in fields], [int(pid) for _, pid, _ in fields])
            self.transport = "shared-memory"

    def set_timeout(self, timeout_s: float) -> None:
        self.timeout_s = float(timeout_s)
        self.runtime.set_timeout(self.timeout_s)

    def destroy(self) -> None:
        self.runtime.destroy()

    # ---------------------------------------------------------------------------------------------------------
    # Dispatch

    def dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        num_max_dispatch_tokens_per_rank: int,
        num_experts: int,
        cumulative_local_expert_recv_stats: torch.Tensor | None,
        dispatch_wait_recv_cost_stats: torch.Tensor | None,
        use_fp8: bool,
        round_scale: bool,
        use_ue8m0: bool,
        async_finish: bool,
        return_recv_hook: bool,
    ):
        """See `Buffer.low_latency_dispatch`."""
        x, topk_idx = self._check_dispatch(
            x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, cumulative_local_expert_recv_stats,
            dispatch_wait_recv_cost_stats, use_fp8, round_scale, use_ue8m0, async_finish, return_recv_hook,
        )  # fmt: skip
        self.runtime.set_num_threads(torch.get_num_threads())
        args = (num_max_dispatch_tokens_per_rank, num_experts, use_fp8, round_scale, use_ue8m0)
        if self.transport == "collective":
            recv_x, recv_scales, recv_count, src_info, layout_range, event, hook = self._collective_dispatch(
                x, topk_idx, cumulative_local_expert_recv_stats, *args, async_finish, return_recv_hook
            )
        else:
            recv_x, recv_scales, recv_count, src_info, layout_range, event, hook = self.runtime.dispatch(
                x, topk_idx, cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats, *args, async_finish,
                return_recv_hook,
            )  # fmt: skip
        handle = (src_info, layout_range, num_max_dispatch_tokens_per_rank, x.size(1), num_experts)
        keep = None
        if async_finish:
            keep = (x, topk_idx, recv_x, recv_count, src_info, layout_range)
            keep += tuple(t for t in (recv_scales, cumulative_local_expert_recv_stats) if t is not None)
        recv = (recv_x, recv_scales) if use_fp8 else recv_x
        return recv, recv_count, handle, EventOverlap(event, keep), hook

    def _check_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, cumulative_stats,
                        wait_stats, use_fp8, round_scale, use_ue8m0, async_finish, return_recv_hook):  # fmt: skip
        cpu = torch.device("cpu")
        _check_int("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank)
        self._check_num_experts(num_experts)
        check_tensor("x", x, dim=2, dtypes=(torch.bfloat16,), device=cpu)
        check_tensor("topk_idx", topk_idx, dim=2, dtypes=(torch.int64,), device=cpu)
        _require(topk_idx.size(0) == x.size(0), f"topk_idx has {topk_idx.size(0)} rows but x has {x.size(0)} tokens")
        _require(x.size(0) <= num_max_dispatch_tokens_per_rank,
                 f"x has {x.size(0)} tokens, more than num_max_dispatch_tokens_per_rank="
                 f"{num_max_dispatch_tokens_per_rank}")  # fmt: skip
        _require(topk_idx.size(1) <= num_experts, f"top-k {topk_idx.size(1)} exceeds num_experts={num_experts}")
        _require(x.size(1) > 0, "hidden must be positive")
        if use_fp8:
            _require(x.size(1) % FP8_BLOCK == 0, f"FP8 dispatch needs hidden % 128 == 0, got hidden={x.size(1)}")
            _require(round_scale or not use_ue8m0, "use_ue8m0 needs round_scale=True")
        _require(not (async_finish and return_recv_hook), "async_finish and return_recv_hook cannot both be set")
        num_local_experts = num_experts // self.num_ranks
        if cumulative_stats is not None:
            check_tensor("cumulative_local_expert_recv_stats", cumulative_stats, dtypes=(torch.int32,),
                         shape=(num_local_experts,), device=cpu)  # fmt: skip
            _require(cumulative_stats.is_contiguous(), "cumulative_local_expert_recv_stats must be contiguous")
        if wait_stats is not None:
            check_tensor("dispatch_wait_recv_cost_stats", wait_stats, dtypes=(torch.int64,),
                         shape=(self.num_ranks,), device=cpu)  # fmt: skip
            _require(wait_stats.is_contiguous(), "dispatch_wait_recv_cost_stats must be contiguous")
        return x.contiguous(), topk_idx.contiguous()

    def _check_num_experts(self, num_experts) -> None:
        _check_int("num_experts", num_experts)
        _require(num_experts % self.num_ranks == 0, f"num_experts={num_experts} is not divisible by the "
                 f"{self.num_ranks} ranks")  # fmt: skip
        _require(num_experts // self.num_ranks <= MAX_EXPERTS, f"num_experts={num_experts} is too large")

    def _collective_dispatch(self, x, topk_idx, cumulative_stats, num_max_dispatch_tokens_per_rank, num_experts,
                             use_fp8, round_scale, use_ue8m0, async_finish, return_recv_hook):  # fmt: skip
        op, messages, send_info, recv_x, recv_scales, recv_count, src_info, layout_range = (
            self.runtime.collective_dispatch_send(
                x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, use_fp8, round_scale, use_ue8m0
            )
        )
        # Sizes and call signatures first ([R, 6] int64: bytes, kind, hidden, T_max, E, flags), then the rows.
        phase = "low-latency dispatch: all-to-all"
        recv_info = torch.empty_like(send_info)
        _wait_work(dist.all_to_all_single(recv_info, send_info, group=self.group, async_op=True),
                   self.timeout_s, phase + " of the sizes", self.rank)  # fmt: skip
        recv_bytes, send_bytes = recv_info[:, 0].tolist(), send_info[:, 0].tolist()
        received = torch.empty(sum(recv_bytes), dtype=torch.uint8)
        work = dist.all_to_all_single(received, messages, recv_bytes, send_bytes, group=self.group, async_op=True)

        def finish() -> None:
            self.runtime.collective_dispatch_recv(op, received, recv_info, cumulative_stats)

        completion = _Completion(work, finish, self.timeout_s, phase, self.rank)
        event, hook = self._complete(completion, async_finish, return_recv_hook)
        return recv_x, recv_scales, recv_count, src_info, layout_range, event, hook

    @staticmethod
    def _complete(completion: _Completion, async_finish: bool, return_recv_hook: bool):
        """(event, hook) of a collective-transport call: finished now, by the event's wait, or by the hook."""
        if return_recv_hook:
            return None, completion.wait
        if async_finish:
            return completion, None
        completion.wait()
        return None, None

    # ---------------------------------------------------------------------------------------------------------
    # Combine

    def combine(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        handle: tuple,
        use_logfmt: bool,
        zero_copy: bool,
        async_finish: bool,
        return_recv_hook: bool,
        out: torch.Tensor | None,
        combine_wait_recv_cost_stats: torch.Tensor | None,
    ):
        """See `Buffer.low_latency_combine`."""
        src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden, num_experts = self._check_handle(handle)
        x, topk_idx, topk_weights = self._check_combine(
            x, topk_idx, topk_weights, hidden, num_max_dispatch_tokens_per_rank, num_experts, use_logfmt,
            async_finish, return_recv_hook, out, combine_wait_recv_cost_stats,
        )  # fmt: skip
        self.runtime.set_num_threads(torch.get_num_threads())
        args = (num_max_dispatch_tokens_per_rank, num_experts, zero_copy)
        if self.transport == "collective":
            combined, event, hook = self._collective_combine(
                x, topk_idx, topk_weights, src_info, layout_range, *args, out, async_finish, return_recv_hook
            )
        else:
            combined, event, hook = self.runtime.combine(
                x, topk_idx, topk_weights, src_info, layout_range, combine_wait_recv_cost_stats, *args, async_finish,
                return_recv_hook, out,
            )  # fmt: skip
        keep = (x, topk_idx, topk_weights, src_info, layout_range, combined) if async_finish else None
        return combined, EventOverlap(event, keep), hook

    def _check_handle(self, handle) -> tuple:
        _require(isinstance(handle, tuple) and len(handle) == 5,
                 "handle must be the 5-tuple returned by low_latency_dispatch")  # fmt: skip
        src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden, num_experts = handle
        _check_int("handle's num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank)
        _check_int("handle's hidden", hidden)
        self._check_num_experts(num_experts)
        num_local_experts = num_experts // self.num_ranks
        rows = self.num_ranks * num_max_dispatch_tokens_per_rank
        check_tensor("handle's src_info", src_info, dtypes=(torch.int32,), shape=(num_local_experts, rows))
        check_tensor("handle's layout_range", layout_range, dtypes=(torch.int64,),
                     shape=(num_local_experts, self.num_ranks))  # fmt: skip
        return src_info.contiguous(), layout_range.contiguous(), num_max_dispatch_tokens_per_rank, hidden, num_experts

    def _check_combine(self, x, topk_idx, topk_weights, hidden, num_max_dispatch_tokens_per_rank, num_experts,
                       use_logfmt, async_finish, return_recv_hook, out, wait_stats):  # fmt: skip
        cpu = torch.device("cpu")
        _require(not use_logfmt, "use_logfmt=True (LogFMT-compressed combine) is not supported; pass use_logfmt=False")
        _require(not (async_finish and return_recv_hook), "async_finish and return_recv_hook cannot both be set")
        num_local_experts = num_experts // self.num_ranks
        check_tensor("x", x, dtypes=(torch.bfloat16,), device=cpu,
                     shape=(num_local_experts, self.num_ranks * num_max_dispatch_tokens_per_rank, hidden))  # fmt: skip
        check_tensor("topk_idx", topk_idx, dim=2, dtypes=(torch.int64,), device=cpu)
        _require(topk_idx.size(0) <= num_max_dispatch_tokens_per_rank,
                 f"topk_idx has {topk_idx.size(0)} tokens, more than num_max_dispatch_tokens_per_rank="
                 f"{num_max_dispatch_tokens_per_rank}")  # fmt: skip
        check_tensor("topk_weights", topk_weights, dtypes=(torch.float32,), shape=tuple(topk_idx.shape), device=cpu)
        if out is not None:
            check_tensor("out", out, dtypes=(torch.bfloat16,), shape=(topk_idx.size(0), hidden), device=cpu)
            _require(out.is_contiguous(), "out must be contiguous")
        if wait_stats is not None:
            check_tensor("combine_wait_recv_cost_stats", wait_stats, dtypes=(torch.int64,),
                         shape=(self.num_ranks,), device=cpu)  # fmt: skip
            _require(wait_stats.is_contiguous(), "combine_wait_recv_cost_stats must be contiguous")
        return x.contiguous(), topk_idx.contiguous(), topk_weights.contiguous()

    def _collective_combine(self, x, topk_idx, topk_weights, src_info, layout_range, num_max_dispatch_tokens_per_rank,
                            num_experts, zero_copy, out, async_finish, return_recv_hook):  # fmt: skip
        op, messages, send_bytes, recv_bytes, combined = self.runtime.collective_combine_send(
            x, topk_idx, topk_weights, src_info, layout_range, num_max_dispatch_tokens_per_rank, num_experts,
            zero_copy, out,
        )  # fmt: skip
        received = torch.empty(int(recv_bytes.sum()), dtype=torch.uint8)
        work = dist.all_to_all_single(
            received, messages, recv_bytes.tolist(), send_bytes.tolist(), group=self.group, async_op=True
        )

        def finish() -> None:
            self.runtime.collective_combine_recv(op, received)

        completion = _Completion(work, finish, self.timeout_s, "low-latency combine: all-to-all", self.rank)
        event, hook = self._complete(completion, async_finish, return_recv_hook)
        return combined, event, hook

    # ---------------------------------------------------------------------------------------------------------
    # Buffer management

    def clean(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """See `Buffer.clean_low_latency_buffer`."""
        _check_int("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank)
        _check_int("hidden", hidden)
        self._check_num_experts(num_experts)
        if self.transport == "collective":
            dist.barrier(group=self.group)
            self.runtime.clean(num_max_dispatch_tokens_per_rank, hidden, num_experts)
            dist.barrier(group=self.group)
        else:
            self.runtime.clean(num_max_dispatch_tokens_per_rank, hidden, num_experts)

    def next_combine_buffer(self, handle: tuple) -> torch.Tensor:
        """See `Buffer.get_next_low_latency_combine_buffer`."""
        _, _, num_max_dispatch_tokens_per_rank, hidden, num_experts = self._check_handle(handle)
        return self.runtime.next_combine_buffer(num_max_dispatch_tokens_per_rank, hidden, num_experts)
