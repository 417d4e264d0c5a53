// Registers the low-latency runtime (mtdeepep._C.LowLatencyRuntime) on the extension module.
#pragma once

#include <pybind11/pybind11.h>

void register_low_latency(pybind11::module_& m);
