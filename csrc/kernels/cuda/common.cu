// Host-side helpers of the kernel API: error words to messages, launch checks.
#include <stdexcept>
#include <string>

#include "kernels/cuda/api.hpp"

namespace mtdeepep::gpu {

const char* phase_name(Phase phase) {
    switch (phase) {
        case Phase::kNotify:
            return "dispatch: counts exchanged (notify)";
        case Phase::kBarrier:
            return "every rank entered the operation (barrier)";
        case Phase::kDispatchReceive:
            return "dispatch: rows received";
        case Phase::kCombineReceive:
            return "combine: rows received";
        case Phase::kLowLatencyEnter:
            return "low-latency: peer entered the call";
        case Phase::kLowLatencyDispatchReceive:
            return "low-latency dispatch: rows received";
        case Phase::kLowLatencyCombineReceive:
            return "low-latency combine: rows received";
        default:
            return "unknown phase";
    }
}

std::string error_message(uint64_t code) {
    if (code == 0) return "";
    const std::string rank = std::to_string(error_rank(code)), peer = std::to_string(error_peer(code));
    const std::string phase = phase_name(error_phase(code));
    switch (error_kind(code)) {
        case ErrorKind::kTimeout:
            return "mtdeepep: rank " + rank + " timed out on the GPU waiting for rank " + peer + " in phase '" + phase +
                   "' (ranks that did not arrive: [" + peer + "])";
        case ErrorKind::kPeerFailed:
            return "mtdeepep: rank " + rank + " stopped in phase '" + phase + "' because rank " + peer + " failed";
        case ErrorKind::kAborted:
            return "mtdeepep: rank " + rank + " was interrupted in phase '" + phase + "'";
        case ErrorKind::kOverflow:
            return "mtdeepep: rank " + peer + " receives more rows than its num_nvl_bytes region holds (phase '" +
                   phase + "'); the CUDA executor moves one operation in one round: raise num_nvl_bytes";
        default:
            return "mtdeepep: unknown device error " + std::to_string(code);
    }
}

void check_launch(const char* what) {
    const gpuError_t error = gpuGetLastError();
    if (error != gpuSuccess)
        throw std::runtime_error(std::string("mtdeepep: ") + what + ": " + gpuGetErrorString(error));
}

}  // namespace mtdeepep::gpu
