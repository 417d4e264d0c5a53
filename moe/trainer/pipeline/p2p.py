"""The pipeline's point-to-point transport: how activations and gradients move between the stages' ranks.

    torch    torch.distributed's `isend` / `irecv` on the pipeline group, as torch's schedules post them (default)
    deepep   DeepEP 2.1's `ElasticBuffer.pp_send` / `pp_recv` of a buffer over the pipeline group (mtdeepep's
             `pp_ring.py`), Megatron's `use_ring_exchange_p2p` in spirit: another transport under the same schedule

The seam: torch's stages build a `dist.P2POp` per tensor (`get_fwd_send_ops`, `get_fwd_recv_ops`, ...) and the
schedules hand those lists to `dist.batch_isend_irecv` (or call `op.op(...)` themselves), then `wait()` each returned
work. `BufferP2P.adopt` points each op's `op` at this transport's send or receive instead of `dist.isend` /
`dist.irecv`; on a backend without coalescing (gloo) `batch_isend_irecv` calls `op.op(tensor, group=, tag=,
group_dst= / group_src=)` one by one, so the schedules run unchanged. A backend that coalesces (NCCL) would wrap the
calls in its coalescing manager: refused at construction.

Semantics kept from torch's P2P (and gloo's): posting never blocks and messages of one pair match in the order they
were posted. `pp_send` copies the tensor at once (so a send is complete when posted), and the buffer is configured
with a slot for every message of a step, so that it never waits for the receiver while the schedule expects an
asynchronous send. `pp_recv` blocks, so a receive is deferred: posting queues it per peer, and waiting on it
receives, in posting order, every receive of that peer queued up to it.
"""

from __future__ import annotations

import collections
import time

import torch
import torch.distributed as dist

from mtdeepep.elastic import ElasticBuffer

P2P_TRANSPORTS = ("torch", "deepep")


class _Sent:
    """The work of a `pp_send`: complete when posted (the buffer holds a copy)."""

    def wait(self, timeout=None) -> bool:
        del timeout
        return True

    def is_completed(self) -> bool:
        return True


class _Receive:
    """A posted receive into `tensor` from group rank `peer`: received when waited (see `BufferP2P`)."""

    def __init__(self, transport: BufferP2P, tensor: torch.Tensor, peer: int) -> None:
        self.transport, self.tensor, self.peer = transport, tensor, peer
        self.done = False

    def wait(self, timeout=None) -> bool:
        del timeout  # every receive is bounded by the buffer's timeout (CommTimeoutError naming the sender)
        self.transport.receive_until(self)
        return True

    def is_completed(self) -> bool:
        return self.done


class BufferP2P:
    """Pipeline P2P through `pp_send` / `pp_recv` of an `ElasticBuffer` over `group` (collective to build).

    Args:
        group: the pipeline group (torch's stages address their peers by its ranks); its neighbours on the ring
            (rank +- 1 mod size) are the only peers of 1F1B, ZB-H1, their interleaved forms and DualPipeV.
        max_tensor_bytes: the largest activation or gradient a stage sends.
        max_inflight: messages one rank may have sent to one neighbour and not yet received there: a slot per message
            of a step, so that a send never waits (see the module docstring).
        timeout_s: bound of every wait (`CommTimeoutError` naming the late rank); None: `ElasticBuffer`'s default.

    Attributes: `buffer`, and `wait_s`, the seconds spent inside `pp_send` / `pp_recv` since `reset_wait`.
    """

    def __init__(
        self, group: dist.ProcessGroup, *, max_tensor_bytes: int, max_inflight: int, timeout_s: float | None = None
    ) -> None:
        if group is None or group.size() < 2:
            raise ValueError("the deepep pipeline transport needs a pipeline group of 2 ranks or more")
        device = torch.device("cpu")
        if type(group) is dist.ProcessGroup and group._get_backend(device).supports_coalescing:
            raise ValueError(
                "the deepep pipeline transport hands torch's schedules its own P2P ops, which a coalescing backend "
                f"({dist.get_backend(group)}) would batch as its own: use pipeline_p2p_transport = 'torch' there"
            )
        num_bytes = ElasticBuffer.get_pp_buffer_size_hint(max_tensor_bytes, max_inflight)
        timeout = {} if timeout_s is None else {"num_cpu_timeout_secs": timeout_s}
        self.buffer = ElasticBuffer(group, num_bytes=num_bytes, explicitly_destroy=True, **timeout)
        self.buffer.pp_set_config(max_tensor_bytes, max_inflight)
        self.group = group
        self._queued: dict[int, collections.deque[_Receive]] = collections.defaultdict(collections.deque)
        self.wait_s = 0.0

    def adopt(self, ops: list[dist.P2POp]) -> list[dist.P2POp]:
        """Points `ops` (torch's, on this transport's group) at `pp_send` / `pp_recv`; returns them."""
        for op in ops:
            if op.group is not self.group:
                raise ValueError("a pipeline P2P op on another group than the transport's")
            if op.op is dist.isend:
                op.op = self._send
            elif op.op is dist.irecv:
                op.op = self._post_receive
            else:
                raise ValueError(f"not a torch.distributed send or receive: {op.op!r}")
        return ops

    def _send(self, tensor: torch.Tensor, group=None, tag: int = 0, group_dst=None, group_src=None) -> _Sent:
        # batch_isend_irecv names the peer `group_src` for any op that is not dist.isend: either keyword is the peer.
        del group, tag
        peer = group_dst if group_dst is not None else group_src
        start = time.perf_counter()
        self.buffer.pp_send(tensor.contiguous(), peer)
        self.wait_s += time.perf_counter() - start
        return _Sent()

    def _post_receive(self, tensor: torch.Tensor, group=None, tag: int = 0, group_dst=None, group_src=None):
        del group, tag
        peer = group_src if group_src is not None else group_dst
        receive = _Receive(self, tensor, peer)
        self._queued[peer].append(receive)
        return receive

    def receive_until(self, receive: _Receive) -> None:
        """Receives the queued receives of `receive.peer`, oldest first, up to `receive` (the order they were posted
        is the order the peer sent them)."""
        queue = self._queued[receive.peer]
        start = time.perf_counter()
        while not receive.done:
            head = queue.popleft()
            target = head.tensor if head.tensor.is_contiguous() else torch.empty_like(head.tensor).contiguous()
            self.buffer.pp_recv(target, head.peer)
            if target is not head.tensor:
                head.tensor.copy_(target)
            head.done = True
        self.wait_s += time.perf_counter() - start

    def check_drained(self, where: str) -> None:
        """Every posted receive was received (RuntimeError otherwise: a later step would match the wrong message)."""
        left = {peer: len(queue) for peer, queue in self._queued.items() if queue}
        if left:
            raise RuntimeError(f"{where}: receives posted and never waited on, per pipeline peer: {left}")

    def reset_wait(self) -> None:
        self.wait_s = 0.0

    def destroy(self) -> None:
        """Releases the buffer (every message of a finished step was received: the schedule waited on each).
        Idempotent."""
        if self.buffer is not None:
            buffer, self.buffer = self.buffer, None
            buffer.destroy()
