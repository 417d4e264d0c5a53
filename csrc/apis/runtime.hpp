// Bindings of the runtime base, its events, and the CPU protocols on top of it (normal and low-latency mode).
#pragma once

#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/python.h>

#include "apis/errors.hpp"
#include "runtime/cpu/low_latency.hpp"
#include "runtime/cpu/normal.hpp"
#include "runtime/runtime.hpp"
#include "shm/segment.hpp"

namespace mtdeepep::apis {

namespace py = pybind11;

namespace detail {

inline cpu::FloatKind float_kind_of(at::ScalarType dtype) {
    switch (dtype) {
        case at::kBFloat16:
            return cpu::FloatKind::kBFloat16;
        case at::kHalf:
            return cpu::FloatKind::kFloat16;
        case at::kFloat:
            return cpu::FloatKind::kFloat32;
        default:
            throw std::invalid_argument("mtdeepep: rows must be bfloat16, float16 or float32");
    }
}

// A receive hook as a Python callable that releases the GIL while it waits for the peers.
inline py::object python_hook(const std::optional<cpu::Hook>& hook) {
    if (!hook) return py::none();
    cpu::Hook body = *hook;
    return py::cpp_function([body] {
        py::gil_scoped_release release;
        body();
    });
}

}  // namespace detail

inline void register_runtime(py::module_& m) {
    using detail::float_kind_of;
    auto release = py::call_guard<py::gil_scoped_release>();

    py::class_<Event, EventPtr>(m, "EventHandle")
        .def(py::init([] { return completed_event(); }),
             "An event on the current stream (the caller's thread on CPU): already complete.")
        .def("wait", &Event::wait, release)
        .def("current_stream_wait", &Event::wait, release, "DeepEP's name: the caller waits for the event.")
        .def("query", &Event::query)
        .def_static(
            "pending", [] { return std::make_shared<Event>(); },
            "An event that completes when `complete()` is called (for work that Python runs on its own threads).")
        .def(
            "complete",
            [](Event& self, const py::object& error) {
                if (error.is_none()) return self.complete();
                self.complete(std::make_exception_ptr(PythonError(error)));  // every wait re-raises it as it was
            },
            py::arg("error") = py::none(),
            "Completes the event, with `error` (an exception) re-raised by every wait if given.");

    py::class_<Runtime, std::shared_ptr<Runtime>>(m, "Runtime")
        .def(py::init(&Runtime::create), py::arg("rank"), py::arg("num_ranks"), py::arg("num_nvl_bytes"),
             py::arg("num_ll_bytes"), py::arg("timeout_s"), py::arg("num_threads"))
        .def("segment_name", &Runtime::segment_name)
        .def("pid", &Runtime::pid)
        .def("connect", &Runtime::connect, py::arg("names"), py::arg("pids"), py::arg("uid"), release)
        .def("is_available", &Runtime::is_available)
        .def("uid", &Runtime::uid)
        .def("destroy", &Runtime::destroy, release)
        .def("interrupt", &Runtime::interrupt, py::arg("reason"), release)
        .def("set_timeout", &Runtime::set_timeout, py::arg("timeout_s"))
        .def("timeout_s", &Runtime::timeout_s)
        .def("set_num_threads", &Runtime::set_num_threads)
        .def("has_queued_work", &Runtime::has_queued_work)
        .def("num_nvl_bytes", &Runtime::num_nvl_bytes)
        .def("num_ll_bytes", &Runtime::num_ll_bytes)
        .def(
            "region_addresses",
            [](const Runtime& self, bool low_latency_area) {
                // Every rank's normal region (or low-latency area) as mapped in this process: the peer table of
                // executors whose kernels address the peers directly (the Triton executor). Valid while the
                // runtime lives and is connected; the views of `get_local_buffer_tensor` keep only this rank's.
                self.check_usable();
                if (!self.has_peers()) throw CommError("mtdeepep: region_addresses before connect()");
                std::vector<int64_t> addresses;
                for (int r = 0; r < self.num_ranks(); ++r)
                    addresses.push_back(
                        reinterpret_cast<int64_t>(low_latency_area ? self.ll_region(r) : self.nvl_region(r)));
                return addresses;
            },
            py::arg("low_latency_area"),
            "The address of every rank's normal region (or low-latency area) in this process (after connect).")
        .def(
            "get_local_buffer_tensor",
            [](const Runtime& self, const py::object& dtype, int64_t offset, bool low_latency_area) {
                return self.get_local_buffer_tensor(torch::python::detail::py_object_to_dtype(dtype), offset,
                                                    low_latency_area);
            },
            py::arg("dtype"), py::arg("offset"), py::arg("low_latency_area"));

    using cpu::NormalProtocol;
    py::class_<NormalProtocol, std::shared_ptr<NormalProtocol>>(m, "NormalProtocol")
        .def(py::init([](RuntimePtr runtime) { return std::make_shared<NormalProtocol>(std::move(runtime)); }))
        .def("get_dispatch_layout", &NormalProtocol::get_dispatch_layout, release)
        .def("dispatch", &NormalProtocol::dispatch, release)
        .def("combine", &NormalProtocol::combine, release)
        .def(
            "empty",
            [](NormalProtocol& self, const std::vector<int64_t>& sizes, const py::object& dtype) {
                return self.empty(sizes, torch::python::detail::py_object_to_dtype(dtype));
            },
            py::arg("sizes"), py::arg("dtype"))
        .def(
            "region_empty",
            [](NormalProtocol& self, const std::vector<int64_t>& sizes, const py::object& dtype, int num_topk) {
                return self.region_empty(sizes, torch::python::detail::py_object_to_dtype(dtype), num_topk);
            },
            py::arg("sizes"), py::arg("dtype"), py::arg("num_topk"));

    using cpu::LowLatencyProtocol;
    py::class_<LowLatencyProtocol, std::shared_ptr<LowLatencyProtocol>>(m, "LowLatencyProtocol")
        .def(py::init([](RuntimePtr runtime, int rank, int num_ranks, bool shared_memory) {
                 return std::make_shared<LowLatencyProtocol>(std::move(runtime), rank, num_ranks, shared_memory);
             }),
             py::arg("runtime"), py::arg("rank"), py::arg("num_ranks"), py::arg("shared_memory"))
        .def_static("size_hint", &LowLatencyProtocol::size_hint)
        .def("uses_shared_memory", &LowLatencyProtocol::uses_shared_memory)
        .def("dispatch",
             [](LowLatencyProtocol& self, const at::Tensor& x, const at::Tensor& topk_idx,
                const cpu::OptTensor& cumulative_stats, const cpu::OptTensor& wait_stats,
                int num_max_dispatch_tokens_per_rank, int num_experts, bool use_fp8, bool round_scale, bool use_ue8m0,
                bool async_finish, bool return_recv_hook) {
                 cpu::LowLatencyDispatchResult result;
                 {
                     py::gil_scoped_release unlocked;
                     result =
                         self.dispatch(x, topk_idx, cumulative_stats, wait_stats, num_max_dispatch_tokens_per_rank,
                                       num_experts, use_fp8, round_scale, use_ue8m0, async_finish, return_recv_hook);
                 }
                 auto& [recv_x, recv_scales, recv_count, src_info, layout_range, seq, event, hook] = result;
                 return py::make_tuple(recv_x, recv_scales, recv_count, src_info, layout_range, seq, event,
                                       detail::python_hook(hook));
             })
        .def("combine",
             [](LowLatencyProtocol& self, const at::Tensor& x, const at::Tensor& topk_idx,
                const at::Tensor& topk_weights, const at::Tensor& src_info, const at::Tensor& layout_range,
                const cpu::OptTensor& wait_stats, int num_max_dispatch_tokens_per_rank, int num_experts,
                int64_t dispatch_uid, int64_t dispatch_seq, bool zero_copy, bool async_finish, bool return_recv_hook,
                const cpu::OptTensor& out) {
                 cpu::LowLatencyCombineResult result;
                 {
                     py::gil_scoped_release unlocked;
                     result = self.combine(x, topk_idx, topk_weights, src_info, layout_range, wait_stats,
                                           num_max_dispatch_tokens_per_rank, num_experts, dispatch_uid, dispatch_seq,
                                           zero_copy, async_finish, return_recv_hook, out);
                 }
                 auto& [combined, event, hook] = result;
                 return py::make_tuple(combined, event, detail::python_hook(hook));
             })
        .def("collective_dispatch_send", &LowLatencyProtocol::collective_dispatch_send, release)
        .def("collective_dispatch_recv", &LowLatencyProtocol::collective_dispatch_recv, release)
        .def("collective_combine_send", &LowLatencyProtocol::collective_combine_send, release)
        .def("collective_combine_recv", &LowLatencyProtocol::collective_combine_recv, release)
        .def("next_combine_buffer", &LowLatencyProtocol::next_combine_buffer)
        .def("clean", &LowLatencyProtocol::clean, release);

    m.def(
        "get_dispatch_layout",
        [](const at::Tensor& topk_idx, int num_experts, int num_ranks) {
            const int num_tokens = static_cast<int>(topk_idx.size(0)), num_topk = static_cast<int>(topk_idx.size(1));
            auto per_rank = at::empty({num_ranks}, at::kInt);
            auto per_expert = at::empty({num_experts}, at::kInt);
            auto in_rank = at::empty({num_tokens, num_ranks}, at::kBool);
            cpu::get_dispatch_layout(topk_idx.data_ptr<int64_t>(), num_tokens, num_topk, num_ranks, num_experts,
                                     per_rank.data_ptr<int32_t>(), per_expert.data_ptr<int32_t>(),
                                     in_rank.data_ptr<bool>());
            return std::make_tuple(per_rank, per_expert, in_rank);
        },
        py::arg("topk_idx"), py::arg("num_experts"), py::arg("num_ranks"), release,
        "The layout kernel on the caller's thread: checked contiguous int64 topk_idx [T, K] -> (num_tokens_per_rank "
        "[R] "
        "int32, num_tokens_per_expert [E] int32, is_token_in_rank [T, R] bool).");
    m.def(
        "accumulate_rows",
        [](const at::Tensor& rows, const at::Tensor& tokens, at::Tensor& acc) {
            // acc[tokens[k]] += rows[k] in FP32, for checked contiguous rows [n, H] (bf16/f16/f32), tokens [n] int32,
            // acc [T, H] float32.
            cpu::accumulate_rows(float_kind_of(rows.scalar_type()), static_cast<const uint8_t*>(rows.data_ptr()),
                                 nullptr, tokens.data_ptr<int32_t>(), static_cast<size_t>(rows.size(0)),
                                 static_cast<int>(rows.size(1)), 0, acc.data_ptr<float>(), nullptr);
        },
        py::arg("rows"), py::arg("tokens"), py::arg("acc"), release,
        "acc[tokens[k]] += rows[k] in FP32 (the multi-round combine kernel).");
    m.def(
        "finish_accumulation",
        [](const at::Tensor& acc, const std::optional<at::Tensor>& bias0, const std::optional<at::Tensor>& bias1,
           at::Tensor& out) {
            cpu::finish_accumulation(float_kind_of(out.scalar_type()), acc.data_ptr<float>(),
                                     static_cast<int>(acc.size(0)), static_cast<int>(acc.size(1)),
                                     bias0 ? static_cast<const uint8_t*>(bias0->data_ptr()) : nullptr,
                                     bias1 ? static_cast<const uint8_t*>(bias1->data_ptr()) : nullptr,
                                     static_cast<uint8_t*>(out.data_ptr()));
        },
        py::arg("acc"), py::arg("bias0"), py::arg("bias1"), py::arg("out"), release,
        "out = acc (+ biases in out's dtype), rounded once to out's dtype.");
    m.def("cleanup_stale_segments", &shm::cleanup_stale_segments,
          "Unlink this user's mtdeepep segments whose creator process has exited; returns how many.");
    m.def("shutdown_all_runtimes", &shutdown_all_runtimes, release,
          "At exit: abort the waits of every live runtime of this process and destroy it (joins the comm threads).");
}

}  // namespace mtdeepep::apis
