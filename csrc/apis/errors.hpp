// Bindings of the error types and of the hooks the runtime needs from Python (interruption, the GIL).
#pragma once

#include <pybind11/pybind11.h>

#include <memory>
#include <string>

#include "common/exception.hpp"
#include "common/hooks.hpp"

namespace mtdeepep::apis {

namespace py = pybind11;

namespace detail {

inline unsigned long& python_main_thread() {
    static unsigned long ident = 0;
    return ident;
}

// The exception a signal handler raised during an interrupted wait, re-raised as is when the Interrupted error reaches
// Python (on the same thread: only the main thread is ever interrupted).
struct SavedError {
    PyObject *type = nullptr, *value = nullptr, *traceback = nullptr;
};
inline SavedError& saved_error() {
    static thread_local SavedError saved;
    return saved;
}

inline bool poll_python_signals(std::string* what) {
    if (PyThread_get_thread_ident() != python_main_thread()) return false;
    py::gil_scoped_acquire gil;
    if (PyErr_CheckSignals() == 0) return false;
    SavedError& saved = saved_error();
    Py_XDECREF(saved.type);
    Py_XDECREF(saved.value);
    Py_XDECREF(saved.traceback);
    PyErr_Fetch(&saved.type, &saved.value, &saved.traceback);
    *what = saved.type != nullptr ? reinterpret_cast<PyTypeObject*>(saved.type)->tp_name : "a signal";
    return true;
}

inline void release_gil_around(const std::function<void()>& body) {
    if (Py_IsInitialized() && PyGILState_Check()) {
        py::gil_scoped_release release;
        body();
    } else {
        body();
    }
}

// Exception types whose bases are tuples, so `except TimeoutError` and `except mtdeepep.CommError` both work.
inline PyObject* new_exception(py::module_& m, const char* name, PyObject* bases, const char* doc) {
    std::string qualified = std::string("mtdeepep._C.") + name;
    PyObject* type = PyErr_NewExceptionWithDoc(qualified.c_str(), doc, bases, nullptr);
    if (type == nullptr) throw py::error_already_set();
    m.attr(name) = py::handle(type);
    return type;
}

}  // namespace detail

// A Python exception carried through C++ (an event that Python code completed with an error): every wait re-raises
// the same exception object, as many times as it is waited for.
class PythonError : public std::exception {
  public:
    explicit PythonError(const py::object& error)
        : error_(new py::object(error),
                 [](py::object* object) {
                     py::gil_scoped_acquire gil;  // the last holder may be any thread
                     delete object;
                 }),
          what_(py::str(error).cast<std::string>()) {}
    const char* what() const noexcept override { return what_.c_str(); }
    PyObject* ptr() const { return error_->ptr(); }

  private:
    std::shared_ptr<py::object> error_;
    std::string what_;
};

inline void register_errors(py::module_& m) {
    using detail::new_exception;
    static PyObject* comm_error = new_exception(m, "CommError", PyExc_RuntimeError,
                                                "A peer failed, exited or destroyed its buffer, or a wait failed.");
    static PyObject* timeout_error = new_exception(
        m, "CommTimeoutError", py::make_tuple(py::handle(comm_error), py::handle(PyExc_TimeoutError)).release().ptr(),
        "A wait ran past its timeout; the message names the missing ranks.");
    static PyObject* mismatch_error = new_exception(
        m, "GroupMismatchError", py::make_tuple(py::handle(comm_error), py::handle(PyExc_ValueError)).release().ptr(),
        "Every rank found the same inconsistency (e.g. ranks disagree on the hidden size, or combine different "
        "dispatches); the buffer stays usable.");
    py::register_exception_translator([](std::exception_ptr error) {
        try {
            if (error) std::rethrow_exception(error);
        } catch (const PythonError& e) {
            PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(e.ptr())), e.ptr());
        } catch (const Interrupted& e) {
            detail::SavedError& saved = detail::saved_error();
            if (saved.type != nullptr) {
                PyErr_Restore(saved.type, saved.value, saved.traceback);  // steals the references
                saved = {};
            } else {
                PyErr_SetString(PyExc_KeyboardInterrupt, e.what());
            }
        } catch (const CommTimeout& e) {
            PyErr_SetString(timeout_error, e.what());
        } catch (const GroupMismatch& e) {
            PyErr_SetString(mismatch_error, e.what());
        } catch (const CommError& e) {
            PyErr_SetString(comm_error, e.what());
        }
    });

    detail::python_main_thread() =
        py::module_::import("threading").attr("main_thread")().attr("ident").cast<unsigned long>();
    set_interrupt_poll(&detail::poll_python_signals);
    set_gil_releaser(&detail::release_gil_around);
    m.def("check_timeout", &checked_timeout, py::arg("timeout_s"),
          "The one timeout check: returns `timeout_s` if it is a finite number of seconds > 0, else ValueError.");
}

}  // namespace mtdeepep::apis
