"""DeepEP 2.1's primitives on `mtdeepep.ElasticBuffer`, following upstream's own tests (`tests/elastic/test_pp.py`,
`test_agrs.py`, `test_engram.py`) at small sizes, in a rank process: pipeline sends and receives between ring
neighbours at random times (bitwise, in order per pair), all-gathers across interleaved sessions (in place or not,
batched or single, waited on in random order; bitwise against the stack of every rank's tensor), Engram fetches of
random global rows (bf16 and FP8 with row- and column-major scales; bitwise), `EPHandle.deterministic_sort`, and the
V2 outputs' dtypes under a bfloat16 default dtype. Bad inputs are refused before any message; a missing peer times
out naming it.
"""

from __future__ import annotations

import random
import time
from functools import partial

import pytest
import torch
import torch.distributed as dist

import mtdeepep
from mtdeepep.elastic import ElasticBuffer
from mtdeepep.utils import fp8 as fp8_utils
from mtdeepep.utils import refs

from ..conformance.common import gather
from ..conformance.default_dtype import default_dtype


def _buffer(ctx, key: str, num_ranks_per_node, **kwargs) -> ElasticBuffer:
    key = f"v21-{key}-{num_ranks_per_node}-{sorted(kwargs.items())}"
    if key not in ctx.cache:
        ctx.cache[key] = ElasticBuffer(ctx.group, num_ranks_per_node=num_ranks_per_node, **kwargs)
    return ctx.cache[key]


def _refused(call, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()


# ---------------------------------------------------------------------------------------------------------------
# Pipeline send / receive


def pp_stress_ops(rank: int, num_ranks: int, num_sends: int, shape: tuple[int, ...]):
    """Upstream's generator: random (source, ring neighbour) pairs, each message with a send time and a later
    receive time; per pair the i-th send matches the i-th receive. Every rank draws every tensor (same seeds), keeps
    its own operations, sorted by time."""
    send_times = {(s, d): [] for s in range(num_ranks) for d in range(num_ranks) if s != d}
    recv_times = {(s, d): [] for s in range(num_ranks) for d in range(num_ranks) if s != d}
    for _ in range(num_sends):
        src = random.randint(0, num_ranks - 1)
        dst = (src + (1 if random.randint(0, 1) else -1)) % num_ranks
        sent = random.randint(0, 10**8)
        send_times[(src, dst)].append(sent)
        recv_times[(src, dst)].append(sent + random.randint(1, 3 * 10**6))
    ops = []
    for pair in send_times:
        for i, (sent, received) in enumerate(zip(sorted(send_times[pair]), sorted(recv_times[pair]))):
            tensor = torch.randn(shape, dtype=torch.bfloat16)
            if pair[0] == rank:
                ops.append(("send", sent, pair[1], i, tensor))
            if pair[1] == rank:
                ops.append(("recv", received, pair[0], i, tensor))
    ops.sort(key=lambda op: (op[1], op[3]))
    return ops


def pp_send_recv_matches_upstream_test(ctx, num_ranks_per_node=None, seeds=(0, 1), num_sends=48):
    """Seeds x randomly timed sends and receives of bf16 tensors between ring neighbours: each received tensor equals
    the sent one bitwise, in order per pair. Then the refusals (before any message) and a size mismatch."""
    shape, inflight = (8, 64), 4
    num_max_tensor_bytes = 8 * 64 * 2
    hint = ElasticBuffer.get_pp_buffer_size_hint(num_max_tensor_bytes, inflight)
    assert hint == 2 << 20  # align(1024 * 4 * 2 * 2, 2 MiB)
    buffer = _buffer(ctx, "pp", num_ranks_per_node, num_bytes=hint, allow_hybrid_mode=False)
    prev_rank, next_rank = (ctx.rank - 1) % ctx.world_size, (ctx.rank + 1) % ctx.world_size
    _refused(lambda: buffer.pp_send(torch.zeros(4, dtype=torch.bfloat16), next_rank), "pp_set_config first")
    _refused(lambda: buffer.pp_set_config(num_max_tensor_bytes, inflight + 1000), "needs a buffer of")
    buffer.pp_set_config(num_max_tensor_bytes, inflight)
    for seed in seeds:
        torch.manual_seed(42 + seed)
        random.seed(42 + seed)
        previous = 0
        for j, (op, when, peer, _, tensor) in enumerate(pp_stress_ops(ctx.rank, ctx.world_size, num_sends, shape)):
            if op == "send":
                buffer.pp_send(tensor, peer)
            else:
                result = torch.empty_like(tensor)
                buffer.pp_recv(result, peer)
                assert torch.equal(result, tensor), f"rank {ctx.rank}: mismatch at op {j} (seed {seed})"
            if when > previous:
                time.sleep((when - previous) / 10**8 * 0.05)  # upstream's random timing, scaled to 50 ms a seed
            previous = when
    # Refused before any message: not a neighbour, too large, not contiguous, bad num_sms.
    if ctx.world_size > 3:
        _refused(lambda: buffer.pp_send(torch.zeros(4, dtype=torch.bfloat16), (ctx.rank + 2) % 4), "previous or next")
    _refused(lambda: buffer.pp_send(torch.zeros(num_max_tensor_bytes + 2, dtype=torch.uint8), next_rank), "more than")
    _refused(lambda: buffer.pp_recv(torch.zeros(8, 8, dtype=torch.bfloat16).t(), prev_rank), "contiguous")
    _refused(lambda: buffer.pp_send(torch.zeros(4, dtype=torch.bfloat16), next_rank, num_sms=-1), "num_sms")
    # A receive of another size raises after taking the message: the pair stays in step.
    if ctx.world_size >= 2:
        buffer.pp_send(torch.arange(6, dtype=torch.float32), next_rank)
        _refused(lambda: buffer.pp_recv(torch.empty(4, dtype=torch.float32), prev_rank), "sent 24 bytes, t has 16")
        buffer.pp_send(torch.arange(6, dtype=torch.float32) + ctx.rank, next_rank)
        got = torch.empty(6, dtype=torch.float32)
        buffer.pp_recv(got, prev_rank)
        assert torch.equal(got, torch.arange(6, dtype=torch.float32) + prev_rank)
    buffer.pp_set_config(num_max_tensor_bytes, inflight)  # collective flush


def pp_recv_times_out_naming_the_sender(ctx, num_ranks_per_node=None):
    """A receive whose sender never sends raises CommTimeoutError naming it (on a group of its own: gloo keeps the
    timed-out receive posted)."""
    group = dist.new_group(list(range(ctx.world_size)))
    buffer = ElasticBuffer(
        group, num_bytes=2 << 20, num_cpu_timeout_secs=1, explicitly_destroy=True, num_ranks_per_node=num_ranks_per_node
    )
    try:
        buffer.pp_set_config(1024, 2)
        if ctx.rank == 1:
            started = time.monotonic()
            with pytest.raises(mtdeepep.CommTimeoutError, match="pp_recv from rank 0: rank 0 did not send"):
                buffer.pp_recv(torch.empty(4, dtype=torch.float32), 0)
            assert time.monotonic() - started < 10
        dist.barrier(group=ctx.group)
    finally:
        buffer.destroy()


# ---------------------------------------------------------------------------------------------------------------
# All-gather sessions


def _all_gather_ref(shape, rank: int, num_ranks: int, round_idx: int):
    tensors = []
    for r in range(num_ranks):
        torch.manual_seed(42 + round_idx * 43 + r)
        tensors.append(torch.randn(shape, dtype=torch.bfloat16))
    return tensors[rank], torch.stack(tensors)


def agrs_stress_ops(num_ops: int, num_max_inflight: int, shape, rank: int, num_ranks: int):
    """Upstream's generator: gathers of random batches from a shuffled list, fetched in random order, sessions
    closed and reopened when nothing is in flight."""
    tensors, expected = zip(*(_all_gather_ref(shape, rank, num_ranks, i) for i in range(num_ops)))
    unprocessed = random.sample(range(num_ops), num_ops)
    inflight, ops, limit = [], [("create_session", ())], num_max_inflight
    while unprocessed or inflight:
        most = min(len(unprocessed), limit)
        choices = (["ag"] if most > 0 else []) + (["fetch"] if inflight else ["destroy"])
        op = random.choice(choices)
        if op == "ag":
            batch = tuple(unprocessed[-random.randint(1, most) :])
            limit -= len(batch)
            del unprocessed[-len(batch) :]
            inflight.append(batch)
            ops.append(("ag", batch))
        elif op == "fetch":
            ops.append(("fetch", inflight.pop(random.randrange(len(inflight)))))
        else:
            ops += [("destroy_session", ()), ("create_session", ())]
            limit = num_max_inflight
    ops.append(("destroy_session", ()))
    return ops, tensors, expected


def _do_all_gather(buffer: ElasticBuffer, in_place: bool, batched: bool, tensors):
    if in_place:
        targets = buffer.agrs_get_inplace_tensor(tuple(t.shape for t in tensors), torch.bfloat16)
        for target, tensor in zip(targets, tensors):
            target.copy_(tensor)
    else:
        targets = tensors
    if batched:
        *outputs, handle = buffer.all_gather(targets)
        return outputs, [handle]
    outputs, handles = [], []
    for t in targets:
        output, handle = buffer.all_gather(t)
        outputs.append(output)
        handles.append(handle)
    return outputs, handles


def agrs_all_gather_matches_upstream_test(ctx, num_ranks_per_node=None, seeds=(0, 1), num_ops=32):
    """Seeds x all-gathers across randomly interleaved sessions, in place or not, batched or single, waited on in
    random order: each output equals the stack of every rank's tensor bitwise. Then the refusals."""
    shape, inflight = (4, 8, 32), 4
    session = ElasticBuffer.get_agrs_num_max_session_bytes(ctx.group, [shape] * inflight, torch.bfloat16)
    assert session == inflight * ctx.world_size * 4 * 8 * 32 * 2
    num_bytes = ElasticBuffer.get_agrs_buffer_size_hint(ctx.group, session)
    assert num_bytes == 2 << 20
    buffer = _buffer(ctx, "agrs", num_ranks_per_node, num_bytes=num_bytes)
    _refused(lambda: buffer.create_agrs_session(), "agrs_set_config first")
    _refused(lambda: buffer.agrs_set_config(num_bytes + 1, inflight), "exceeds the buffer")
    buffer.agrs_set_config(num_bytes, inflight)
    for seed in seeds:
        random.seed(42 + seed)
        ops, tensors, expected = agrs_stress_ops(num_ops, inflight, shape, ctx.rank, ctx.world_size)
        results, handles = [None] * num_ops, {}
        for op, indices in ops:
            if op == "create_session":
                buffer.create_agrs_session()
            elif op == "destroy_session":
                buffer.destroy_agrs_session()
            elif op == "ag":
                in_place, batched = random.random() < 0.5, random.random() < 0.8
                handles[indices] = _do_all_gather(buffer, in_place, batched, tuple(tensors[i] for i in indices))
            else:
                outputs, waits = handles.pop(indices)
                for wait in waits:
                    wait()
                for output, i in zip(outputs, indices):
                    results[i] = output.clone()
        for i in range(num_ops):
            assert results[i] is not None and torch.equal(results[i], expected[i]), f"seed {seed}, gather {i}"
    # Refused before any message.
    one = torch.zeros(shape, dtype=torch.bfloat16)
    _refused(lambda: buffer.all_gather(one), "needs an open session")
    with buffer.agrs_new_session():
        _refused(lambda: buffer.create_agrs_session(), "already open")
        _refused(lambda: buffer.all_gather([one] * (inflight + 1)), "num_max_all_gathers_per_session")
        _refused(lambda: buffer.all_gather(torch.zeros(8, 8, dtype=torch.bfloat16).t()), "contiguous")
        big = torch.zeros(num_bytes // ctx.world_size + 64, dtype=torch.uint8)
        _refused(lambda: buffer.all_gather(big), "num_max_session_bytes")
        # Shapes that differ between ranks: refused on every rank after the header, the session still usable.
        _refused(lambda: buffer.all_gather(torch.zeros(4 + ctx.rank, dtype=torch.bfloat16)), "other shapes")
        mine = torch.full((5,), float(ctx.rank), dtype=torch.float32)
        out, wait = buffer.all_gather(mine)
        wait()
        assert torch.equal(out, torch.arange(ctx.world_size, dtype=torch.float32).unsqueeze(1).expand(-1, 5))
    _refused(lambda: buffer.destroy_agrs_session(), "no session")


# ---------------------------------------------------------------------------------------------------------------
# Engram


def engram_fetch_matches_upstream_test(ctx, num_ranks_per_node=None):
    """Each rank writes bf16 or FP8 rows; `engram_fetch` of random global indices returns the rows bitwise and, in
    FP8, the replicated scales in row- and column-major layout. Then the refusals."""
    num_entries, hidden, num_tokens, per_token = 96, 128, 12, 3
    for use_fp8 in (False, True):
        dtype = torch.float8_e4m3fn if use_fp8 else torch.bfloat16
        gpu_bytes, cpu_bytes = ElasticBuffer.get_engram_storage_size_hint(
            num_entries, hidden, num_tokens * per_token, dtype
        )
        assert (gpu_bytes, cpu_bytes) == (2 << 20, 2 << 20)
        buffer = _buffer(ctx, f"engram-{use_fp8}", num_ranks_per_node, num_bytes=gpu_bytes + cpu_bytes,
                         num_cpu_bytes=cpu_bytes, allow_multiple_reduction=False)  # fmt: skip
        _refused(partial(buffer.engram_fetch, torch.zeros(1, 1, dtype=torch.int32)), "engram_write first")
        generator = torch.Generator().manual_seed(1000 + ctx.rank + 10 * use_fp8)
        local = torch.randn(num_entries, hidden, generator=generator, dtype=torch.float32).bfloat16()
        sf = None
        if use_fp8:
            local, local_sf = fp8_utils.per_token_cast_to_fp8(local)
            sf = torch.cat([s for s in gather(ctx, local_sf)])
        buffer.engram_write(local, sf=sf)
        everyone = torch.cat(gather(ctx, local.view(torch.uint8))).view(dtype)  # FP8 does not pickle: bytes
        for round_idx in range(3):
            indices = torch.randint(
                0, ctx.world_size * num_entries, (num_tokens + round_idx, per_token), generator=generator,
                dtype=torch.int32,
            )  # fmt: skip
            expected = everyone[indices.view(-1).long()].view(indices.size(0), -1)
            for col_major in (False, True) if use_fp8 else (False,):
                data, fetched_sf = buffer.engram_fetch(indices, use_tma_aligned_col_major_sf=col_major)()
                assert data.dtype == dtype and torch.equal(data.view(torch.uint8), expected.view(torch.uint8))
                if use_fp8:
                    assert torch.equal(fetched_sf, sf[indices.view(-1).long()].view(indices.size(0), -1))
                    if col_major:
                        assert fetched_sf.stride() == (1, (indices.size(0) + 3) // 4 * 4)
                else:
                    assert fetched_sf is None
        # Refused before any message.
        too_far = torch.full((1, 1), ctx.world_size * num_entries, dtype=torch.int32)
        _refused(partial(buffer.engram_fetch, too_far), "must lie in")
        _refused(partial(buffer.engram_fetch, torch.zeros(1, 1, dtype=torch.int64)), "int32")
        _refused(partial(buffer.engram_write, local.float() if not use_fp8 else local), "bfloat16 or float8|sf must")
    # A buffer without host storage refuses, as does a storage larger than num_cpu_bytes.
    plain = _buffer(ctx, "plain", num_ranks_per_node, num_bytes=2 << 20)
    _refused(lambda: plain.engram_write(torch.zeros(4, 8, dtype=torch.bfloat16)), "num_cpu_bytes > 0")
    small = _buffer(ctx, "engram-small", num_ranks_per_node, num_bytes=(2 << 20) + 4096, num_cpu_bytes=4096)
    _refused(lambda: small.engram_write(torch.zeros(64, 64, dtype=torch.bfloat16)), "num_cpu_bytes is 4096")
    _refused(lambda: ElasticBuffer(ctx.group, num_max_tokens_per_rank=8, hidden=8, num_cpu_bytes=64), "needs num_bytes")


# ---------------------------------------------------------------------------------------------------------------
# Deterministic sort, default dtype


def _routing(ctx, num_tokens, num_experts, num_topk, seed):
    generator = torch.Generator().manual_seed(seed * 100 + ctx.rank)
    scores = torch.rand(num_tokens, num_experts, generator=generator, dtype=torch.float32)
    topk_idx = scores.topk(num_topk, dim=1).indices
    topk_idx[torch.rand(num_tokens, num_topk, generator=generator, dtype=torch.float32) < 0.2] = -1
    weights = torch.rand(num_tokens, num_topk, generator=generator, dtype=torch.float32) + 0.1
    x = torch.randn(num_tokens, 64, generator=generator, dtype=torch.float32).bfloat16()
    return x, topk_idx, weights


def deterministic_sort_restores_arrival_independent_order(ctx, num_ranks_per_node=None):
    """Rows shuffled as another arrival order would leave them: `deterministic_sort` brings back the sorted order
    (non-expanded: rows and metadata; expanded: rows within each expert and the slots). On mtdeepep's own outputs it
    changes nothing."""
    capacity, num_experts, num_topk = 32, 4 * ctx.world_size, 3
    buffer = _buffer(ctx, "sort", num_ranks_per_node, num_max_tokens_per_rank=capacity, hidden=64, num_topk=num_topk)
    x, topk_idx, weights = _routing(ctx, capacity - 2 * ctx.rank, num_experts, num_topk, seed=5)
    recv_x, recv_idx, recv_w, handle, _ = buffer.dispatch(x, topk_idx=topk_idx, topk_weights=weights,
                                                          num_experts=num_experts)  # fmt: skip
    sorted_state = [t.clone() for t in (recv_x, recv_idx, recv_w, handle.recv_src_metadata)]
    handle.deterministic_sort(True, False, recv_x, None, recv_idx, recv_w, None)
    assert all(torch.equal(a, b) for a, b in zip((recv_x, recv_idx, recv_w, handle.recv_src_metadata), sorted_state))
    shuffle = torch.randperm(recv_x.size(0), generator=torch.Generator().manual_seed(ctx.rank))
    for t in (recv_x, recv_idx, recv_w, handle.recv_src_metadata):
        t.copy_(t[shuffle])
    handle.deterministic_sort(True, False, recv_x, None, recv_idx, recv_w, None)
    assert all(torch.equal(a, b) for a, b in zip((recv_x, recv_idx, recv_w, handle.recv_src_metadata), sorted_state))
    # A cached dispatch (its rows in the first dispatch's arrival order) sorts with the metadata kept from then.
    cached_x, _, _, _, _ = buffer.dispatch(x, handle=handle)
    cached_x = cached_x[shuffle].clone()
    handle.deterministic_sort(False, True, cached_x, None, None, None, None)
    assert torch.equal(cached_x, sorted_state[0])

    # Expanded: shuffle the rows of each expert's block, then sort them back.
    recv_x, _, recv_w, handle, _ = buffer.dispatch(
        x, topk_idx=topk_idx, topk_weights=weights, num_experts=num_experts, do_expand=True, expert_alignment=4
    )
    expected = (recv_x.clone(), recv_w.clone(), handle.recv_src_metadata.clone())
    counts = handle.num_unaligned_recv_tokens_per_expert.long()
    starts = handle.psum_num_recv_tokens_per_expert.long() - counts
    permutation = torch.arange(recv_x.size(0))
    generator = torch.Generator().manual_seed(7 + ctx.rank)
    for start, count in zip(starts.tolist(), counts.tolist()):
        permutation[start : start + count] = start + torch.randperm(count, generator=generator)
    recv_x.copy_(recv_x[permutation])
    recv_w.copy_(recv_w[permutation])
    moved_to = torch.empty_like(permutation)
    moved_to[permutation] = torch.arange(permutation.numel())
    slots = handle.recv_src_metadata[:, 2:]
    slots[slots >= 0] = moved_to[slots[slots >= 0].long()].int()
    handle.deterministic_sort(True, False, recv_x, None, None, recv_w, None)
    assert torch.equal(recv_x, expected[0]) and torch.equal(recv_w, expected[1])
    assert torch.equal(handle.recv_src_metadata, expected[2])


def elastic_outputs_keep_dtypes_under_bfloat16_default(ctx, num_ranks_per_node=None):
    """Upstream's harness sets bfloat16 as the default dtype: dispatch, cached / expanded dispatch and (reduced)
    combine still return float32 weights, int32 counts and the rows bitwise; the combined weights rebuild the
    original ones exactly."""
    capacity, num_experts, num_topk = 32, 2 * ctx.world_size, 2
    with default_dtype("bfloat16"):
        buffer = _buffer(ctx, "dtype", num_ranks_per_node, num_max_tokens_per_rank=capacity, hidden=64,
                         num_topk=num_topk)  # fmt: skip
        assert buffer.get_comm_stream() is None  # the CPU executor's comm thread has no stream
        x, topk_idx, weights = _routing(ctx, capacity - ctx.rank, num_experts, num_topk, seed=9)
        everyone = gather(ctx, (x, topk_idx, weights))
        ref = refs.ref_dispatch([e[0] for e in everyone], [e[1] for e in everyone], [e[2] for e in everyone],
                                num_experts, ctx.rank)  # fmt: skip
        for do_expand in (False, True):
            recv_x, _, recv_w, handle, _ = buffer.dispatch(x, topk_idx=topk_idx, topk_weights=weights,
                                                           num_experts=num_experts, do_expand=do_expand)  # fmt: skip
            assert recv_w.dtype == torch.float32
            assert handle.psum_num_recv_tokens_per_expert.dtype == torch.int32
            assert handle.recv_src_metadata.dtype == torch.int32 and handle.dst_buffer_slot_idx.dtype == torch.int32
            if not do_expand:
                assert torch.equal(recv_x, ref.recv_x) and torch.equal(recv_w, ref.recv_topk_weights)
            cached_x, _, cached_w, _, _ = buffer.dispatch(x, handle=handle, topk_weights=weights, do_expand=do_expand)
            assert torch.equal(cached_x, recv_x) and torch.equal(cached_w, recv_w)
            combined, combined_w, _ = buffer.combine(recv_x, handle, topk_weights=recv_w)
            assert combined.dtype == torch.bfloat16 and combined_w.dtype == torch.float32
            assert torch.equal(combined_w, weights.masked_fill(topk_idx < 0, 0.0))
