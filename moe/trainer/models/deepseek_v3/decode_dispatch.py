"""Which token dispatcher the MoE layers use in each phase of expert-parallel generation, as DeepSeek's inference runs
them: the prefill (many tokens per rank, throughput-bound) on normal-mode dispatch ('flex'), each decode step (a few
tokens per rank, latency-bound) on the low-latency kernels ('flex_ll': BF16 rows, or FP8 with 1x128 scales; the
combine accumulates in FP32).

A built `MoELayer` keeps its dispatcher; `DecodeDispatchers` builds a second one per layer over the same group and
`EPBuffers` (the decode phase's) and swaps it in for the decode steps (`with dispatchers.decode(): ...`). Both serve
the same experts on the same ranks, so the swap changes how rows travel, never where they go.

Dtype: the low-latency kernels move BF16 (or FP8) rows only, as DeepEP's do. A float32 model therefore decodes on
'flex' by default (`default_decode_dispatcher`), and asking for 'flex_ll' with it is refused.

Batch bound: 'flex_ll' sizes its buffer for `num_max_dispatch_tokens_per_rank` tokens per rank and every rank must
use the same value; a decode batch above it is refused before any process group exists
(`check_decode_batch`) rather than when the first rank dispatches and the others wait for it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from moe.layer.dispatcher import EPBuffers
from moe.layer.dispatcher.base import TokenDispatcher
from moe.layer.dispatcher.flex_ll import DEFAULT_MAX_DISPATCH_TOKENS_PER_RANK
from moe.layer.dispatcher.registry import build_dispatcher
from moe.layer.moe_layer import MoELayer

DECODE_DISPATCHERS = ("flex_ll", "flex", "alltoall")
PREFILL_DISPATCHERS = ("flex", "alltoall")
LOW_LATENCY_DTYPES = (torch.bfloat16,)


@dataclass(frozen=True)
class DecodeDispatch:
    """How the MoE layers communicate during generation (only used with expert parallelism).

    prefill: the prompts' dispatcher ('flex' or 'alltoall').
    decode: the decode steps' dispatcher ('flex_ll', 'flex' or 'alltoall'); None: `default_decode_dispatcher`.
    num_max_dispatch_tokens_per_rank: 'flex_ll''s T_max: the most tokens any rank dispatches in one decode call
        (each rank's batch, or each half of it with the two-micro-batch overlap).
    fp8: 'flex_ll' sends the rows as E4M3 with one float32 scale per 128 channels (hidden_size % 128 == 0).
    """

    prefill: str = "flex"
    decode: str | None = None
    num_max_dispatch_tokens_per_rank: int = DEFAULT_MAX_DISPATCH_TOKENS_PER_RANK
    fp8: bool = False

    def resolved(self, dtype: torch.dtype, hidden_size: int | None = None) -> DecodeDispatch:
        """This plan with `decode` filled in for a model of `dtype`, checked (`check_decode_dispatch`, with the
        model's `hidden_size` when given)."""
        plan = self
        if plan.decode is None:
            plan = dataclasses.replace(self, decode=default_decode_dispatcher(dtype, self.fp8))
        check_decode_dispatch(plan, dtype, hidden_size)
        return plan


def default_decode_dispatcher(dtype: torch.dtype, fp8: bool = False) -> str:
    """'flex_ll' for a BF16 model or FP8 rows (the low-latency kernels move BF16 or FP8 rows only); 'flex'
    otherwise."""
    return "flex_ll" if fp8 or dtype in LOW_LATENCY_DTYPES else "flex"


def check_decode_dispatch(plan: DecodeDispatch, dtype: torch.dtype, hidden_size: int | None = None) -> None:
    """ValueError for a plan the model cannot run: unknown dispatcher names, 'flex_ll' with a model dtype it does
    not move, FP8 dispatch on another dispatcher or with `hidden_size % 128`, a non-positive T_max."""
    if plan.prefill not in PREFILL_DISPATCHERS:
        raise ValueError(f"prefill dispatcher must be one of {PREFILL_DISPATCHERS}, got {plan.prefill!r}")
    if plan.decode is not None and plan.decode not in DECODE_DISPATCHERS:
        raise ValueError(f"decode dispatcher must be one of {DECODE_DISPATCHERS}, got {plan.decode!r}")
    T_max = plan.num_max_dispatch_tokens_per_rank
    if isinstance(T_max, bool) or not isinstance(T_max, int) or T_max < 1:
        raise ValueError(f"num_max_dispatch_tokens_per_rank must be a positive int, got {T_max!r}")
    decode = plan.decode if plan.decode is not None else default_decode_dispatcher(dtype, plan.fp8)
    if decode == "flex_ll" and dtype not in LOW_LATENCY_DTYPES:
        raise ValueError(
            f"the low-latency dispatcher ('flex_ll') moves bfloat16 or FP8 rows, the model is {dtype}: decode in "
            "bfloat16 (--dtype bfloat16), or on 'flex' / 'alltoall'"
        )
    if plan.fp8 and decode != "flex_ll":
        raise ValueError(f"FP8 dispatch runs on the low-latency dispatcher ('flex_ll'), not {decode!r}")
    if plan.fp8 and hidden_size is not None and hidden_size % 128:
        raise ValueError(f"FP8 dispatch needs hidden_size a multiple of 128, got {hidden_size}")


def check_decode_batch(batch_per_rank: int, plan: DecodeDispatch, overlap: bool) -> None:
    """ValueError if a rank would dispatch more tokens in one decode call than 'flex_ll''s
    `num_max_dispatch_tokens_per_rank` (with `overlap`, a call carries half the rank's batch, rounded up)."""
    if plan.decode != "flex_ll":
        return
    per_call = (batch_per_rank + 1) // 2 if overlap else batch_per_rank
    if per_call > plan.num_max_dispatch_tokens_per_rank:
        raise ValueError(
            f"a decode step dispatches {per_call} tokens per rank ({batch_per_rank} sequences on the busiest rank"
            f"{', split in two micro-batches' if overlap else ''}), more than num_max_dispatch_tokens_per_rank="
            f"{plan.num_max_dispatch_tokens_per_rank} of the low-latency buffer: raise it or use more ranks"
        )


class DecodeDispatchers:
    """A decode-phase dispatcher for every MoE layer of `model`, swapped in by `decode()`.

    Args:
        model: a `DeepseekV3ForCausalLM` built over an expert-parallel group with `plan.prefill` as its
            `moe_token_dispatcher_type` (see inference.py `load_for_decoding`).
        plan: a resolved `DecodeDispatch` (`plan.decode` set).
        ep_buffers: where the decode dispatchers take their mtdeepep buffer (the model's, so one owner destroys
            them all).
    """

    def __init__(self, model, plan: DecodeDispatch, ep_buffers: EPBuffers | None) -> None:
        if plan.decode is None:
            raise ValueError("resolve the plan first (DecodeDispatch.resolved)")
        self.plan = plan
        self.layers: list[MoELayer] = list(model.moe_layers())
        self._prefill = [layer.dispatcher for layer in self.layers]
        self._decode: list[TokenDispatcher] = []
        for layer in self.layers:
            if layer.etp_size > 1:
                raise ValueError("expert-parallel decode does not split experts over ranks (etp must be 1)")
            if plan.decode == layer.config.moe_token_dispatcher_type:
                self._decode.append(layer.dispatcher)
                continue
            cfg = dataclasses.replace(
                layer.config,
                moe_token_dispatcher_type=plan.decode,
                moe_flex_ll_num_max_dispatch_tokens_per_rank=plan.num_max_dispatch_tokens_per_rank,
                moe_flex_ll_use_fp8=plan.fp8,
            )
            self._decode.append(build_dispatcher(cfg, layer.dispatcher.ep_group, ep_buffers))

    @contextlib.contextmanager
    def decode(self) -> Iterator[None]:
        """The MoE layers run on the decode dispatchers inside the block, on their own dispatchers again after."""
        for layer, dispatcher in zip(self.layers, self._decode, strict=True):
            layer.dispatcher = dispatcher
        try:
            yield
        finally:
            for layer, dispatcher in zip(self.layers, self._prefill, strict=True):
                layer.dispatcher = dispatcher
