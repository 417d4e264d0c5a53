// Error types shared by every executor. They cross the comm thread as std::exception_ptr and reach Python as
// mtdeepep.CommError (a RuntimeError), mtdeepep.CommTimeoutError (also a TimeoutError), mtdeepep.GroupMismatchError
// (also a ValueError) and KeyboardInterrupt (Interrupted).
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace mtdeepep {

template <typename... Args>
std::string concat(const Args&... args) {
    std::ostringstream out;
    (out << ... << args);
    return out.str();
}

// A peer failed, exited or destroyed its buffer, or a wait failed.
class CommError : public std::runtime_error {
  public:
    explicit CommError(const std::string& what) : std::runtime_error(what) {}
};

// A wait ran past its timeout; the message names the phase and the ranks that did not arrive.
class CommTimeout : public CommError {
  public:
    explicit CommTimeout(const std::string& what) : CommError(what) {}
};

// Every rank detected the same problem at the same point (e.g. ranks disagree on the hidden size, or pass handles
// of different dispatches): each raises it and the buffer stays usable, since no rank is left waiting.
class GroupMismatch : public CommError {
  public:
    explicit GroupMismatch(const std::string& what) : CommError(what) {}
};

// A wait on the Python main thread stopped because a signal handler raised (Ctrl-C). The binding layer re-raises the
// handler's exception (KeyboardInterrupt) as it was.
class Interrupted : public CommError {
  public:
    explicit Interrupted(const std::string& what) : CommError(what) {}
};

}  // namespace mtdeepep

#define MTDEEPEP_HOST_ASSERT(cond)                                                                      \
    do {                                                                                                \
        if (!(cond))                                                                                    \
            throw std::logic_error(                                                                     \
                mtdeepep::concat("mtdeepep internal error: ", #cond, " at ", __FILE__, ":", __LINE__)); \
    } while (0)
