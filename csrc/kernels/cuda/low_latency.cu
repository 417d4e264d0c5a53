// Low-latency dispatch and combine (DeepEP's decode-time mode) between the ranks of one node, over IPC-opened
// buffers: each (token, expert) row is written straight into the receiving expert's rows of the receiver's current
// half, the FP8 cast fused in the sender (one cast per token, written to each of its experts).
//
// Slots: a sender reserves the rows of each of its experts in the receiver with one system-scope atomicAdd per
// (expert, source) on the receiver's counter, so the received rows come out packed per expert with no compaction
// pass ([begin, begin + count) per source, the layout_range DeepEP returns); the receiver resets its counters once
// it has every signal. Before writing call n into a peer's half n % 2 the sender waits until the peer entered call
// n (launch_low_latency_enter): from then on the peer has given up the results of call n - 2 in that half.
//
// Kernels of one call: enter; wait_entered (one block: every receiver entered the call); count (one block per
// expert: slots, counts, reservation, layout_range); send (a warp per token: cast and write, last block signals);
// receive (the hook: one block waits for the signals, recv_count, reset). Combine: enter; wait_entered; send (wide);
// then the hook: wait_signals (one block), receive (wide). Only one-block kernels wait for peers: a wide grid that
// spun would hold the SMs a late peer's kernel needs (ranks sharing a GPU in one process, or under MPS).
#include "kernels/cuda/device.cuh"

namespace mtdeepep::gpu {

namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / kWarpSize;
constexpr float kE4M3Max = 448.0f;
constexpr float kAmaxFloor = 1e-4f;  // as upstream and refs.per_token_cast_to_fp8: an all-zero block gets a scale
constexpr int kMaxTopk = 32;         // topk slots (a lane each)

// acc + w * value rounded twice (no fused multiply-add), as the CPU kernel computes it: the same bits on both.
__device__ __forceinline__ float weighted_add(float acc, float w, uint16_t value) {
    return __fadd_rn(acc, __fmul_rn(w, bf16_to_float(value)));
}

// One 1x128 block of a row cast to E4M3 (refs.per_token_cast_to_fp8): the lane's 4 codes, packed, and the block's
// scale, the same on every lane.
struct Fp8Block {
    uint32_t packed;
    float scale;
};

// The 1x128 cast of the dispatch and of cast_kernel, by a whole warp: lane i casts channels [4i, 4i + 4) of the 128
// bfloat16 values at `block` (16-byte aligned: hidden % 128 == 0). scale = max(amax, 1e-4) / 448, rounded up to a
// power of two with `round_scale`; a NaN in the block makes the scale NaN.
__device__ __forceinline__ Fp8Block cast_block_1x128(const uint16_t* block, int lane, bool round_scale) {
    const uint2 raw = *reinterpret_cast<const uint2*>(block + lane * 4);  // 4 bfloat16
    float v[4] = {bf16_to_float(raw.x & 0xffffu), bf16_to_float(raw.x >> 16), bf16_to_float(raw.y & 0xffffu),
                  bf16_to_float(raw.y >> 16)};
    float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
    // fmaxf drops NaN: carry it explicitly, as the CPU kernel's integer max does.
    const bool nan = __any_sync(kFullMask, isnan(v[0]) || isnan(v[1]) || isnan(v[2]) || isnan(v[3]));
    amax = warp_max(amax);
    float scale = nan ? __int_as_float(0x7fc00000) : fmaxf(amax, kAmaxFloor) / kE4M3Max;
    if (round_scale && isfinite(scale)) scale = power_of_two_ceil(scale);
    const uint32_t packed = static_cast<uint32_t>(float_to_e4m3(v[0] / scale)) |
                            (static_cast<uint32_t>(float_to_e4m3(v[1] / scale)) << 8) |
                            (static_cast<uint32_t>(float_to_e4m3(v[2] / scale)) << 16) |
                            (static_cast<uint32_t>(float_to_e4m3(v[3] / scale)) << 24);
    return {packed, scale};
}

struct Area {
    uint8_t* base;
    LowLatencyControl control;
    LowLatencyHalf half;
    size_t half_bytes;
    __device__ Area(uint8_t* base, int num_ranks, size_t half_bytes, int num_max_tokens, int hidden, int num_experts)
        : base(base),
          control(num_ranks),
          half(num_max_tokens, hidden, num_ranks, num_experts),
          half_bytes(half_bytes) {}
    __device__ uint64_t* dispatch_signals(uint64_t seq) const {
        return reinterpret_cast<uint64_t*>(base + control.dispatch_signals) + (seq & 1) * half.num_ranks;
    }
    __device__ uint64_t* combine_signals(uint64_t seq) const {
        return reinterpret_cast<uint64_t*>(base + control.combine_signals) + (seq & 1) * half.num_ranks;
    }
    __device__ uint32_t* counters(uint64_t seq) const {
        return reinterpret_cast<uint32_t*>(base + control.counters) + (seq & 1) * kMaxLocalExperts;
    }
    __device__ uint8_t* half_base(uint64_t seq) const { return base + control.bytes + (seq & 1) * half_bytes; }
    __device__ int64_t* layout_range(uint64_t seq) const {
        return reinterpret_cast<int64_t*>(half_base(seq) + half.layout_range);
    }
    __device__ int32_t* src_info(uint64_t seq) const {
        return reinterpret_cast<int32_t*>(half_base(seq) + half.src_info);
    }
    __device__ uint8_t* scales(uint64_t seq) const { return half_base(seq) + half.scales; }
    __device__ uint8_t* recv_x(uint64_t seq) const { return half_base(seq) + half.recv_x; }
    __device__ uint16_t* combine_recv(uint64_t seq) const {
        return reinterpret_cast<uint16_t*>(half_base(seq) + half.combine_recv);
    }
};

__device__ __forceinline__ Area area_of(const LowLatencyPeers& peers, int rank, int num_ranks, int num_max_tokens,
                                        int hidden, int num_experts) {
    return Area(peers.base[rank], num_ranks, peers.half_bytes, num_max_tokens, hidden, num_experts);
}

__global__ void enter_kernel(LowLatencyPeers peers, int rank, uint64_t seq) {
    store_release(reinterpret_cast<uint64_t*>(peers.base[rank] + LowLatencyControl(1).entered), seq);
}

// One block, a thread per rank: waits until every rank entered call `seq` (its half seq % 2 is ours to write).
__global__ void wait_entered_kernel(Control control, LowLatencyPeers peers, uint64_t seq) {
    if (load_volatile(control.status) != 0) return;
    bool ok = true;
    for (int d = threadIdx.x; d < control.num_ranks; d += blockDim.x) {
        const uint64_t* entered = reinterpret_cast<const uint64_t*>(peers.base[d] + LowLatencyControl(1).entered);
        ok = wait_flag(control, entered, seq, Phase::kLowLatencyEnter, d) && ok;
    }
    __syncthreads_and(ok);
}

// One block: waits for every rank's signal of call `seq` (`signals_offset`: dispatch or combine signals); wait_ns
// [R] (may be null) gets each rank's wait.
__global__ void wait_signals_kernel(Control control, LowLatencyPeers peers, uint64_t seq, size_t signals_offset,
                                    Phase phase, int64_t* wait_ns) {
    if (load_volatile(control.status) != 0) return;
    const uint64_t* signals =
        reinterpret_cast<const uint64_t*>(peers.base[control.rank] + signals_offset) + (seq & 1) * control.num_ranks;
    block_wait_flags(control, signals, 1, seq, phase, wait_ns);
}

// One block per expert e: the slot of each (t, k) routed to e among this rank's rows to e (token order), the count,
// the reservation in the receiver, and the receiver's layout_range entry for this source.
__global__ void __launch_bounds__(kThreads)
    count_kernel(Control control, LowLatencyPeers peers, uint64_t seq, LowLatencyDispatchArgs args) {
    if (load_volatile(control.status) != 0) return;
    const int R = control.num_ranks, me = control.rank;
    const int expert = blockIdx.x;
    const int local_experts = args.num_experts / R;
    const int dest = expert / local_experts, local = expert % local_experts;
    const int64_t num_slots = static_cast<int64_t>(args.num_tokens) * args.num_topk;
    int base = 0;
    for (int64_t chunk = 0; chunk < num_slots; chunk += blockDim.x) {
        const int64_t i = chunk + threadIdx.x;
        const int hit = i < num_slots && args.topk_idx[i] == expert ? 1 : 0;
        int total;
        const int before = block_exclusive_scan(hit, total);
        if (hit) args.slots[i] = base + before;
        base += total;
    }
    if (threadIdx.x != 0) return;
    args.expert_counts[expert] = base;
    const Area area = area_of(peers, dest, R, args.num_max_tokens, args.hidden, args.num_experts);
    // The receiver's half seq % 2 (its counters and layout_range) is ours to write: it entered call seq
    // (wait_entered_kernel ran before on this stream, and this kernel returned above if that failed).
    const uint32_t begin = base > 0 ? atomicAdd_system(area.counters(seq) + local, static_cast<uint32_t>(base)) : 0;
    args.expert_begin[expert] = static_cast<int32_t>(begin);
    area.layout_range(seq)[local * R + me] = (static_cast<int64_t>(begin) << 32) | static_cast<int64_t>(base);
}

__global__ void __launch_bounds__(kThreads)
    dispatch_send_kernel(Control control, LowLatencyPeers peers, uint64_t seq, LowLatencyDispatchArgs args) {
    if (load_volatile(control.status) != 0) return;
    const int R = control.num_ranks, me = control.rank;
    const int lane = threadIdx.x % kWarpSize;
    const int local_experts = args.num_experts / R;
    const LowLatencyHalf half(args.num_max_tokens, args.hidden, R, args.num_experts);
    const int64_t rows_per_expert = half.rows_per_expert();
    const int num_scales = half.num_scales, num_packed = (num_scales + kScalesPerPack - 1) / kScalesPerPack;
    const int warp = blockIdx.x * kWarps + threadIdx.x / kWarpSize, num_warps = gridDim.x * kWarps;
    for (int t = warp; t < args.num_tokens; t += num_warps) {
        // Lane k: where slot k of token t goes (rank, local expert, row), or nowhere.
        int dest = -1, local = 0;
        int64_t row = 0;
        if (lane < args.num_topk) {
            const int64_t expert = args.topk_idx[static_cast<int64_t>(t) * args.num_topk + lane];
            if (expert >= 0) {
                dest = static_cast<int>(expert / local_experts);
                local = static_cast<int>(expert % local_experts);
                row = static_cast<int64_t>(args.expert_begin[expert]) +
                      args.slots[static_cast<int64_t>(t) * args.num_topk + lane];
            }
        }
        const uint16_t* x = args.x + static_cast<int64_t>(t) * args.x_stride;
        if (!args.use_fp8) {
            for (int k = 0; k < args.num_topk; ++k) {
                const int d = __shfl_sync(kFullMask, dest, k);
                if (d < 0) continue;
                const int l = __shfl_sync(kFullMask, local, k);
                const int64_t r = __shfl_sync(kFullMask, row, k);
                const Area area = area_of(peers, d, R, args.num_max_tokens, args.hidden, args.num_experts);
                const int64_t dst_row = l * rows_per_expert + r;
                warp_copy(area.recv_x(seq) + dst_row * args.hidden * 2, reinterpret_cast<const uint8_t*>(x),
                          static_cast<size_t>(args.hidden) * 2, lane);
                if (lane == 0) area.src_info(seq)[dst_row] = t;
            }
            continue;
        }
        // FP8: block s of 128 channels, 4 per lane; the cast happens once and is written to every destination.
        for (int s = 0; s < num_scales; ++s) {
            const int h = s * kScaleBlock + lane * 4;
            const auto [packed, scale] = cast_block_1x128(x + s * kScaleBlock, lane, args.round_scale);
            for (int k = 0; k < args.num_topk; ++k) {
                const int d = __shfl_sync(kFullMask, dest, k);
                if (d < 0) continue;
                const int l = __shfl_sync(kFullMask, local, k);
                const int64_t r = __shfl_sync(kFullMask, row, k);
                const Area area = area_of(peers, d, R, args.num_max_tokens, args.hidden, args.num_experts);
                const int64_t dst_row = l * rows_per_expert + r;
                *reinterpret_cast<uint32_t*>(area.recv_x(seq) + dst_row * args.hidden + h) = packed;
                if (lane != 0) continue;
                if (s == 0) area.src_info(seq)[dst_row] = t;
                if (!args.use_ue8m0) {
                    float* scales = reinterpret_cast<float*>(area.scales(seq));
                    scales[(static_cast<int64_t>(l) * num_scales + s) * rows_per_expert + r] = scale;
                } else {
                    // UE8M0: the exponent byte of block s is byte s % 4 of int32 s / 4; bytes past S are 0.
                    uint8_t* packs = area.scales(seq);
                    const int64_t word =
                        (static_cast<int64_t>(l) * num_packed + s / kScalesPerPack) * rows_per_expert + r;
                    packs[word * 4 + s % kScalesPerPack] = static_cast<uint8_t>((__float_as_uint(scale) >> 23) & 0xffu);
                    if (s == num_scales - 1)
                        for (int j = s % kScalesPerPack + 1; j < kScalesPerPack; ++j) packs[word * 4 + j] = 0;
                }
            }
        }
    }
    // Arrival counter: the first uint32 of this rank's counters block of the other half is never used by senders
    // while this call runs (they reserve in half seq % 2): keep a dedicated word instead, after the counters.
    uint32_t* arrivals =
        reinterpret_cast<uint32_t*>(peers.base[me] + LowLatencyControl(R).counters) + 2 * kMaxLocalExperts - 2;
    if (last_block_done(arrivals)) {
        for (int d = threadIdx.x; d < R; d += blockDim.x) {
            const Area area = area_of(peers, d, R, args.num_max_tokens, args.hidden, args.num_experts);
            store_release(area.dispatch_signals(seq) + me, seq);
        }
    }
}

__global__ void dispatch_receive_kernel(Control control, LowLatencyPeers peers, uint64_t seq, int num_max_tokens,
                                        int hidden, int num_experts, int32_t* recv_count, int32_t* cumulative_stats,
                                        int64_t* wait_ns) {
    if (load_volatile(control.status) != 0) return;
    const int R = control.num_ranks, me = control.rank;
    const Area area = area_of(peers, me, R, num_max_tokens, hidden, num_experts);
    // One block: it may wait.
    if (!block_wait_flags(control, area.dispatch_signals(seq), 1, seq, Phase::kLowLatencyDispatchReceive, wait_ns))
        return;
    const int local_experts = num_experts / R;
    const int64_t* ranges = area.layout_range(seq);
    for (int e = threadIdx.x; e < local_experts; e += blockDim.x) {
        int32_t count = 0;
        for (int r = 0; r < R; ++r)
            count += static_cast<int32_t>(*reinterpret_cast<const volatile int64_t*>(ranges + e * R + r) & 0xffffffff);
        recv_count[e] = count;
        if (cumulative_stats != nullptr) cumulative_stats[e] += count;
        area.counters(seq)[e] = 0;  // for call seq + 2 (its senders wait until this rank entered it)
    }
}

__global__ void __launch_bounds__(kThreads)
    combine_send_kernel(Control control, LowLatencyPeers peers, uint64_t seq, LowLatencyCombineArgs args) {
    // Every destination entered this call (wait_entered_kernel ran before on this stream) before any of its half is
    // written.
    if (load_volatile(control.status) != 0) return;
    const int R = control.num_ranks, me = control.rank;
    const int lane = threadIdx.x % kWarpSize;
    const int local_experts = args.num_experts / R;
    const int64_t rows_per_expert = static_cast<int64_t>(R) * args.num_max_tokens;
    const size_t row_bytes = static_cast<size_t>(args.hidden) * 2;
    const int64_t num_rows = local_experts * rows_per_expert;
    const int warp = blockIdx.x * kWarps + threadIdx.x / kWarpSize, num_warps = gridDim.x * kWarps;
    for (int64_t i = warp; i < num_rows; i += num_warps) {
        const int local = static_cast<int>(i / rows_per_expert);
        const int64_t q = i % rows_per_expert;
        int source = -1;
        for (int r = 0; r < R && source < 0; ++r) {
            const int64_t range = args.layout_range[local * R + r];
            const int64_t begin = range >> 32, count = range & 0xffffffff;
            if (q >= begin && q < begin + count) source = r;
        }
        if (source < 0) continue;  // past the rows received for this expert
        const int32_t token = args.src_info[i];
        const Area area = area_of(peers, source, R, args.num_max_tokens, args.hidden, args.num_experts);
        const int64_t expert = static_cast<int64_t>(me) * local_experts + local;
        uint8_t* dst =
            reinterpret_cast<uint8_t*>(area.combine_recv(seq)) + (expert * args.num_max_tokens + token) * row_bytes;
        warp_copy(dst, reinterpret_cast<const uint8_t*>(args.x) + i * row_bytes, row_bytes, lane);
    }
    uint32_t* arrivals =
        reinterpret_cast<uint32_t*>(peers.base[me] + LowLatencyControl(R).counters) + 2 * kMaxLocalExperts - 1;
    if (last_block_done(arrivals)) {
        for (int d = threadIdx.x; d < R; d += blockDim.x) {
            const Area area = area_of(peers, d, R, args.num_max_tokens, args.hidden, args.num_experts);
            store_release(area.combine_signals(seq) + me, seq);
        }
    }
}

template <bool kVector>
__global__ void __launch_bounds__(kThreads)
    combine_receive_kernel(Control control, LowLatencyPeers peers, uint64_t seq, LowLatencyCombineArgs args) {
    // Every rank's rows are here: wait_signals_kernel ran before on this stream.
    if (load_volatile(control.status) != 0) return;
    const int R = control.num_ranks, me = control.rank;
    const Area area = area_of(peers, me, R, args.num_max_tokens, args.hidden, args.num_experts);
    const int lane = threadIdx.x % kWarpSize;
    const uint16_t* rows = area.combine_recv(seq);
    const int64_t expert_stride = static_cast<int64_t>(args.num_max_tokens) * args.hidden;
    const int warp = blockIdx.x * kWarps + threadIdx.x / kWarpSize, num_warps = gridDim.x * kWarps;
    for (int t = warp; t < args.num_tokens; t += num_warps) {
        int64_t expert = -1;
        float weight = 0.0f;
        if (lane < args.num_topk) {
            expert = args.topk_idx[static_cast<int64_t>(t) * args.num_topk + lane];
            weight = args.topk_weights[static_cast<int64_t>(t) * args.num_topk + lane];
        }
        uint16_t* out = args.out + static_cast<int64_t>(t) * args.hidden;
        if constexpr (kVector) {
            for (int p = lane; p < args.hidden / 8; p += kWarpSize) {
                float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
                for (int k = 0; k < args.num_topk; ++k) {  // slot order, as the CPU kernel
                    const int64_t e = __shfl_sync(kFullMask, expert, k);
                    const float w = __shfl_sync(kFullMask, weight, k);
                    if (e < 0) continue;
                    const int4 pack = reinterpret_cast<const int4*>(rows + e * expert_stride +
                                                                    static_cast<int64_t>(t) * args.hidden)[p];
                    const uint16_t* values = reinterpret_cast<const uint16_t*>(&pack);
#pragma unroll
                    for (int j = 0; j < 8; ++j) acc[j] = weighted_add(acc[j], w, values[j]);
                }
                int4 result;
                uint16_t* values = reinterpret_cast<uint16_t*>(&result);
#pragma unroll
                for (int j = 0; j < 8; ++j) values[j] = float_to_bf16(acc[j]);
                reinterpret_cast<int4*>(out)[p] = result;
            }
        } else {
            for (int h = lane; h < args.hidden; h += kWarpSize) {
                float acc = 0.0f;
                for (int k = 0; k < args.num_topk; ++k) {
                    const int64_t e = __shfl_sync(kFullMask, expert, k);
                    const float w = __shfl_sync(kFullMask, weight, k);
                    if (e >= 0)
                        acc = weighted_add(acc, w, rows[e * expert_stride + static_cast<int64_t>(t) * args.hidden + h]);
                }
                out[h] = float_to_bf16(acc);
            }
        }
    }
}

__global__ void __launch_bounds__(kThreads)
    cast_kernel(const uint16_t* __restrict__ x, int64_t x_stride, int num_tokens, int hidden, bool round_scale,
                uint8_t* __restrict__ e4m3, float* __restrict__ scales) {
    const int lane = threadIdx.x % kWarpSize;
    const int num_scales = hidden / kScaleBlock;
    const int64_t num_blocks = static_cast<int64_t>(num_tokens) * num_scales;
    const int warp = blockIdx.x * kWarps + threadIdx.x / kWarpSize, num_warps = gridDim.x * kWarps;
    for (int64_t b = warp; b < num_blocks; b += num_warps) {
        const int64_t t = b / num_scales;
        const int s = static_cast<int>(b % num_scales);
        const auto [packed, scale] = cast_block_1x128(x + t * x_stride + s * kScaleBlock, lane, round_scale);
        *reinterpret_cast<uint32_t*>(e4m3 + t * hidden + s * kScaleBlock + lane * 4) = packed;
        if (lane == 0) scales[t * num_scales + s] = scale;
    }
}

int grid_size(int num_sms) {
    return std::max(1, num_sms);
}

int one_block_threads(int num_ranks) {
    return kWarpSize * ((num_ranks + kWarpSize - 1) / kWarpSize);
}

void launch_wait_entered(const Control& control, const LowLatencyPeers& peers, uint64_t seq, gpuStream_t stream) {
    wait_entered_kernel<<<1, one_block_threads(control.num_ranks), 0, stream>>>(control, peers, seq);
    check_launch("low-latency wait for the peers to enter");
}

void check_shape(int num_ranks, int num_experts, int num_topk) {
    if (num_experts % num_ranks != 0 || num_experts / num_ranks > kMaxLocalExperts - 2)
        throw std::invalid_argument("mtdeepep: experts per rank out of range for the CUDA low-latency kernels");
    if (num_topk > kMaxTopk) throw std::invalid_argument("mtdeepep: the CUDA low-latency kernels take num_topk <= 32");
}

}  // namespace

void load_low_latency_kernels() {
    load_kernel(reinterpret_cast<const void*>(enter_kernel), "enter_kernel");
    load_kernel(reinterpret_cast<const void*>(wait_entered_kernel), "wait_entered_kernel");
    load_kernel(reinterpret_cast<const void*>(wait_signals_kernel), "wait_signals_kernel");
    load_kernel(reinterpret_cast<const void*>(count_kernel), "count_kernel");
    load_kernel(reinterpret_cast<const void*>(dispatch_send_kernel), "dispatch_send_kernel");
    load_kernel(reinterpret_cast<const void*>(dispatch_receive_kernel), "dispatch_receive_kernel");
    load_kernel(reinterpret_cast<const void*>(combine_send_kernel), "combine_send_kernel");
    load_kernel(reinterpret_cast<const void*>(combine_receive_kernel<true>), "combine_receive_kernel<true>");
    load_kernel(reinterpret_cast<const void*>(combine_receive_kernel<false>), "combine_receive_kernel<false>");
    load_kernel(reinterpret_cast<const void*>(cast_kernel), "cast_kernel");
}

void launch_low_latency_enter(const LowLatencyPeers& peers, int rank, uint64_t seq, gpuStream_t stream) {
    enter_kernel<<<1, 1, 0, stream>>>(peers, rank, seq);
    check_launch("low-latency enter");
}

void launch_low_latency_dispatch_send(const Control& control, const LowLatencyPeers& peers, uint64_t seq,
                                      const LowLatencyDispatchArgs& args, int num_sms, gpuStream_t stream) {
    check_shape(control.num_ranks, args.num_experts, args.num_topk);
    if (args.use_fp8 && (args.hidden % kScaleBlock != 0 || args.x_stride % 4 != 0))
        throw std::invalid_argument("mtdeepep: the FP8 cast needs hidden % 128 == 0 and a row stride % 4 == 0");
    launch_wait_entered(control, peers, seq, stream);
    count_kernel<<<args.num_experts, kThreads, 0, stream>>>(control, peers, seq, args);
    check_launch("low-latency count");
    dispatch_send_kernel<<<grid_size(num_sms), kThreads, 0, stream>>>(control, peers, seq, args);
    check_launch("low-latency dispatch send");
}

void launch_low_latency_dispatch_receive(const Control& control, const LowLatencyPeers& peers, uint64_t seq,
                                         int num_max_tokens, int hidden, int num_experts, int32_t* recv_count,
                                         int32_t* cumulative_stats, int64_t* wait_ns, gpuStream_t stream) {
    dispatch_receive_kernel<<<1, kThreads, 0, stream>>>(control, peers, seq, num_max_tokens, hidden, num_experts,
                                                        recv_count, cumulative_stats, wait_ns);
    check_launch("low-latency dispatch receive");
}

void launch_low_latency_combine_send(const Control& control, const LowLatencyPeers& peers, uint64_t seq,
                                     const LowLatencyCombineArgs& args, int num_sms, gpuStream_t stream) {
    check_shape(control.num_ranks, args.num_experts, args.num_topk);
    launch_wait_entered(control, peers, seq, stream);
    combine_send_kernel<<<grid_size(num_sms), kThreads, 0, stream>>>(control, peers, seq, args);
    check_launch("low-latency combine send");
}

void launch_low_latency_combine_receive(const Control& control, const LowLatencyPeers& peers, uint64_t seq,
                                        const LowLatencyCombineArgs& args, int64_t* wait_ns, int num_sms,
                                        gpuStream_t stream) {
    check_shape(control.num_ranks, args.num_experts, args.num_topk);
    const bool vector = args.hidden % 8 == 0 && (reinterpret_cast<uintptr_t>(args.out) & 15u) == 0;
    auto kernel = vector ? combine_receive_kernel<true> : combine_receive_kernel<false>;
    // A warp per token: no more blocks than tokens need.
    const int blocks = std::max(1, std::min(num_sms, (args.num_tokens + kWarps - 1) / kWarps));
    wait_signals_kernel<<<1, one_block_threads(control.num_ranks), 0, stream>>>(
        control, peers, seq, LowLatencyControl(control.num_ranks).combine_signals, Phase::kLowLatencyCombineReceive,
        wait_ns);
    check_launch("low-latency combine wait");
    kernel<<<blocks, kThreads, 0, stream>>>(control, peers, seq, args);
    check_launch("low-latency combine receive");
}

void launch_cast_to_fp8(const uint16_t* x, int64_t x_stride, int num_tokens, int hidden, bool round_scale,
                        uint8_t* e4m3, float* scales, int num_sms, gpuStream_t stream) {
    if (hidden % kScaleBlock != 0 || x_stride % 4 != 0)
        throw std::invalid_argument("mtdeepep: the FP8 cast needs hidden % 128 == 0 and a row stride % 4 == 0");
    if (num_tokens == 0) return;
    cast_kernel<<<grid_size(num_sms), kThreads, 0, stream>>>(x, x_stride, num_tokens, hidden, round_scale, e4m3,
                                                             scales);
    check_launch("FP8 cast");
}

}  // namespace mtdeepep::gpu
