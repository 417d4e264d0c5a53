"""`import mtdeepep as deep_ep` must accept DeepEP's names, argument order, defaults and return shapes."""

import inspect

import pytest
import torch

import mtdeepep as deep_ep

UPSTREAM_SIGNATURES = {
    "__init__": [
        ("group", inspect.Parameter.empty), ("num_nvl_bytes", 0), ("num_rdma_bytes", 0), ("low_latency_mode", False),
        ("num_qps_per_rank", 24), ("allow_nvlink_for_low_latency_mode", True), ("allow_mnnvl", False),
        ("use_fabric", False), ("explicitly_destroy", False), ("enable_shrink", False), ("comm", None),
    ],
    "get_dispatch_layout": [
        ("topk_idx", inspect.Parameter.empty), ("num_experts", inspect.Parameter.empty), ("previous_event", None),
        ("async_finish", False), ("allocate_on_comm_stream", False),
    ],
    "dispatch": [
        ("x", inspect.Parameter.empty), ("handle", None), ("num_tokens_per_rank", None),
        ("num_tokens_per_rdma_rank", None), ("is_token_in_rank", None), ("num_tokens_per_expert", None),
        ("topk_idx", None), ("topk_weights", None), ("expert_alignment", 1), ("num_worst_tokens", 0),
        ("config", None), ("previous_event", None), ("async_finish", False), ("allocate_on_comm_stream", False),
    ],
    "combine": [
        ("x", inspect.Parameter.empty), ("handle", inspect.Parameter.empty), ("topk_weights", None), ("bias", None),
        ("config", None), ("previous_event", None), ("async_finish", False), ("allocate_on_comm_stream", False),
    ],
    "get_local_buffer_tensor": [
        ("dtype", inspect.Parameter.empty), ("size", None), ("offset", 0), ("use_rdma_buffer", False),
    ],
}  # fmt: skip


@pytest.mark.parametrize("method", sorted(UPSTREAM_SIGNATURES))
def test_positional_parameters_match_upstream(method):
    parameters = [
        p
        for p in inspect.signature(getattr(deep_ep.Buffer, method)).parameters.values()
        if p.name != "self" and p.kind != inspect.Parameter.KEYWORD_ONLY
    ]
    assert [(p.name, p.default) for p in parameters] == UPSTREAM_SIGNATURES[method]


def test_module_names():
    for name in ("Buffer", "EventOverlap", "Config", "topk_idx_t"):
        assert hasattr(deep_ep, name)
    assert deep_ep.topk_idx_t == torch.int64
    assert deep_ep.Buffer.num_sms == 20
    for name in ("set_num_sms", "capture", "get_dispatch_config", "get_combine_config", "destroy",
                 "get_comm_stream", "get_num_rdma_ranks", "get_rdma_rank", "get_root_rdma_rank",
                 "get_local_device_id", "is_sm90_compiled"):  # fmt: skip
        assert callable(getattr(deep_ep.Buffer, name)), name


def test_config_positional_order_and_hints():
    config = deep_ep.Config(24, 6, 256, 6, 128)
    assert (
        config.num_sms,
        config.num_max_nvl_chunked_send_tokens,
        config.num_max_nvl_chunked_recv_tokens,
        config.num_max_rdma_chunked_send_tokens,
        config.num_max_rdma_chunked_recv_tokens,
    ) == (24, 6, 256, 6, 128)
    hidden_bytes = 7168 * 2
    small, large = config.get_nvl_buffer_size_hint(hidden_bytes, 2), config.get_nvl_buffer_size_hint(hidden_bytes, 8)
    assert 0 < small < large and small % 128 == 0
    # the hint holds a full round: every channel's receive window from every rank
    assert small >= config.num_channels * 256 * 2 * hidden_bytes
    assert config.get_rdma_buffer_size_hint(hidden_bytes, 16) > 0
    for bad in [dict(num_sms=3), dict(num_max_nvl_chunked_recv_tokens=0), dict(num_max_nvl_chunked_send_tokens=300)]:
        with pytest.raises(ValueError):
            deep_ep.Config(**bad)


def test_static_helpers():
    for ranks in (1, 2, 3, 4, 8, 12, 200):
        assert isinstance(deep_ep.Buffer.get_dispatch_config(ranks), deep_ep.Config)
        assert isinstance(deep_ep.Buffer.get_combine_config(ranks), deep_ep.Config)
    assert deep_ep.Buffer.get_dispatch_config(8).num_max_nvl_chunked_send_tokens == 6
    with pytest.raises(ValueError):
        deep_ep.Buffer.set_num_sms(7)
    previous = deep_ep.Buffer.num_sms
    deep_ep.Buffer.set_num_sms(24)
    assert deep_ep.Buffer.get_dispatch_config(2).num_sms == 24
    deep_ep.Buffer.set_num_sms(previous)
    event = deep_ep.Buffer.capture()
    assert isinstance(event, deep_ep.EventOverlap) and event.query()
    event.current_stream_wait()
    with event:
        pass


def test_exceptions_are_catchable_the_usual_ways():
    assert issubclass(deep_ep.CommTimeoutError, TimeoutError)
    assert issubclass(deep_ep.CommTimeoutError, deep_ep.CommError)
    assert issubclass(deep_ep.CommError, RuntimeError)
    assert issubclass(deep_ep.GroupMismatchError, ValueError)
