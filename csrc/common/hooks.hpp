// What the C++ runtime needs from the Python side, as hooks the binding layer installs at import (none are installed
// in pure C++ use, where nothing is interrupted and no GIL exists):
//
//   - interruption: every wait loop calls poll_interrupt() every few milliseconds; on the Python main thread the
//     installed poll runs pending signal handlers (Ctrl-C) and reports whether one raised, and the wait then throws
//     Interrupted;
//   - the GIL: deleting a runtime joins its comm thread, which may need the GIL to free the tensors of its last task,
//     so deletions run through without_gil().
//
// Also the one check every timeout goes through, wherever it enters.
#pragma once

#include <functional>
#include <string>

namespace mtdeepep {

// Returns true (and a description in `what`) when the calling thread must stop waiting.
using InterruptPoll = bool (*)(std::string* what);
void set_interrupt_poll(InterruptPoll poll);
// Throws Interrupted when the installed poll says so.
void poll_interrupt();

// Runs `body` with the GIL released if the calling thread holds it.
using GilReleaser = void (*)(const std::function<void()>& body);
void set_gil_releaser(GilReleaser releaser);
void without_gil(const std::function<void()>& body);

// A timeout as every entry point accepts it: finite and positive seconds (std::invalid_argument otherwise).
double checked_timeout(double timeout_s);

}  // namespace mtdeepep
