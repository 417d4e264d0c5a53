// Dispatch layout and the send positions of the normal mode.
#include "kernels/cuda/device.cuh"

namespace mtdeepep::gpu {

namespace {

constexpr int kLayoutThreads = 256;

// One thread per token; per-block counters in shared memory ([E] experts then [R] ranks), flushed with one atomic per
// counter and block. A token counts once per rank however many of its experts live there.
__global__ void __launch_bounds__(kLayoutThreads)
    dispatch_layout_kernel(const int64_t* __restrict__ topk_idx, int num_tokens, int num_topk, int num_ranks,
                           int num_experts, int32_t* __restrict__ num_tokens_per_rank,
                           int32_t* __restrict__ num_tokens_per_expert, bool* __restrict__ is_token_in_rank) {
    extern __shared__ int32_t counters[];  // [num_experts + num_ranks]
    int32_t* expert_counters = counters;
    int32_t* rank_counters = counters + num_experts;
    for (int i = threadIdx.x; i < num_experts + num_ranks; i += blockDim.x) counters[i] = 0;
    __syncthreads();
    const int experts_per_rank = num_experts / num_ranks;
    for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < num_tokens; t += gridDim.x * blockDim.x) {
        const int64_t* idx = topk_idx + static_cast<int64_t>(t) * num_topk;
        bool* in_rank = is_token_in_rank + static_cast<int64_t>(t) * num_ranks;
        for (int r = 0; r < num_ranks; ++r) in_rank[r] = false;
        for (int k = 0; k < num_topk; ++k) {
            const int64_t expert = idx[k];
            if (expert < 0) continue;
            atomicAdd(&expert_counters[expert], 1);
            const int rank = static_cast<int>(expert / experts_per_rank);
            bool seen = false;
            for (int j = 0; j < k; ++j) seen |= idx[j] >= 0 && idx[j] / experts_per_rank == rank;
            if (seen) continue;
            atomicAdd(&rank_counters[rank], 1);
            in_rank[rank] = true;
        }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < num_experts; e += blockDim.x)
        if (expert_counters[e] != 0) atomicAdd(&num_tokens_per_expert[e], expert_counters[e]);
    for (int r = threadIdx.x; r < num_ranks; r += blockDim.x)
        if (rank_counters[r] != 0) atomicAdd(&num_tokens_per_rank[r], rank_counters[r]);
}

constexpr int kScanThreads = 1024;

// Block r scans column r of is_token_in_rank in chunks of kScanThreads tokens.
__global__ void __launch_bounds__(kScanThreads)
    send_positions_kernel(const bool* __restrict__ is_token_in_rank, int num_tokens, int num_ranks,
                          int32_t* __restrict__ send_head, int32_t* __restrict__ num_sent_per_rank) {
    const int rank = blockIdx.x;
    int base = 0;
    for (int chunk = 0; chunk < num_tokens; chunk += blockDim.x) {
        const int t = chunk + threadIdx.x;
        const int64_t at = static_cast<int64_t>(t) * num_ranks + rank;
        const int flag = t < num_tokens && is_token_in_rank[at] ? 1 : 0;
        int total;
        const int before = block_exclusive_scan(flag, total);
        if (t < num_tokens) send_head[at] = flag ? base + before : -1;
        base += total;
    }
    if (threadIdx.x == 0) num_sent_per_rank[rank] = base;
}

}  // namespace

void load_layout_kernels() {
    load_kernel(reinterpret_cast<const void*>(dispatch_layout_kernel), "dispatch_layout_kernel");
    load_kernel(reinterpret_cast<const void*>(send_positions_kernel), "send_positions_kernel");
}

void launch_dispatch_layout(const int64_t* topk_idx, int num_tokens, int num_topk, int num_ranks, int num_experts,
                            int32_t* num_tokens_per_rank, int32_t* num_tokens_per_expert, bool* is_token_in_rank,
                            int num_sms, gpuStream_t stream) {
    gpuMemsetAsync(num_tokens_per_rank, 0, sizeof(int32_t) * num_ranks, stream);
    gpuMemsetAsync(num_tokens_per_expert, 0, sizeof(int32_t) * num_experts, stream);
    if (num_tokens == 0) return;
    const int blocks = std::max(1, std::min(num_sms, (num_tokens + kLayoutThreads - 1) / kLayoutThreads));
    const size_t shared = sizeof(int32_t) * (num_experts + num_ranks);
    if (shared > 48 * 1024)  // the default dynamic shared memory limit: about 12k experts
        throw std::invalid_argument("mtdeepep: too many experts for the CUDA layout kernel (at most ~12000)");
    dispatch_layout_kernel<<<blocks, kLayoutThreads, shared, stream>>>(topk_idx, num_tokens, num_topk, num_ranks,
                                                                       num_experts, num_tokens_per_rank,
                                                                       num_tokens_per_expert, is_token_in_rank);
    check_launch("dispatch layout");
}

void launch_send_positions(const bool* is_token_in_rank, int num_tokens, int num_ranks, int32_t* send_head,
                           int32_t* num_sent_per_rank, gpuStream_t stream) {
    send_positions_kernel<<<num_ranks, kScanThreads, 0, stream>>>(is_token_in_rank, num_tokens, num_ranks, send_head,
                                                                  num_sent_per_rank);
    check_launch("send positions");
}

}  // namespace mtdeepep::gpu
