// mtdeepep._C_cuda: the CUDA/MUSA executor's Python binding. It passes addresses (tensor.data_ptr()) and streams
// (torch.cuda.Stream.cuda_stream) as integers: tensors, streams and events stay torch's, in
// mtdeepep/engines/cuda.py, so this module needs pybind11 and the CUDA runtime only (no torch C++ API), and its host
// code compiles against any torch build's headers.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>

#include "runtime/cuda/buffer.hpp"

namespace py = pybind11;
using namespace mtdeepep::gpu;

namespace {

template <typename T>
T* ptr(uintptr_t address) {
    return reinterpret_cast<T*>(address);
}

gpuStream_t stream_of(uintptr_t handle) {
    return reinterpret_cast<gpuStream_t>(handle);
}

RowFormat row_format(size_t x_bytes, int num_scales, size_t scale_bytes, int num_topk) {
    return RowFormat{x_bytes, num_scales, scale_bytes, num_topk};
}

}  // namespace

PYBIND11_MODULE(_C_cuda, m) {
    m.doc() = "mtdeepep's CUDA/MUSA executor: device buffers over IPC and the kernel launchers (addresses as ints)";
#if defined(MTDEEPEP_MUSA)
    m.attr("platform") = "musa";
#else
    m.attr("platform") = "cuda";
#endif
    m.attr("max_local_experts") = kMaxLocalExperts;
    m.attr("max_channels") = kMaxChannels;

    // Launchers release the GIL: a launch can block (a full queue, a module load), and the ranks of one process
    // (mtdeepep.utils.local_ranks) launch from threads of their own.
    m.def("module_loading_lazy", &module_loading_lazy,
          "1 if the current CUDA context loads modules lazily, 0 if eagerly, -1 if unknown");
    m.def("error_message", &error_message, py::arg("code"), py::arg("cause") = 0, py::arg("detail_rows") = 0,
          py::arg("detail_bound") = 0);
    m.def(
        "encode_error",
        [](int kind, int phase, int peer, int rank) {
            return encode_error(static_cast<ErrorKind>(kind), static_cast<Phase>(phase), peer, rank);
        },
        py::arg("kind"), py::arg("phase"), py::arg("peer"), py::arg("rank"));
    m.def("error_kind", [](uint64_t code) { return static_cast<int>(error_kind(code)); });
    m.def("error_peer", [](uint64_t code) { return error_peer(code); });
    m.def("error_rank", [](uint64_t code) { return error_rank(code); });
    m.def("is_recoverable", [](uint64_t code) { return code != 0 && is_recoverable(error_kind(code)); });
    m.def("error_phase", [](uint64_t code) { return std::string(phase_name(error_phase(code))); });
    m.attr("ERROR_TIMEOUT") = static_cast<int>(ErrorKind::kTimeout);
    m.attr("ERROR_PEER_FAILED") = static_cast<int>(ErrorKind::kPeerFailed);
    m.attr("ERROR_ABORTED") = static_cast<int>(ErrorKind::kAborted);
    m.attr("ERROR_OVERFLOW") = static_cast<int>(ErrorKind::kOverflow);
    m.attr("ERROR_WORST_TOKENS") = static_cast<int>(ErrorKind::kWorstTokens);

    m.def(
        "dispatch_layout",
        [](uintptr_t topk_idx, int num_tokens, int num_topk, int num_ranks, int num_experts, uintptr_t per_rank,
           uintptr_t per_expert, uintptr_t in_rank, int num_sms, uintptr_t stream) {
            launch_dispatch_layout(ptr<const int64_t>(topk_idx), num_tokens, num_topk, num_ranks, num_experts,
                                   ptr<int32_t>(per_rank), ptr<int32_t>(per_expert), ptr<bool>(in_rank), num_sms,
                                   stream_of(stream));
        },
        py::call_guard<py::gil_scoped_release>());
    m.def(
        "send_positions",
        [](uintptr_t in_rank, int num_tokens, int num_ranks, uintptr_t send_head, uintptr_t num_sent,
           uintptr_t stream) {
            launch_send_positions(ptr<const bool>(in_rank), num_tokens, num_ranks, ptr<int32_t>(send_head),
                                  ptr<int32_t>(num_sent), stream_of(stream));
        },
        py::call_guard<py::gil_scoped_release>());
    m.def(
        "cast_to_fp8",
        [](uintptr_t x, int64_t x_stride, int num_tokens, int hidden, bool round_scale, uintptr_t e4m3,
           uintptr_t scales, int num_sms, uintptr_t stream) {
            launch_cast_to_fp8(ptr<const uint16_t>(x), x_stride, num_tokens, hidden, round_scale, ptr<uint8_t>(e4m3),
                               ptr<float>(scales), num_sms, stream_of(stream));
        },
        py::call_guard<py::gil_scoped_release>());
    m.def("normal_capacity",
          [](int num_ranks, int64_t num_nvl_bytes, size_t x_bytes, int num_scales, size_t scale_bytes, int num_topk) {
              return row_region(nullptr, static_cast<size_t>(num_nvl_bytes),
                                row_format(x_bytes, num_scales, scale_bytes, num_topk))
                  .capacity;
          });
    m.def("normal_layout", [](int num_ranks) {
        const NormalLayout layout(num_ranks);
        py::dict d;
        d["poison"] = layout.poison;
        d["notify_flags"] = layout.notify_flags;
        d["barrier_flags"] = layout.barrier_flags;
        d["dispatch_flags"] = layout.dispatch_flags;
        d["combine_flags"] = layout.combine_flags;
        d["arrivals"] = layout.arrivals;
        d["op_counter"] = layout.op_counter;
        d["control_bytes"] = layout.control_bytes;
        return d;
    });
    m.def("low_latency_layout", [](int num_max_tokens, int hidden, int num_ranks, int num_experts) {
        const LowLatencyControl control(num_ranks);
        const LowLatencyHalf half(num_max_tokens, hidden, num_ranks, num_experts);
        py::dict d;
        d["control_bytes"] = control.bytes;
        d["layout_range"] = half.layout_range;
        d["src_info"] = half.src_info;
        d["scales"] = half.scales;
        d["recv_x"] = half.recv_x;
        d["combine_recv"] = half.combine_recv;
        d["half_bytes"] = half.bytes;
        d["num_scales"] = half.num_scales;
        return d;
    });

    py::class_<DeviceBuffer, std::shared_ptr<DeviceBuffer>>(m, "DeviceBuffer")
        .def(py::init<int, int, int64_t, int64_t, double, int>(), py::arg("rank"), py::arg("num_ranks"),
             py::arg("num_nvl_bytes"), py::arg("num_ll_bytes"), py::arg("timeout_s"), py::arg("device"))
        .def("ipc_entry", &DeviceBuffer::ipc_entry)
        .def("connect", &DeviceBuffer::connect, py::call_guard<py::gil_scoped_release>())
        .def("connect_local", &DeviceBuffer::connect_local, py::arg("nvl_bases"), py::arg("ll_bases"))
        .def("status", &DeviceBuffer::status)
        .def("cause", &DeviceBuffer::cause)
        .def("detail", &DeviceBuffer::detail)
        .def(
            "clear_error", [](DeviceBuffer& b, uintptr_t stream) { b.clear_error(stream_of(stream)); },
            py::call_guard<py::gil_scoped_release>())
        .def("abort", &DeviceBuffer::abort)
        .def("set_timeout", &DeviceBuffer::set_timeout)
        .def("destroy", &DeviceBuffer::destroy, py::call_guard<py::gil_scoped_release>())
        .def_property_readonly("destroyed", &DeviceBuffer::destroyed)
        .def_property_readonly("connected", &DeviceBuffer::connected)
        .def_property_readonly("num_sms", &DeviceBuffer::num_sms)
        .def_property_readonly("rank", &DeviceBuffer::rank)
        .def_property_readonly("num_ranks", &DeviceBuffer::num_ranks)
        .def_property_readonly("num_nvl_bytes", &DeviceBuffer::num_nvl_bytes)
        .def_property_readonly("num_ll_bytes", &DeviceBuffer::num_ll_bytes)
        .def_property_readonly("ll_half_bytes", &DeviceBuffer::ll_half_bytes)
        .def_property_readonly("nvl_data_address",
                               [](const DeviceBuffer& b) {
                                   return reinterpret_cast<uintptr_t>(b.nvl_base()) +
                                          NormalLayout(b.num_ranks()).control_bytes;
                               })
        .def_property_readonly("nvl_address",
                               [](const DeviceBuffer& b) { return reinterpret_cast<uintptr_t>(b.nvl_base()); })
        .def_property_readonly("nvl_alloc_bytes", &DeviceBuffer::nvl_alloc_bytes)
        .def_property_readonly("ll_address",
                               [](const DeviceBuffer& b) { return reinterpret_cast<uintptr_t>(b.ll_base()); })
        .def("reset_host_counts",
             [](DeviceBuffer& b) { *reinterpret_cast<volatile int32_t*>(&b.host_mapped()->num_recv_tokens) = -1; })
        .def("host_counts",
             [](DeviceBuffer& b, int num_local_experts) {
                 // Read after the stream that ran the notify was synchronised.
                 const volatile HostMapped* h = b.host_mapped();
                 py::list per_expert;
                 for (int e = 0; e < num_local_experts; ++e)
                     per_expert.append(static_cast<int>(h->num_recv_tokens_per_expert[e]));
                 return py::make_tuple(static_cast<int>(h->num_recv_tokens), per_expert);
             })
        // ---- normal mode ----
        .def(
            "notify",
            [](DeviceBuffer& b, uintptr_t num_sent, uintptr_t per_expert, int num_experts, uintptr_t channel_prefix,
               int num_channels, int expert_alignment, int64_t capacity, int64_t num_worst_tokens, uintptr_t prefix,
               uintptr_t recv_channel_prefix, uintptr_t recv_per_expert, uintptr_t stream) {
                launch_notify_dispatch(b.control(), b.peers(), ptr<const int32_t>(num_sent),
                                       ptr<const int32_t>(per_expert), num_experts, ptr<const int32_t>(channel_prefix),
                                       num_channels, expert_alignment, capacity, num_worst_tokens, ptr<int32_t>(prefix),
                                       ptr<int32_t>(recv_channel_prefix), ptr<int32_t>(recv_per_expert),
                                       b.host_mapped_device(), stream_of(stream));
            },
            py::call_guard<py::gil_scoped_release>())
        .def(
            "barrier",
            [](DeviceBuffer& b, uintptr_t stream) { launch_barrier(b.control(), b.peers(), stream_of(stream)); },
            py::call_guard<py::gil_scoped_release>())
        .def(
            "dispatch_send",
            [](DeviceBuffer& b, uintptr_t x, int64_t x_stride, size_t x_bytes, uintptr_t scales,
               int64_t scale_token_stride, int64_t scale_column_stride, int num_scales, size_t scale_bytes,
               uintptr_t topk_idx, uintptr_t topk_weights, int num_topk, int num_tokens, int num_experts,
               uintptr_t send_head, uintptr_t prefix, int64_t num_worst_tokens, int num_sms, uintptr_t stream) {
                DispatchSource source{ptr<const uint8_t>(x),
                                      x_stride,
                                      ptr<const uint8_t>(scales),
                                      scale_token_stride,
                                      scale_column_stride,
                                      ptr<const int64_t>(topk_idx),
                                      ptr<const float>(topk_weights),
                                      num_tokens,
                                      num_experts};
                launch_dispatch_send(b.control(), b.peers(), source,
                                     row_format(x_bytes, num_scales, scale_bytes, num_topk),
                                     ptr<const int32_t>(send_head), ptr<const int32_t>(prefix), num_worst_tokens,
                                     num_sms, stream_of(stream));
            },
            py::call_guard<py::gil_scoped_release>())
        .def(
            "dispatch_receive",
            [](DeviceBuffer& b, size_t x_bytes, int num_scales, size_t scale_bytes, int num_topk, uintptr_t prefix,
               uintptr_t out_x, uintptr_t out_scales, uintptr_t out_topk_idx, uintptr_t out_topk_weights,
               uintptr_t out_src_idx, int64_t num_rows, int num_sms, uintptr_t stream) {
                DispatchOutputs outputs{ptr<uint8_t>(out_x),        ptr<uint8_t>(out_scales),
                                        ptr<int64_t>(out_topk_idx), ptr<float>(out_topk_weights),
                                        ptr<int32_t>(out_src_idx),  num_rows};
                launch_dispatch_receive(b.control(), b.peers(), row_format(x_bytes, num_scales, scale_bytes, num_topk),
                                        ptr<const int32_t>(prefix), outputs, num_sms, stream_of(stream));
            },
            py::call_guard<py::gil_scoped_release>())
        .def(
            "combine_send",
            [](DeviceBuffer& b, int kind, int hidden, int num_topk, uintptr_t x, uintptr_t topk_weights,
               uintptr_t prefix, int num_sms, uintptr_t stream) {
                launch_combine_send(b.control(), b.peers(), static_cast<FloatKind>(kind), hidden, num_topk,
                                    ptr<const uint8_t>(x), ptr<const float>(topk_weights), ptr<const int32_t>(prefix),
                                    num_sms, stream_of(stream));
            },
            py::call_guard<py::gil_scoped_release>())
        .def(
            "combine_reduce",
            [](DeviceBuffer& b, int kind, int hidden, int num_topk, uintptr_t x, uintptr_t topk_weights,
               uintptr_t prefix, uintptr_t send_head, int num_tokens, uintptr_t bias0, uintptr_t bias1, uintptr_t out,
               uintptr_t out_weights, int num_sms, uintptr_t stream) {
                launch_combine_reduce(b.control(), b.peers(), static_cast<FloatKind>(kind), hidden, num_topk,
                                      ptr<const uint8_t>(x), ptr<const float>(topk_weights), ptr<const int32_t>(prefix),
                                      ptr<const int32_t>(send_head), num_tokens, ptr<const uint8_t>(bias0),
                                      ptr<const uint8_t>(bias1), ptr<uint8_t>(out), ptr<float>(out_weights), num_sms,
                                      stream_of(stream));
            },
            py::call_guard<py::gil_scoped_release>())
        // ---- low-latency mode ----
        .def(
            "ll_enter",
            [](DeviceBuffer& b, uint64_t seq, uintptr_t stream) {
                launch_low_latency_enter(b.low_latency_peers(), b.rank(), seq, stream_of(stream));
            },
            py::call_guard<py::gil_scoped_release>())
        .def(
            "ll_dispatch_send",
            [](DeviceBuffer& b, uint64_t seq, uintptr_t x, int64_t x_stride, uintptr_t topk_idx, int num_tokens,
               int num_topk, int hidden, int num_max_tokens, int num_experts, bool use_fp8, bool round_scale,
               bool use_ue8m0, uintptr_t slots, uintptr_t expert_counts, uintptr_t expert_begin, int num_sms,
               uintptr_t stream) {
                LowLatencyDispatchArgs args{ptr<const uint16_t>(x),
                                            x_stride,
                                            ptr<const int64_t>(topk_idx),
                                            num_tokens,
                                            num_topk,
                                            hidden,
                                            num_max_tokens,
                                            num_experts,
                                            use_fp8,
                                            round_scale,
                                            use_ue8m0,
                                            ptr<int32_t>(slots),
                                            ptr<int32_t>(expert_counts),
                                            ptr<int32_t>(expert_begin)};
                launch_low_latency_dispatch_send(b.control(), b.low_latency_peers(), seq, args, num_sms,
                                                 stream_of(stream));
            },
            py::call_guard<py::gil_scoped_release>())
        .def(
            "ll_dispatch_receive",
            [](DeviceBuffer& b, uint64_t seq, int num_max_tokens, int hidden, int num_experts, uintptr_t recv_count,
               uintptr_t cumulative_stats, uintptr_t wait_ns, uintptr_t stream) {
                launch_low_latency_dispatch_receive(
                    b.control(), b.low_latency_peers(), seq, num_max_tokens, hidden, num_experts,
                    ptr<int32_t>(recv_count), ptr<int32_t>(cumulative_stats), ptr<int64_t>(wait_ns), stream_of(stream));
            },
            py::call_guard<py::gil_scoped_release>())
        .def(
            "ll_combine_send",
            [](DeviceBuffer& b, uint64_t seq, uintptr_t x, uintptr_t src_info, uintptr_t layout_range, int num_topk,
               int hidden, int num_max_tokens, int num_experts, int num_sms, uintptr_t stream) {
                LowLatencyCombineArgs args{ptr<const uint16_t>(x),
                                           ptr<const int32_t>(src_info),
                                           ptr<const int64_t>(layout_range),
                                           nullptr,
                                           nullptr,
                                           0,
                                           num_topk,
                                           hidden,
                                           num_max_tokens,
                                           num_experts,
                                           nullptr};
                launch_low_latency_combine_send(b.control(), b.low_latency_peers(), seq, args, num_sms,
                                                stream_of(stream));
            },
            py::call_guard<py::gil_scoped_release>())
        .def(
            "ll_combine_receive",
            [](DeviceBuffer& b, uint64_t seq, uintptr_t topk_idx, uintptr_t topk_weights, int num_tokens, int num_topk,
               int hidden, int num_max_tokens, int num_experts, uintptr_t out, uintptr_t wait_ns, int num_sms,
               uintptr_t stream) {
                LowLatencyCombineArgs args{nullptr,
                                           nullptr,
                                           nullptr,
                                           ptr<const int64_t>(topk_idx),
                                           ptr<const float>(topk_weights),
                                           num_tokens,
                                           num_topk,
                                           hidden,
                                           num_max_tokens,
                                           num_experts,
                                           ptr<uint16_t>(out)};
                launch_low_latency_combine_receive(b.control(), b.low_latency_peers(), seq, args, ptr<int64_t>(wait_ns),
                                                   num_sms, stream_of(stream));
            },
            py::call_guard<py::gil_scoped_release>());
}
