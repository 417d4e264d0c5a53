"""Performance knobs with DeepEP's names; the CPU executor maps channels to its sizing and handle layout."""

from __future__ import annotations

from dataclasses import dataclass

# Metadata that travels with each dispatched row besides the hidden bytes: up to 32 top-k ids (int64) and
# weights (float32) plus the source token index (int32).
_ROW_METADATA_BYTES = 32 * (8 + 4) + 4
_ALIGNMENT = 128


@dataclass
class Config:
    """Same fields and positional order as `deep_ep.Config`.

    Channels are `num_sms // 2`; `num_max_nvl_chunked_recv_tokens` is the receive capacity of one channel per
    peer, which sets the buffer size hints.
    """

    num_sms: int = 20
    num_max_nvl_chunked_send_tokens: int = 6
    num_max_nvl_chunked_recv_tokens: int = 256
    num_max_rdma_chunked_send_tokens: int = 6
    num_max_rdma_chunked_recv_tokens: int = 256

    def __post_init__(self) -> None:
        if self.num_sms <= 0 or self.num_sms % 2:
            raise ValueError(f"num_sms must be a positive even number, got {self.num_sms}")
        for name in (
            "num_max_nvl_chunked_send_tokens",
            "num_max_nvl_chunked_recv_tokens",
            "num_max_rdma_chunked_send_tokens",
            "num_max_rdma_chunked_recv_tokens",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_max_nvl_chunked_send_tokens > self.num_max_nvl_chunked_recv_tokens:
            raise ValueError("num_max_nvl_chunked_send_tokens must not exceed num_max_nvl_chunked_recv_tokens")

    @property
    def num_channels(self) -> int:
        return self.num_sms // 2

    def _hint(self, hidden_bytes: int, num_peers: int, recv_tokens: int) -> int:
        if hidden_bytes <= 0 or num_peers <= 0:
            raise ValueError(f"hidden_bytes and num_ranks must be positive, got {hidden_bytes}, {num_peers}")
        scale_bytes = (hidden_bytes + 127) // 128 * 4  # room for FP8 scales when hidden_bytes counts FP8 bytes
        row = hidden_bytes + scale_bytes + _ROW_METADATA_BYTES
        size = self.num_channels * recv_tokens * num_peers * row
        return (size + _ALIGNMENT - 1) // _ALIGNMENT * _ALIGNMENT

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of `num_nvl_bytes` that let one round carry every channel's receive window from every peer."""
        return self._hint(hidden_bytes, num_ranks, self.num_max_nvl_chunked_recv_tokens)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of `num_rdma_bytes` for the network stage, sized like the NVL hint over the node count
        (8 ranks per node, as upstream's hint assumes)."""
        num_nodes = max(1, (num_ranks + 7) // 8)
        return self._hint(hidden_bytes, num_nodes, self.num_max_rdma_chunked_recv_tokens)
