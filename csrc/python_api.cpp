// The only binding file: each subsystem registers its bindings (csrc/apis/), nothing else happens here.
#include <pybind11/pybind11.h>

#include "apis/errors.hpp"
#include "apis/runtime.hpp"

PYBIND11_MODULE(_C, m) {
    m.doc() = "mtdeepep C++ runtime";
    mtdeepep::apis::register_errors(m);
    mtdeepep::apis::register_runtime(m);
}
