#include "low_latency/bindings.hpp"

#include <pybind11/functional.h>
#include <pybind11/stl.h>
#include <torch/python.h>

#include "common/gil.hpp"
#include "low_latency/runtime.hpp"

namespace py = pybind11;
using mtdeepep::low_latency::Hook;
using mtdeepep::low_latency::LowLatencyRuntime;
using mtdeepep::low_latency::OptTensor;

namespace {

// A receive hook as a Python callable that releases the GIL while it waits for the peers.
py::object python_hook(const std::optional<Hook>& hook) {
    if (!hook) return py::none();
    Hook body = *hook;
    return py::cpp_function([body] {
        py::gil_scoped_release release;
        body();
    });
}

py::tuple dispatch(LowLatencyRuntime& self, const at::Tensor& x, const at::Tensor& topk_idx,
                   const OptTensor& cumulative_stats, const OptTensor& wait_stats, int num_max_dispatch_tokens_per_rank,
                   int num_experts, bool use_fp8, bool round_scale, bool use_ue8m0, bool async_finish,
                   bool return_recv_hook) {
    mtdeepep::low_latency::DispatchResult result;
    {
        py::gil_scoped_release release;
        result = self.dispatch(x, topk_idx, cumulative_stats, wait_stats, num_max_dispatch_tokens_per_rank, num_experts,
                               use_fp8, round_scale, use_ue8m0, async_finish, return_recv_hook);
    }
    auto& [recv_x, recv_scales, recv_count, src_info, layout_range, event, hook] = result;
    return py::make_tuple(recv_x, recv_scales, recv_count, src_info, layout_range, event, python_hook(hook));
}

py::tuple combine(LowLatencyRuntime& self, const at::Tensor& x, const at::Tensor& topk_idx,
                  const at::Tensor& topk_weights, const at::Tensor& src_info, const at::Tensor& layout_range,
                  const OptTensor& wait_stats, int num_max_dispatch_tokens_per_rank, int num_experts, bool zero_copy,
                  bool async_finish, bool return_recv_hook, const OptTensor& out) {
    mtdeepep::low_latency::CombineResult result;
    {
        py::gil_scoped_release release;
        result =
            self.combine(x, topk_idx, topk_weights, src_info, layout_range, wait_stats,
                         num_max_dispatch_tokens_per_rank, num_experts, zero_copy, async_finish, return_recv_hook, out);
    }
    auto& [combined, event, hook] = result;
    return py::make_tuple(combined, event, python_hook(hook));
}

}  // namespace

void register_low_latency(py::module_& m) {
    using Runtime = LowLatencyRuntime;
    auto release = py::call_guard<py::gil_scoped_release>();
    py::class_<Runtime, std::shared_ptr<Runtime>>(m, "LowLatencyRuntime")
        .def(py::init([](int rank, int num_ranks, int64_t num_rdma_bytes, double timeout_s, int num_threads) {
                 return std::shared_ptr<Runtime>(new Runtime(rank, num_ranks, num_rdma_bytes, timeout_s, num_threads),
                                                 mtdeepep::ReleaseGilDelete<Runtime>{});
             }),
             py::arg("rank"), py::arg("num_ranks"), py::arg("num_rdma_bytes"), py::arg("timeout_s"),
             py::arg("num_threads"))
        .def_static("size_hint", &Runtime::size_hint)
        .def("segment_name", &Runtime::segment_name)
        .def("pid", &Runtime::pid)
        .def("sync", &Runtime::sync, release)
        .def("sync_local", &Runtime::sync_local)
        .def("uses_shared_memory", &Runtime::uses_shared_memory)
        .def("destroy", &Runtime::destroy, release)
        .def("set_timeout", &Runtime::set_timeout)
        .def("set_num_threads", &Runtime::set_num_threads)
        .def("num_rdma_bytes", &Runtime::num_rdma_bytes)
        .def("dispatch", &dispatch)
        .def("combine", &combine)
        .def("collective_dispatch_send", &Runtime::collective_dispatch_send, release)
        .def("collective_dispatch_recv", &Runtime::collective_dispatch_recv, release)
        .def("collective_combine_send", &Runtime::collective_combine_send, release)
        .def("collective_combine_recv", &Runtime::collective_combine_recv, release)
        .def("next_combine_buffer", &Runtime::next_combine_buffer)
        .def("clean", &Runtime::clean, release);
}
