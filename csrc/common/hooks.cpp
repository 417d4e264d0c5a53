#include "common/hooks.hpp"

#include <atomic>
#include <cmath>
#include <stdexcept>

#include "common/exception.hpp"

namespace mtdeepep {

namespace {
std::atomic<InterruptPoll> installed_poll{nullptr};
std::atomic<GilReleaser> installed_releaser{nullptr};
}  // namespace

void set_interrupt_poll(InterruptPoll poll) {
    installed_poll.store(poll);
}

void poll_interrupt() {
    InterruptPoll poll = installed_poll.load();
    std::string what;
    if (poll != nullptr && poll(&what)) throw Interrupted(what);
}

void set_gil_releaser(GilReleaser releaser) {
    installed_releaser.store(releaser);
}

void without_gil(const std::function<void()>& body) {
    GilReleaser releaser = installed_releaser.load();
    if (releaser != nullptr)
        releaser(body);
    else
        body();
}

double checked_timeout(double timeout_s) {
    // `timeout_s <= 0` is false for NaN, and a NaN deadline never passes: check finiteness explicitly.
    if (!std::isfinite(timeout_s) || timeout_s <= 0)
        throw std::invalid_argument(
            concat("mtdeepep: timeout_s must be a finite number of seconds > 0, got ", timeout_s));
    return timeout_s;
}

}  // namespace mtdeepep
