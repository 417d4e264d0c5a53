// Deleting a runtime joins its comm thread, which may need the GIL to free the tensors of its last task: a
// runtime that Python collects must be deleted with the GIL released.
#pragma once

#include <pybind11/pybind11.h>

namespace mtdeepep {

template <typename T>
struct ReleaseGilDelete {
    void operator()(T* object) const {
        if (PyGILState_Check()) {
            pybind11::gil_scoped_release release;
            delete object;
        } else {
            delete object;
        }
    }
};

}  // namespace mtdeepep
