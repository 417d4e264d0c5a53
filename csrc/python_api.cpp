// The only binding file: it registers the runtime's classes, functions and exceptions, nothing else.
#include <pybind11/functional.h>
#include <pybind11/stl.h>
#include <torch/python.h>

#include "common/exception.hpp"
#include "common/gil.hpp"
#include "low_latency/bindings.hpp"
#include "runtime/runtime.hpp"
#include "shm/segment.hpp"

namespace py = pybind11;
using mtdeepep::Event;
using mtdeepep::EventPtr;
using mtdeepep::Runtime;

namespace {

// Exception types whose bases are tuples, so `except TimeoutError` and `except mtdeepep.CommError` both work.
PyObject* new_exception(py::module_& m, const char* name, PyObject* bases, const char* doc) {
    std::string qualified = std::string("mtdeepep._C.") + name;
    PyObject* type = PyErr_NewExceptionWithDoc(qualified.c_str(), doc, bases, nullptr);
    if (type == nullptr) throw py::error_already_set();
    m.attr(name) = py::handle(type);
    return type;
}

void register_exceptions(py::module_& m) {
    static PyObject* comm_error = new_exception(m, "CommError", PyExc_RuntimeError,
                                                "A peer failed, exited or destroyed its buffer, or a wait failed.");
    static PyObject* timeout_error = new_exception(
        m, "CommTimeoutError", py::make_tuple(py::handle(comm_error), py::handle(PyExc_TimeoutError)).release().ptr(),
        "A wait ran past its timeout; the message names the missing ranks.");
    static PyObject* mismatch_error = new_exception(
        m, "GroupMismatchError", py::make_tuple(py::handle(comm_error), py::handle(PyExc_ValueError)).release().ptr(),
        "Every rank found the same inconsistency (e.g. ranks disagree on the hidden size); the buffer stays usable.");
    py::register_exception_translator([](std::exception_ptr error) {
        try {
            if (error) std::rethrow_exception(error);
        } catch (const mtdeepep::CommTimeout& e) {
            PyErr_SetString(timeout_error, e.what());
        } catch (const mtdeepep::GroupMismatch& e) {
            PyErr_SetString(mismatch_error, e.what());
        } catch (const mtdeepep::CommError& e) {
            PyErr_SetString(comm_error, e.what());
        }
    });
}

void register_runtime(py::module_& m) {
    py::class_<Event, EventPtr>(m, "EventHandle")
        .def(py::init([] { return mtdeepep::completed_event(); }))
        .def("wait", &Event::wait, py::call_guard<py::gil_scoped_release>())
        .def("query", &Event::query);

    py::class_<Runtime, std::unique_ptr<Runtime, mtdeepep::ReleaseGilDelete<Runtime>>>(m, "Runtime")
        .def(py::init<int, int, int64_t, double, int>(), py::arg("rank"), py::arg("num_ranks"),
             py::arg("num_nvl_bytes"), py::arg("timeout_s"), py::arg("num_threads"))
        .def("segment_name", &Runtime::segment_name)
        .def("pid", &Runtime::pid)
        .def("sync", &Runtime::sync, py::call_guard<py::gil_scoped_release>())
        .def("is_available", &Runtime::is_available)
        .def("destroy", &Runtime::destroy, py::call_guard<py::gil_scoped_release>())
        .def("set_timeout", &Runtime::set_timeout)
        .def("set_num_threads", &Runtime::set_num_threads)
        .def("get_local_buffer_tensor",
             [](const Runtime& self, const py::object& dtype, int64_t offset) {
                 return self.get_local_buffer_tensor(torch::python::detail::py_object_to_dtype(dtype), offset);
             })
        .def("get_dispatch_layout", &Runtime::get_dispatch_layout, py::call_guard<py::gil_scoped_release>())
        .def("intranode_dispatch", &Runtime::intranode_dispatch, py::call_guard<py::gil_scoped_release>())
        .def("intranode_combine", &Runtime::intranode_combine, py::call_guard<py::gil_scoped_release>());

    m.def("cleanup_stale_segments", &mtdeepep::shm::cleanup_stale_segments,
          "Unlink this user's mtdeepep segments whose creator process has exited; returns how many.");
}

}  // namespace

PYBIND11_MODULE(_C, m) {
    m.doc() = "mtdeepep C++ runtime";
    register_exceptions(m);
    register_runtime(m);
    register_low_latency(m);
}
