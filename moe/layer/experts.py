"""SwiGLU experts over rows sorted by local expert, three ways: grouped GEMM, padded batch GEMM, and a loop.

Legend: N rows (sorted by local expert), L local experts, H hidden, F expert FFN hidden, P padded length.

Expert `l` computes `y = (silu(x @ w13[l][:, :F]) * (x @ w13[l][:, F:])) @ w2[l]` on its rows.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from moe.layer import wgrad
from moe.layer.capacity import align_up, pad_rows, plan_padding, unpad_rows
from moe.layer.moe_recompute import DropSaved, checkpointed

# What an expert forward may recompute in backward instead of keeping: None, the activation ('act': the SwiGLU
# outputs are rebuilt from the FC1 output), or 'fc1' (the FC1 output too, with one more FC1 GEMM).
EXPERT_RECOMPUTE = (None, "act", "fc1")

EXPERT_IMPLS = ("grouped", "padded", "loop")


def counts_to_list(tokens_per_expert: torch.Tensor | Sequence[int]) -> list[int]:
    """Per-expert row counts as Python ints (a host sync if given a device tensor)."""
    if isinstance(tokens_per_expert, torch.Tensor):
        return [int(c) for c in tokens_per_expert.tolist()]
    return [int(c) for c in tokens_per_expert]


# ---------------------------------------------------------------------------------------------------------------
# Grouped GEMM: torch._grouped_mm where the build supports it, else a loop
# ---------------------------------------------------------------------------------------------------------------


@functools.cache
def grouped_mm_available(device_type: str, dtype: torch.dtype) -> bool:
    """Whether `torch._grouped_mm` runs forward and backward correctly for `(device_type, dtype)`.

    Probed once per pair on tiny 16-aligned operands (including an empty group) against a loop.
    """
    if not hasattr(torch, "_grouped_mm"):
        return False
    # The first call may come inside a forward under activation checkpointing: keep the probe's saved tensors away
    # from the caller's saved-tensor hooks (innermost hooks win), or the checkpoint would count tensors its
    # recomputation (which finds the answer cached) never saves again.
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        return _probe_grouped_mm(device_type, dtype)


def _probe_grouped_mm(device_type: str, dtype: torch.dtype) -> bool:
    try:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(24, 16, generator=gen).to(device_type, dtype).requires_grad_()
        w = torch.randn(3, 16, 32, generator=gen).to(device_type, dtype).requires_grad_()
        offs = torch.tensor([8, 8, 24], dtype=torch.int32, device=device_type)
        y = torch._grouped_mm(x, w, offs=offs)
        y_ref = torch.cat([x[:8] @ w[0], x[8:8] @ w[1], x[8:] @ w[2]])
        grad = torch.randn(24, 32, generator=gen).to(device_type, dtype)
        gx, gw = torch.autograd.grad(y, (x, w), grad)
        gx_ref, gw_ref = torch.autograd.grad(y_ref, (x, w), grad)
        tol = 1e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-4
        return all(
            torch.allclose(a.float(), b.float(), rtol=tol, atol=tol)
            for a, b in ((y, y_ref), (gx, gx_ref), (gw, gw_ref))
        )
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        return False


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous (`_grouped_mm`'s backward needs it)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def _grouped_mm_fits(x_NK: torch.Tensor, w_LKM: torch.Tensor) -> bool:
    """`_grouped_mm` needs 16-byte aligned row strides; the dtype/device pair must pass the probe."""
    if x_NK.dtype != w_LKM.dtype or not grouped_mm_available(x_NK.device.type, x_NK.dtype):
        return False
    size = x_NK.element_size()
    return (x_NK.size(1) * size) % 16 == 0 and (w_LKM.size(2) * size) % 16 == 0


def grouped_linear(x_NK: torch.Tensor, w_LKM: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """`[N, K]` rows sorted by group times per-group `w [L, K, M]` -> `[N, M]`.

    Uses `torch._grouped_mm` when available for the dtype/device and strides, otherwise loops over groups. Every
    group's weight takes part in the graph (an empty group gets a zero gradient). Inside `moe.layer.wgrad.deferring`
    the weight gradient of a weight the store holds is queued there (`_DelayedWgradGemm`).
    """
    if x_NK.size(0) > 0 and _grouped_mm_fits(x_NK, w_LKM):
        offs = torch.tensor(counts, device=x_NK.device).cumsum(0).to(torch.int32)
        if (y_NM := _queued_wgrad_gemm(x_NK.contiguous(), w_LKM, "grouped", offs)) is not None:
            return y_NM
        y_NM = torch._grouped_mm(x_NK.contiguous(), w_LKM, offs=offs)
        return _ContiguousGrad.apply(y_NM)
    return loop_linear(x_NK, w_LKM, counts)


def loop_linear(x_NK: torch.Tensor, w_LKM: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Reference grouped linear: one `matmul` per group (empty groups included, so each weight gets a grad)."""
    if (y_NM := _queued_wgrad_gemm(x_NK, w_LKM, "loop", list(counts))) is not None:
        return y_NM
    outs = [x_e @ w_LKM[e] for e, x_e in enumerate(x_NK.split(counts))]
    return torch.cat(outs) if outs else x_NK.new_zeros(0, w_LKM.size(2))


def batched_linear(x_LPK: torch.Tensor, w_LKM: torch.Tensor) -> torch.Tensor:
    """`torch.bmm(x [L, P, K], w [L, K, M])`, the weight gradient queued inside `moe.layer.wgrad.deferring`."""
    if (y_LPM := _queued_wgrad_gemm(x_LPK, w_LKM, "bmm", None)) is not None:
        return y_LPM
    return torch.bmm(x_LPK, w_LKM)


def _queued_wgrad_gemm(x: torch.Tensor, w: torch.Tensor, kind: str, aux) -> torch.Tensor | None:
    """The expert GEMM `kind` as a `_DelayedWgradGemm` when its weight gradient is to be queued (a
    `moe.layer.wgrad.WeightGradStore` slot, or a pipeline W action: `moe.layer.wgrad.split_weight_of`); else None."""
    slot, split = wgrad.slot_for(w), wgrad.split_weight_of(w)
    if slot is None and split is None:
        return None
    return _DelayedWgradGemm.apply(x, w, kind, aux, slot, split)


# The three GEMMs of each expert-GEMM kind as autograd computes them (`_grouped_mm`'s, `mm`'s and `bmm`'s backward
# formulas), so that a delayed weight gradient is bitwise the undelayed one (test_delayed_wgrad_gemms_match_autograd):
# forward(x, w, aux), dgrad(g, w, aux) = dL/dx, wgrad(x, g, aux) = dL/dw. `aux`: the int32 group ends ('grouped'),
# the row counts ('loop'), nothing ('bmm').
def _loop_forward(x_NK, w_LKM, counts):
    outs = [x_e.mm(w_LKM[e]) for e, x_e in enumerate(x_NK.split(counts))]
    return torch.cat(outs) if outs else x_NK.new_zeros(0, w_LKM.size(2))


def _loop_dgrad(g_NM, w_LKM, counts):
    parts = [g_e.mm(w_LKM[e].t()) for e, g_e in enumerate(g_NM.split(counts))]
    return torch.cat(parts) if parts else g_NM.new_zeros(0, w_LKM.size(1))


def _loop_wgrad(x_NK, g_NM, counts):
    return torch.stack([x_e.t().mm(g_e) for x_e, g_e in zip(x_NK.split(counts), g_NM.split(counts))])


_EXPERT_GEMMS = {
    "grouped": (
        lambda x, w, offs: torch._grouped_mm(x, w, offs=offs),
        lambda g, w, offs: torch._grouped_mm(g, w.transpose(-2, -1), offs=offs),
        lambda x, g, offs: torch._grouped_mm(x.t(), g, offs=offs),
    ),
    "loop": (_loop_forward, _loop_dgrad, _loop_wgrad),
    "bmm": (
        lambda x, w, _: torch.bmm(x, w),
        lambda g, w, _: g.bmm(w.transpose(1, 2)),
        lambda x, g, _: x.transpose(1, 2).bmm(g),
    ),
}


class _DelayedWgradGemm(torch.autograd.Function):
    """An expert GEMM whose backward computes the input gradient and queues the weight gradient in a
    `moe.layer.wgrad.WeightGradStore` slot, or for a pipeline W action (`split`: `moe.layer.wgrad.split_weight_of`); see
    `_EXPERT_GEMMS` for the kinds."""

    @staticmethod
    def forward(ctx, x, w, kind: str, aux, slot: wgrad.WgradSlot | None, split: torch.Tensor | None) -> torch.Tensor:
        ctx.kind, ctx.aux, ctx.slot, ctx.split = kind, aux, slot, split
        ctx.save_for_backward(x, w)
        return _EXPERT_GEMMS[kind][0](x, w, aux)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        _, dgrad, wgrad_fn = _EXPERT_GEMMS[ctx.kind]
        g = g.contiguous()
        grad_x = dgrad(g, w, ctx.aux) if ctx.needs_input_grad[0] else None
        grad_w = None
        if ctx.needs_input_grad[1]:
            aux = ctx.aux
            grad_w = wgrad.wgrad_or_defer(ctx.slot, lambda: wgrad_fn(x, g, aux), ctx.split)
        ctx.slot = ctx.split = None
        return grad_x, grad_w, None, None, None, None


# CPU BF16/FP16 GEMMs go through oneDNN, which builds (JIT-compiles) a kernel per operand shape and caches it. Expert
# row counts change with every routing, so without alignment nearly every expert GEMM of a training step has a new
# shape and pays that build: measured 130-200 GFLOP/s for a 16-expert grouped GEMM forward + backward against
# ~300 with shapes it has seen. Rounding each expert's rows up to a multiple of 32 (zero rows, sliced off again)
# bounds the shapes to a few dozen per weight: ~260 GFLOP/s counting only the real rows (bench/train_step.py).
# FP32 GEMMs (MKL) keep no per-shape state, and CUDA GEMMs none that matters: no alignment there.
CPU_LOW_PRECISION_ROW_ALIGNMENT = 32


def default_row_alignment(device: torch.device, dtype: torch.dtype) -> int:
    """Rows per expert are padded to a multiple of this before the expert GEMMs (1 = no padding); see above."""
    if device.type == "cpu" and dtype in (torch.bfloat16, torch.float16):
        return CPU_LOW_PRECISION_ROW_ALIGNMENT
    return 1


def aligned_row_positions(counts: list[int], alignment: int, device: torch.device) -> tuple[torch.Tensor, list[int]]:
    """Where each of the `N = sum(counts)` rows (sorted by group) goes when every group is padded to a multiple of
    `alignment` rows: `(positions [N] int64, padded counts)`."""
    padded = [align_up(c, alignment) for c in counts]
    shift, gap = [], 0  # how far each group's rows move: the padding of the groups before it
    for count, padded_count in zip(counts, padded):
        shift.append(gap)
        gap += padded_count - count
    n = sum(counts)
    moves = torch.repeat_interleave(torch.tensor(shift), torch.tensor(counts), output_size=n)
    return (torch.arange(n) + moves).to(device), padded


def swiglu(h_N2F: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` with `h = [gate | up]` along the last dimension."""
    gate, up = h_N2F.chunk(2, dim=-1)
    return F.silu(gate) * up


def swiglu_mlp(x: torch.Tensor, fc1: Callable[[torch.Tensor], torch.Tensor],
               fc2: Callable[[torch.Tensor], torch.Tensor], recompute: str | None = None) -> torch.Tensor:  # fmt: skip
    """`fc2(swiglu(fc1(x)))`, keeping less for backward when asked (see `EXPERT_RECOMPUTE`).

    'act' drops the SwiGLU's two outputs (`silu(gate)` and the product; FC2's input) and rebuilds them from the FC1
    output when the backward needs them; 'fc1' also drops the FC1 output and rebuilds it from `x` (one more FC1
    GEMM). The values are rebuilt by the same operations, so gradients are unchanged.
    """
    if recompute not in EXPERT_RECOMPUTE:
        raise ValueError(f"recompute must be one of {EXPERT_RECOMPUTE}, got {recompute!r}")
    if recompute is None or not torch.is_grad_enabled():
        return fc2(swiglu(fc1(x)))
    dropped = DropSaved()
    with dropped:
        h = fc1(x)
        get_h = dropped.drop(h, lambda: fc1(x)) if recompute == "fc1" else (lambda: h)
        gate, up = h.chunk(2, dim=-1)
        silu_gate = F.silu(gate)
        get_silu_gate = dropped.drop(silu_gate, lambda: F.silu(get_h().chunk(2, dim=-1)[0]))
        act = silu_gate * up
        dropped.drop(act, lambda: get_silu_gate() * get_h().chunk(2, dim=-1)[1])
        return fc2(act)


# ---------------------------------------------------------------------------------------------------------------
# Modules
# ---------------------------------------------------------------------------------------------------------------


class SwiGLUExperts(nn.Module):
    """`L` SwiGLU experts with weights `w13 [L, H, 2F]` (gate columns first, then up) and `w2 [L, F, H]`.

    Args:
        impl: 'grouped' (grouped GEMM, `torch._grouped_mm` when supported, else a loop), 'padded' (every
            expert's rows padded or truncated to one aligned length, one `torch.bmm`; truncated rows give zero
            output and are counted in `last_num_dropped`), or 'loop' (reference).
        padded_factor: for 'padded', the length is `ceil(N / L * padded_factor)` aligned up to `padded_alignment`
            (rows beyond it are dropped); None = the largest expert's count aligned up (dropless).
        row_alignment: for 'grouped' and 'loop', each expert's rows are padded with zero rows to a multiple of this
            for the GEMMs (dropless; the padding is sliced off). None = `default_row_alignment` (32 for BF16/FP16
            on CPU, where oneDNN's per-shape kernels make varying shapes slow; else 1 = none).
    """

    def __init__(
        self,
        num_local_experts: int,
        hidden_size: int,
        ffn_hidden_size: int,
        *,
        impl: str = "grouped",
        padded_factor: float | None = None,
        padded_alignment: int = 16,
        row_alignment: int | None = None,
        init_std: float = 0.02,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if impl not in EXPERT_IMPLS:
            raise ValueError(f"impl must be one of {EXPERT_IMPLS}, got {impl!r}")
        self.num_local_experts = num_local_experts
        self.hidden_size = hidden_size
        self.ffn_hidden_size = ffn_hidden_size
        self.impl = impl
        self.padded_factor = padded_factor
        self.padded_alignment = padded_alignment
        if row_alignment is not None and row_alignment < 1:
            raise ValueError(f"row_alignment must be >= 1 or None, got {row_alignment}")
        self.row_alignment = row_alignment
        self.init_std = init_std
        L, H, Fh = num_local_experts, hidden_size, ffn_hidden_size
        self.w13 = nn.Parameter(torch.empty(L, H, 2 * Fh, dtype=dtype, device=device))
        self.w2 = nn.Parameter(torch.empty(L, Fh, H, dtype=dtype, device=device))
        self.last_num_dropped = 0
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.w13, std=self.init_std)
        nn.init.normal_(self.w2, std=self.init_std)

    def linear(self, x_NK: torch.Tensor, w_LKM: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """The grouped GEMM used by 'grouped' and 'loop' (subclasses swap in other arithmetic, e.g. FP8)."""
        if self.impl == "loop":
            return loop_linear(x_NK, w_LKM, counts)
        return grouped_linear(x_NK, w_LKM, counts)

    def padded_length(self, counts: list[int]) -> int:
        if self.padded_factor is None:
            length = max(counts, default=0)
        else:
            length = math.ceil(sum(counts) / max(len(counts), 1) * self.padded_factor)
        return align_up(max(length, 1), self.padded_alignment)

    def forward(
        self, x_NH: torch.Tensor, tokens_per_expert: torch.Tensor | Sequence[int], *, recompute: str | None = None
    ) -> torch.Tensor:
        """Args:
            x_NH: `[N, H]` rows sorted by local expert (in the weights' dtype).
            tokens_per_expert: `[L]` row counts (ints or an int tensor) summing to N.
            recompute: None, 'act' or 'fc1': what the backward rebuilds instead of keeping (`swiglu_mlp`).
        Returns `[N, H]` in the input dtype.
        """
        counts = counts_to_list(tokens_per_expert)
        if len(counts) != self.num_local_experts or sum(counts) != x_NH.size(0):
            raise ValueError(
                f"tokens_per_expert {counts} must have {self.num_local_experts} entries summing to {x_NH.size(0)}"
            )
        if self.impl == "padded":
            return self._forward_padded(x_NH.to(self.w13.dtype), counts, recompute)
        self.last_num_dropped = 0
        return self.compute(x_NH, counts, self.w13, self.w2, recompute=recompute)

    def compute(self, x_NH: torch.Tensor, counts: list[int], w13: torch.Tensor, w2: torch.Tensor, *,
                recompute: str | None = None, alignment: int | None = None) -> torch.Tensor:  # fmt: skip
        """SwiGLU experts with the given weights `w13 [G, H, 2F]`, `w2 [G, F, H]` (this module's, or copies of some
        experts', e.g. hot-expert replicas) on `[N, H]` rows sorted by group (`counts`, G entries), with this
        module's grouped GEMM (`linear`). Returns `[N, H]` in the input dtype.

        `alignment`: each group's rows are padded to a multiple of it for the GEMMs (None: `self.row_alignment`,
        or when that is None the device/dtype default, `default_row_alignment`)."""
        x_NH = x_NH.to(w13.dtype)
        if alignment is None:
            alignment = self.row_alignment or default_row_alignment(x_NH.device, x_NH.dtype)
        if alignment > 1 and any(c % alignment for c in counts):
            # Zero rows in the padding: they stay zero through SwiGLU and the GEMMs, so the weight gradients and
            # the real rows' outputs are what the unpadded GEMMs give (up to the GEMMs' summation order).
            rows_N, padded = aligned_row_positions(counts, alignment, x_NH.device)
            x_PH = x_NH.new_zeros(sum(padded), x_NH.size(1)).index_copy(0, rows_N, x_NH)
            y_PH = self.compute(x_PH, padded, w13, w2, recompute=recompute, alignment=1)
            return y_PH.index_select(0, rows_N)
        return swiglu_mlp(x_NH, lambda x: self.linear(x, w13, counts), lambda a: self.linear(a, w2, counts), recompute)

    def _forward_padded(self, x_NH: torch.Tensor, counts: list[int], recompute: str | None) -> torch.Tensor:
        plan = plan_padding(counts, self.padded_length(counts), device=x_NH.device)
        self.last_num_dropped = plan.num_dropped
        x_LPH = pad_rows(x_NH, plan).view(self.num_local_experts, plan.length, -1)
        fc1, fc2 = (lambda x: batched_linear(x, self.w13)), (lambda a: batched_linear(a, self.w2))
        y_LPH = swiglu_mlp(x_LPH, fc1, fc2, recompute)
        return unpad_rows(y_LPH.flatten(0, 1), plan)


class SwiGLUMLP(nn.Module):
    """Dense SwiGLU MLP (the shared expert): `w13 [H, 2F]`, `w2 [F, H]`; `[T, H] -> [T, H]`."""

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        *,
        init_std: float = 0.02,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.w13 = nn.Parameter(torch.empty(hidden_size, 2 * ffn_hidden_size, dtype=dtype, device=device))
        self.w2 = nn.Parameter(torch.empty(ffn_hidden_size, hidden_size, dtype=dtype, device=device))
        nn.init.normal_(self.w13, std=init_std)
        nn.init.normal_(self.w2, std=init_std)

    # What the backward rebuilds (set by the model's recompute settings): None (nothing), 'act' (the SwiGLU's
    # outputs, from the FC1 output; see `swiglu_mlp`) or 'full' (everything but the input: a checkpoint).
    recompute: str | None = None

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        x_TH = x_TH.to(self.w13.dtype)
        if self.recompute == "full":
            return checkpointed(True, self._mlp, x_TH, None)
        return self._mlp(x_TH, "act" if self.recompute == "act" else None)

    def _mlp(self, x_TH: torch.Tensor, recompute: str | None) -> torch.Tensor:
        # A GEMM hook (`linear_fns['w13' | 'w2']`, F.linear-like callables, e.g. the FP8 recipes' GEMMs); the
        # weights are stored `[in, out]`, so they are passed transposed. Subclasses (the tensor-parallel MLP) keep it.
        fns = getattr(self, "linear_fns", None)
        if fns is None:
            return swiglu_mlp(x_TH, lambda v: wgrad.matmul(v, self.w13), lambda a: wgrad.matmul(a, self.w2), recompute)
        return swiglu_mlp(x_TH, lambda v: fns["w13"](v, self.w13.t()), lambda a: fns["w2"](a, self.w2.t()), recompute)
