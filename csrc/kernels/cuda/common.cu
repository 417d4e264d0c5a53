// Host-side helpers of the kernel API: error words to messages, launch checks.
#include <stdexcept>
#include <string>

#include "kernels/cuda/api.hpp"

#if !defined(MTDEEPEP_MUSA)
#include <cuda.h>  // the driver API's types (CUmoduleLoadingMode); the function comes through the runtime
#endif

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

namespace {

// What rank `rank` did wrong in one clause ("rank 0 timed out ... (ranks that did not arrive: [1])"); the stopped
// rank's message embeds it.
std::string own_failure(uint64_t code, int64_t detail_rows, int64_t detail_bound) {
    const std::string rank = std::to_string(error_rank(code)), peer = std::to_string(error_peer(code));
    const std::string phase = phase_name(error_phase(code));
    switch (error_kind(code)) {
        case ErrorKind::kTimeout:
            return "rank " + rank + " timed out on the GPU waiting for rank " + peer + " in phase '" + phase +
                   "' (ranks that did not arrive: [" + peer + "])";
        case ErrorKind::kAborted:
            return "rank " + rank + " was interrupted in phase '" + phase + "'";
        case ErrorKind::kOverflow:
            return "rank " + peer + " receives " + std::to_string(detail_rows) + " rows, more than the " +
                   std::to_string(detail_bound) + " its num_nvl_bytes region holds (phase '" + phase +
                   "'); the CUDA executor moves one operation in one round: raise num_nvl_bytes";
        case ErrorKind::kWorstTokens:
            return "rank " + peer + " receives " + std::to_string(detail_rows) +
                   " tokens, more than num_worst_tokens=" + std::to_string(detail_bound) + " (phase '" + phase +
                   "'); nothing was sent";
        default:
            return "rank " + rank + " failed with device error " + std::to_string(code);
    }
}

}  // namespace

std::string error_message(uint64_t code, uint64_t cause, int64_t detail_rows, int64_t detail_bound) {
    if (code == 0) return "";
    if (error_kind(code) == ErrorKind::kPeerFailed) {
        const std::string head = "mtdeepep: rank " + std::to_string(error_rank(code)) + " stopped in phase '" +
                                 phase_name(error_phase(code)) + "' because ";
        if (cause == 0) return head + "rank " + std::to_string(error_peer(code)) + " failed";
        return head + own_failure(cause, 0, 0);
    }
    return "mtdeepep: " + own_failure(code, detail_rows, detail_bound);
}

void load_kernel(const void* kernel, const char* name) {
    gpuFuncAttributes attributes{};
    const gpuError_t error = gpuFuncGetAttributes(&attributes, kernel);
    if (error != gpuSuccess)
        throw std::runtime_error(std::string("mtdeepep: loading the kernel ") + name + ": " + gpuGetErrorString(error));
}

void load_all_kernels() {
    load_layout_kernels();
    load_intranode_kernels();
    load_low_latency_kernels();
}

int module_loading_lazy() {
#if defined(MTDEEPEP_MUSA)
    return -1;
#else
    // The driver API through the runtime's entry point table: no link against libcuda.
    using GetLoadingMode = CUresult (*)(CUmoduleLoadingMode*);
    void* function = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuModuleGetLoadingMode", &function, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        function == nullptr)
        return -1;
    CUmoduleLoadingMode mode{};
    if (reinterpret_cast<GetLoadingMode>(function)(&mode) != CUDA_SUCCESS) return -1;
    return mode == CU_MODULE_LAZY_LOADING ? 1 : 0;
#endif
}

void check_launch(const char* what) {
    const gpuError_t error = gpuGetLastError();
    if (error != gpuSuccess)
        throw std::runtime_error(std::string("mtdeepep: ") + what + ": " + gpuGetErrorString(error));
}

}  // namespace mtdeepep::gpu
