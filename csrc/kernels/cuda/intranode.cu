// Normal-mode dispatch and combine between the ranks of one node, over their buffers opened through IPC (NVLink).
//
// Design (simpler than DeepEP's channels of SM pairs with ring buffers, and why): a notify phase exchanges the
// counts, so that every rank knows the full rank x rank traffic matrix; from its prefix sums every sender knows the
// exact slot of each of its rows in each receiver's region, and writes the row there directly, from as many SMs as
// the caller gives it, with no head/tail protocol between a sender and a receiver; one completion flag per sender
// (published by the grid's last block) tells the receiver that all of a sender's rows landed. That removes the
// per-chunk flag traffic and the SM pairing (every SM sends; no SM spins while a peer fills a ring), at the cost of a
// receive region that holds one operation's rows (a too-small num_nvl_bytes is reported, not looped over: one
// round). The kernels never wait on another block of their own grid (no intra-grid deadlock, whatever the SM count
// or the other processes sharing the GPU). Waits on peers' flags, each bounded by the timeout, run only in one-block
// kernels (notify, barrier, wait) ahead of the wide ones on the same stream: a wide grid that spun would hold every
// SM it got while the peer it waits for might need one (ranks sharing a GPU in one process, or under MPS).
//
// Phases on the communication stream:
//   dispatch:        send_positions (layout.cu), notify, dispatch_send, wait (dispatch flags), dispatch_receive
//   cached dispatch: barrier, dispatch_send, wait (dispatch flags), dispatch_receive
//   combine:         barrier, combine_send, wait (combine flags), combine_reduce
// The notify (or barrier) of operation n runs only once every rank finished operation n - 1 on its stream, so the
// writes of operation n never overtake a receiver still reading its region for n - 1.
#include "kernels/cuda/device.cuh"

namespace mtdeepep::gpu {

namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / kWarpSize;
constexpr int kMaxNodeRanks = 128;  // ranks of one node (the shared arrays below)

struct ControlView {
    uint8_t* base;
    NormalLayout layout;
    __device__ ControlView(uint8_t* base, int num_ranks) : base(base), layout(num_ranks) {}
    __device__ uint64_t* flags(size_t offset) const { return reinterpret_cast<uint64_t*>(base + offset); }
    __device__ int32_t* ints(size_t offset) const { return reinterpret_cast<int32_t*>(base + offset); }
};

// Operation numbers live on the device (NormalLayout::op_counter, this rank's own): the first kernel of an operation
// (notify or barrier) takes the next one, the later kernels of the operation read it. A CUDA graph that captured a
// dispatch and a combine therefore numbers each replay afresh, as every rank replays the same operations in the
// same order (a number passed from the host would be frozen into the graph).
__device__ __forceinline__ uint64_t begin_operation(uint8_t* base, const NormalLayout& layout) {
    uint64_t* counter = reinterpret_cast<uint64_t*>(base + layout.op_counter);
    const uint64_t seq = load_volatile(counter) + 1;
    __syncthreads();  // every thread has read the old number
    if (threadIdx.x == 0) *counter = seq;
    return seq;
}

__device__ __forceinline__ uint64_t current_operation(uint8_t* base, const NormalLayout& layout) {
    return load_volatile(reinterpret_cast<uint64_t*>(base + layout.op_counter));
}

// Rows rank i sends to rank j, from the inclusive prefix over senders.
__device__ __forceinline__ int32_t traffic(const int32_t* prefix, int num_ranks, int i, int j) {
    return prefix[i * num_ranks + j] - (i > 0 ? prefix[(i - 1) * num_ranks + j] : 0);
}

// Where the rows of ranks before i start in receiver j's region.
__device__ __forceinline__ int32_t rows_before(const int32_t* prefix, int num_ranks, int i, int j) {
    return i > 0 ? prefix[(i - 1) * num_ranks + j] : 0;
}

// Combine region of receiver i: the rows of sender j come after those of senders k < j (k != i).
__device__ __forceinline__ int64_t combine_offset(const int32_t* prefix, int num_ranks, int i, int j) {
    int64_t sum = 0;
    for (int k = 0; k < j; ++k)
        if (k != i) sum += traffic(prefix, num_ranks, i, k);
    return sum;
}

struct CombineRegion {
    uint8_t* x;
    float* weights;
    size_t x_stride;
    int64_t capacity;
};

__device__ __forceinline__ CombineRegion combine_region(uint8_t* data, size_t data_bytes, size_t x_bytes,
                                                        int num_topk) {
    CombineRegion region;
    region.x_stride = align_up(x_bytes, 16);
    region.capacity = static_cast<int64_t>(data_bytes / combine_row_bytes(x_bytes, num_topk));
    region.x = data;
    region.weights = reinterpret_cast<float*>(data + align_up(region.x_stride * region.capacity, 16));
    return region;
}

// The first receiver (lowest rank) whose rows exceed the region's capacity, else the first over num_worst_tokens
// (> 0): the same answer on every rank, which all derive it from the same traffic matrix.
struct Overflow {
    ErrorKind kind;
    int receiver;
    int64_t rows, bound;
};

__device__ __forceinline__ Overflow overflow_of(const int32_t* received, int num_ranks, int64_t capacity,
                                                int64_t num_worst_tokens) {
    for (int j = 0; j < num_ranks; ++j)
        if (received[j] > capacity) return {ErrorKind::kOverflow, j, received[j], capacity};
    for (int j = 0; num_worst_tokens > 0 && j < num_ranks; ++j)
        if (received[j] > num_worst_tokens) return {ErrorKind::kWorstTokens, j, received[j], num_worst_tokens};
    return {ErrorKind::kNone, -1, 0, 0};
}

// Reports `overflow_of` (one thread). Nobody is poisoned: every rank reports the same, no row moves, and the host
// clears the error once raised (the buffer stays usable).
__device__ __forceinline__ void report_overflow(const Control& control, const int32_t* received, int num_ranks,
                                                int64_t capacity, int64_t num_worst_tokens, Phase phase) {
    const Overflow overflow = overflow_of(received, num_ranks, capacity, num_worst_tokens);
    if (overflow.kind != ErrorKind::kNone)
        report_error(control, overflow.kind, phase, overflow.receiver, 0, overflow.rows, overflow.bound);
}

// ---------------------------------------------------------------------------------------------------------------
// Notify and barrier

__global__ void __launch_bounds__(kThreads)
    notify_dispatch_kernel(Control control, Peers peers, const int32_t* __restrict__ num_sent_per_rank,
                           const int32_t* __restrict__ num_tokens_per_expert, int num_experts,
                           const int32_t* __restrict__ channel_prefix, int num_channels, int expert_alignment,
                           int64_t capacity, int64_t num_worst_tokens, int32_t* __restrict__ rank_prefix_matrix,
                           int32_t* __restrict__ recv_channel_prefix, int32_t* __restrict__ num_recv_tokens_per_expert,
                           HostMapped* host_mapped) {
    const int R = control.num_ranks, me = control.rank;
    const int local_experts = num_experts / R;
    const NormalLayout layout(R);
    if (load_volatile(control.status) != 0) return;
    const uint64_t seq = begin_operation(peers.base[me], layout);
    const int parity = static_cast<int>(seq & 1);
    // This rank's row of the traffic matrix and its counts per expert of each receiver, into every peer.
    for (int i = threadIdx.x; i < R * R; i += blockDim.x) {
        const int peer = i / R, j = i % R;
        const ControlView view(peers.base[peer], R);
        view.ints(layout.counts)[(parity * R + me) * R + j] = num_sent_per_rank[j];
    }
    for (int i = threadIdx.x; i < R * local_experts; i += blockDim.x) {
        const int peer = i / local_experts, e = i % local_experts;
        const ControlView view(peers.base[peer], R);
        view.ints(layout.expert_counts)[static_cast<size_t>(parity * R + me) * kMaxLocalExperts + e] =
            num_tokens_per_expert[peer * local_experts + e];
    }
    for (int i = threadIdx.x; i < R * num_channels; i += blockDim.x) {
        const int peer = i / num_channels, c = i % num_channels;
        const ControlView view(peers.base[peer], R);
        view.ints(layout.channel_counts)[static_cast<size_t>(parity * R + me) * kMaxChannels + c] =
            channel_prefix[peer * num_channels + c];
    }
    __syncthreads();
    for (int peer = threadIdx.x; peer < R; peer += blockDim.x)
        store_release(ControlView(peers.base[peer], R).flags(layout.notify_flags) + me, seq);
    const ControlView mine(peers.base[me], R);
    if (!block_wait_flags(control, mine.flags(layout.notify_flags), 1, seq, Phase::kNotify)) return;

    const int32_t* counts = mine.ints(layout.counts) + parity * R * R;
    __shared__ int32_t received[kMaxNodeRanks];
    for (int j = threadIdx.x; j < R; j += blockDim.x) {
        int32_t running = 0;
        for (int i = 0; i < R; ++i) {
            running += *reinterpret_cast<const volatile int32_t*>(counts + i * R + j);
            rank_prefix_matrix[i * R + j] = running;
        }
        received[j] = running;
    }
    __syncthreads();
    // Every rank sees the same matrix, so every rank finds the same overflow (the first receiver over): no poisoning.
    if (threadIdx.x == 0) report_overflow(control, received, R, capacity, num_worst_tokens, Phase::kNotify);
    // Source i's channel c starts after the rows of sources < i and of i's channels < c.
    const int32_t* channel_counts = mine.ints(layout.channel_counts) + static_cast<size_t>(parity) * R * kMaxChannels;
    for (int i = threadIdx.x; i < R * num_channels; i += blockDim.x) {
        const int source = i / num_channels, c = i % num_channels;
        int32_t before = 0;
        for (int k = 0; k < source; ++k) before += *reinterpret_cast<const volatile int32_t*>(counts + k * R + me);
        const int32_t own = c > 0 ? *reinterpret_cast<const volatile int32_t*>(
                                        channel_counts + static_cast<size_t>(source) * kMaxChannels + c - 1)
                                  : 0;
        recv_channel_prefix[i] = before + own;
    }
    const int32_t* expert_counts = mine.ints(layout.expert_counts) + static_cast<size_t>(parity) * R * kMaxLocalExperts;
    for (int e = threadIdx.x; e < local_experts; e += blockDim.x) {
        int32_t sum = 0;
        for (int i = 0; i < R; ++i)
            sum += *reinterpret_cast<const volatile int32_t*>(expert_counts +
                                                              static_cast<size_t>(i) * kMaxLocalExperts + e);
        const int32_t aligned = (sum + expert_alignment - 1) / expert_alignment * expert_alignment;
        num_recv_tokens_per_expert[e] = aligned;
        reinterpret_cast<volatile int32_t*>(host_mapped->num_recv_tokens_per_expert)[e] = aligned;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int32_t total = 0;
        for (int i = 0; i < R; ++i) total += *reinterpret_cast<const volatile int32_t*>(counts + i * R + me);
        __threadfence_system();
        *reinterpret_cast<volatile int32_t*>(&host_mapped->num_recv_tokens) = total;
        __threadfence_system();
    }
}

__global__ void barrier_kernel(Control control, Peers peers) {
    const int R = control.num_ranks, me = control.rank;
    const NormalLayout layout(R);
    if (load_volatile(control.status) != 0) return;
    const uint64_t seq = begin_operation(peers.base[me], layout);
    for (int peer = threadIdx.x; peer < R; peer += blockDim.x)
        store_release(ControlView(peers.base[peer], R).flags(layout.barrier_flags) + me, seq);
    block_wait_flags(control, ControlView(peers.base[me], R).flags(layout.barrier_flags), 1, seq, Phase::kBarrier);
}

// One block: waits until every rank published the current operation in this rank's flags at `flags_offset`
// (dispatch or combine completion), so that the wide kernel after it on the stream never waits.
__global__ void wait_kernel(Control control, Peers peers, size_t flags_offset, Phase phase) {
    const int R = control.num_ranks, me = control.rank;
    const NormalLayout layout(R);
    if (load_volatile(control.status) != 0) return;
    const uint64_t seq = current_operation(peers.base[me], layout);
    block_wait_flags(control, ControlView(peers.base[me], R).flags(flags_offset), 1, seq, phase);
}

// ---------------------------------------------------------------------------------------------------------------
// Dispatch

__global__ void __launch_bounds__(kThreads)
    dispatch_send_kernel(Control control, Peers peers, DispatchSource source, RowFormat format,
                         const int32_t* __restrict__ send_head, const int32_t* __restrict__ rank_prefix_matrix,
                         int64_t num_worst_tokens) {
    const int R = control.num_ranks, me = control.rank;
    const NormalLayout layout(R);
    if (load_volatile(control.status) != 0) return;  // the notify failed on this rank: no row moves
    const uint64_t seq = current_operation(peers.base[me], layout);
    const int lane = threadIdx.x % kWarpSize;
    const int num_topk = format.num_topk;
    const int local_experts = source.num_experts / R;
    __shared__ int32_t first_row[kMaxNodeRanks];  // where this rank's rows start in each receiver
    __shared__ int32_t received[kMaxNodeRanks];
    const int64_t capacity = row_region(nullptr, peers.data_bytes, format).capacity;
    for (int j = threadIdx.x; j < R; j += blockDim.x) {
        first_row[j] = rows_before(rank_prefix_matrix, R, me, j);
        received[j] = rank_prefix_matrix[(R - 1) * R + j];
    }
    __syncthreads();
    // A cached dispatch has no notify: every rank checks every receiver here, from the same matrix, so all of them
    // stop before any row moves (a dispatch's notify found the same already).
    if (overflow_of(received, R, capacity, num_worst_tokens).kind != ErrorKind::kNone) {
        if (threadIdx.x == 0)
            report_overflow(control, received, R, capacity, num_worst_tokens, Phase::kDispatchReceive);
        return;
    }
    const int warp = blockIdx.x * kWarps + threadIdx.x / kWarpSize, num_warps = gridDim.x * kWarps;
    for (int t = warp; t < source.num_tokens; t += num_warps) {
        for (int j = 0; j < R; ++j) {
            const int32_t position = send_head[static_cast<int64_t>(t) * R + j];
            if (position < 0) continue;
            const RowRegion region = row_region(peers.base[j] + layout.control_bytes, peers.data_bytes, format);
            const int64_t row = first_row[j] + position;
            warp_copy(region.x + row * format.x_bytes, source.x + t * source.x_stride, format.x_bytes, lane);
            if (source.scales != nullptr && format.num_scales > 0) {
                for (int s = lane; s < format.num_scales; s += kWarpSize) {
                    const uint8_t* from =
                        source.scales +
                        (t * source.scale_token_stride + s * source.scale_column_stride) * format.scale_bytes;
                    uint8_t* to = region.scales + (row * format.num_scales + s) * format.scale_bytes;
                    for (size_t b = 0; b < format.scale_bytes; ++b) to[b] = from[b];
                }
            }
            if (source.topk_idx != nullptr) {
                for (int k = lane; k < num_topk; k += kWarpSize) {
                    const int64_t expert = source.topk_idx[static_cast<int64_t>(t) * num_topk + k];
                    const int64_t local = expert - static_cast<int64_t>(j) * local_experts;
                    const bool is_local = expert >= 0 && local >= 0 && local < local_experts;
                    region.topk_idx[row * num_topk + k] = is_local ? local : -1;
                    if (source.topk_weights != nullptr)
                        region.topk_weights[row * num_topk + k] =
                            is_local ? source.topk_weights[static_cast<int64_t>(t) * num_topk + k] : 0.0f;
                }
            }
            if (lane == 0) region.src_idx[row] = t;
        }
    }
    if (last_block_done(reinterpret_cast<uint32_t*>(ControlView(peers.base[me], R).ints(layout.arrivals)) +
                        kDispatchArrivals)) {
        for (int j = threadIdx.x; j < R; j += blockDim.x)
            store_release(ControlView(peers.base[j], R).flags(layout.dispatch_flags) + me, seq);
    }
}

__global__ void __launch_bounds__(kThreads)
    dispatch_receive_kernel(Control control, Peers peers, RowFormat format,
                            const int32_t* __restrict__ rank_prefix_matrix, DispatchOutputs out) {
    const int R = control.num_ranks, me = control.rank;
    const NormalLayout layout(R);
    if (load_volatile(control.status) != 0) return;
    // wait_kernel (Phase::kDispatchReceive) ran before on this stream: every sender's rows are here.
    const RowRegion region = row_region(peers.base[me] + layout.control_bytes, peers.data_bytes, format);
    const int64_t total = rank_prefix_matrix[(R - 1) * R + me];
    const int lane = threadIdx.x % kWarpSize, num_topk = format.num_topk;
    const size_t scale_row = format.num_scales * format.scale_bytes;
    const int warp = blockIdx.x * kWarps + threadIdx.x / kWarpSize, num_warps = gridDim.x * kWarps;
    for (int64_t row = warp; row < out.num_rows; row += num_warps) {
        const bool valid = row < total;
        if (valid) {
            warp_copy(out.x + row * format.x_bytes, region.x + row * format.x_bytes, format.x_bytes, lane);
            if (out.scales != nullptr)
                warp_copy(out.scales + row * scale_row, region.scales + row * scale_row, scale_row, lane);
        }
        for (int k = lane; k < num_topk; k += kWarpSize) {
            if (out.topk_idx != nullptr)
                out.topk_idx[row * num_topk + k] = valid ? region.topk_idx[row * num_topk + k] : -1;
            if (out.topk_weights != nullptr)
                out.topk_weights[row * num_topk + k] = valid ? region.topk_weights[row * num_topk + k] : 0.0f;
        }
        if (lane == 0 && out.src_idx != nullptr) out.src_idx[row] = valid ? region.src_idx[row] : -1;
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Combine

__global__ void __launch_bounds__(kThreads)
    combine_send_kernel(Control control, Peers peers, size_t x_bytes, int num_topk, const uint8_t* __restrict__ x,
                        const float* __restrict__ topk_weights, const int32_t* __restrict__ rank_prefix_matrix) {
    const int R = control.num_ranks, me = control.rank;
    const NormalLayout layout(R);
    if (load_volatile(control.status) != 0) return;
    const uint64_t seq = current_operation(peers.base[me], layout);
    __shared__ int32_t column[kMaxNodeRanks];  // inclusive prefix of the rows this rank received, by source
    __shared__ int64_t slot_base[kMaxNodeRanks];
    __shared__ int32_t returned[kMaxNodeRanks];  // rows each rank gets back
    const int64_t capacity = combine_region(nullptr, peers.data_bytes, x_bytes, num_topk).capacity;
    for (int i = threadIdx.x; i < R; i += blockDim.x) {
        column[i] = rank_prefix_matrix[i * R + me];
        slot_base[i] = combine_offset(rank_prefix_matrix, R, i, me);
        returned[i] = static_cast<int32_t>(combine_offset(rank_prefix_matrix, R, i, R));
    }
    __syncthreads();
    // Every rank checks every receiver the same way: all fail together, before any row moves.
    if (overflow_of(returned, R, capacity, 0).kind != ErrorKind::kNone) {
        if (threadIdx.x == 0) report_overflow(control, returned, R, capacity, 0, Phase::kCombineReceive);
        return;
    }
    const int lane = threadIdx.x % kWarpSize;
    const int64_t total = column[R - 1];
    const int warp = blockIdx.x * kWarps + threadIdx.x / kWarpSize, num_warps = gridDim.x * kWarps;
    for (int64_t q = warp; q < total; q += num_warps) {
        int source = 0;
        while (column[source] <= q) ++source;  // R is small: a linear search
        if (source == me) continue;            // read in place by the reduce
        const int64_t position = q - (source > 0 ? column[source - 1] : 0);
        const CombineRegion region =
            combine_region(peers.base[source] + layout.control_bytes, peers.data_bytes, x_bytes, num_topk);
        const int64_t slot = slot_base[source] + position;
        warp_copy(region.x + slot * region.x_stride, x + q * x_bytes, x_bytes, lane);
        if (topk_weights != nullptr)
            for (int k = lane; k < num_topk; k += kWarpSize)
                region.weights[slot * num_topk + k] = topk_weights[q * num_topk + k];
    }
    if (last_block_done(reinterpret_cast<uint32_t*>(ControlView(peers.base[me], R).ints(layout.arrivals)) +
                        kCombineArrivals)) {
        for (int j = threadIdx.x; j < R; j += blockDim.x)
            store_release(ControlView(peers.base[j], R).flags(layout.combine_flags) + me, seq);
    }
}

template <bool kVector>
__global__ void __launch_bounds__(kThreads)
    combine_reduce_kernel(Control control, Peers peers, FloatKind kind, int hidden, int num_topk,
                          const uint8_t* __restrict__ x, const float* __restrict__ topk_weights,
                          const int32_t* __restrict__ rank_prefix_matrix, const int32_t* __restrict__ send_head,
                          int num_tokens, const uint8_t* __restrict__ bias0, const uint8_t* __restrict__ bias1,
                          uint8_t* __restrict__ out, float* __restrict__ out_weights) {
    const int R = control.num_ranks, me = control.rank;
    const NormalLayout layout(R);
    if (load_volatile(control.status) != 0) return;
    // wait_kernel (Phase::kCombineReceive) ran before on this stream: every rank's rows are here.
    const size_t element = float_kind_bytes(kind);
    const size_t x_bytes = element * hidden;
    const CombineRegion region =
        combine_region(peers.base[me] + layout.control_bytes, peers.data_bytes, x_bytes, num_topk);
    // Per source rank j: the first of its rows (this rank's own rows straight from x), their stride, their weights.
    __shared__ const uint8_t* row_base[kMaxNodeRanks];
    __shared__ size_t row_stride[kMaxNodeRanks];
    __shared__ const float* weight_base[kMaxNodeRanks];
    for (int j = threadIdx.x; j < R; j += blockDim.x) {
        if (j == me) {
            const int64_t first = rows_before(rank_prefix_matrix, R, me, me);
            row_base[j] = x + first * x_bytes;
            row_stride[j] = x_bytes;
            weight_base[j] = topk_weights != nullptr ? topk_weights + first * num_topk : nullptr;
        } else {
            const int64_t first = combine_offset(rank_prefix_matrix, R, me, j);
            row_base[j] = region.x + first * region.x_stride;
            row_stride[j] = region.x_stride;
            weight_base[j] = region.weights + first * num_topk;
        }
    }
    __syncthreads();
    const int lane = threadIdx.x % kWarpSize;
    const int warp_in_block = threadIdx.x / kWarpSize;
    __shared__ const uint8_t* rows[kWarps][kMaxNodeRanks + 2];
    __shared__ const float* weight_rows[kWarps][kMaxNodeRanks];
    const int warp = blockIdx.x * kWarps + warp_in_block, num_warps = gridDim.x * kWarps;
    for (int t = warp; t < num_tokens; t += num_warps) {
        // The contributions of token t: a row per rank that received it, then the biases.
        int n = 0, n_weights = 0;
        if (lane == 0) {
            for (int j = 0; j < R; ++j) {
                const int32_t head = send_head[static_cast<int64_t>(t) * R + j];
                if (head < 0) continue;
                rows[warp_in_block][n++] = row_base[j] + head * row_stride[j];
                if (weight_base[j] != nullptr)
                    weight_rows[warp_in_block][n_weights++] = weight_base[j] + head * num_topk;
            }
            if (bias0 != nullptr) rows[warp_in_block][n++] = bias0 + t * x_bytes;
            if (bias1 != nullptr) rows[warp_in_block][n++] = bias1 + t * x_bytes;
        }
        n = __shfl_sync(kFullMask, n, 0);
        n_weights = __shfl_sync(kFullMask, n_weights, 0);
        __syncwarp();
        uint8_t* dst = out + t * x_bytes;
        if constexpr (kVector) {
            // 16 bytes per lane per step: 8 bfloat16 / float16 or 4 float32 elements.
            const int per_pack = static_cast<int>(16 / element);
            const size_t num_packs = x_bytes / 16;
            for (size_t p = lane; p < num_packs; p += kWarpSize) {
                float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
                for (int i = 0; i < n; ++i) {
                    const int4 pack = reinterpret_cast<const int4*>(rows[warp_in_block][i])[p];
                    const uint8_t* bytes = reinterpret_cast<const uint8_t*>(&pack);
#pragma unroll
                    for (int e = 0; e < 8; ++e)
                        if (e < per_pack) acc[e] += load_element(kind, bytes, e);
                }
                int4 result;
                uint8_t* bytes = reinterpret_cast<uint8_t*>(&result);
#pragma unroll
                for (int e = 0; e < 8; ++e)
                    if (e < per_pack) store_element(kind, bytes, e, acc[e]);
                reinterpret_cast<int4*>(dst)[p] = result;
            }
        } else {
            for (int h = lane; h < hidden; h += kWarpSize) {
                float acc = 0.0f;
                for (int i = 0; i < n; ++i) acc += load_element(kind, rows[warp_in_block][i], h);
                store_element(kind, dst, h, acc);
            }
        }
        if (out_weights != nullptr) {
            for (int k = lane; k < num_topk; k += kWarpSize) {
                float sum = 0.0f;
                for (int i = 0; i < n_weights; ++i) sum += weight_rows[warp_in_block][i][k];
                out_weights[static_cast<int64_t>(t) * num_topk + k] = sum;
            }
        }
        __syncwarp();  // the lists are rewritten for the next token
    }
}

int grid_size(int num_sms) {
    return std::max(1, num_sms);
}

int one_block_threads(int num_ranks) {
    return kWarpSize * ((num_ranks + kWarpSize - 1) / kWarpSize);
}

void launch_wait(const Control& control, const Peers& peers, size_t flags_offset, Phase phase, gpuStream_t stream) {
    wait_kernel<<<1, one_block_threads(control.num_ranks), 0, stream>>>(control, peers, flags_offset, phase);
    check_launch("wait for the peers");
}

}  // namespace

void load_intranode_kernels() {
    load_kernel(reinterpret_cast<const void*>(notify_dispatch_kernel), "notify_dispatch_kernel");
    load_kernel(reinterpret_cast<const void*>(barrier_kernel), "barrier_kernel");
    load_kernel(reinterpret_cast<const void*>(wait_kernel), "wait_kernel");
    load_kernel(reinterpret_cast<const void*>(dispatch_send_kernel), "dispatch_send_kernel");
    load_kernel(reinterpret_cast<const void*>(dispatch_receive_kernel), "dispatch_receive_kernel");
    load_kernel(reinterpret_cast<const void*>(combine_send_kernel), "combine_send_kernel");
    load_kernel(reinterpret_cast<const void*>(combine_reduce_kernel<true>), "combine_reduce_kernel<true>");
    load_kernel(reinterpret_cast<const void*>(combine_reduce_kernel<false>), "combine_reduce_kernel<false>");
}

void launch_notify_dispatch(const Control& control, const Peers& peers, const int32_t* num_sent_per_rank,
                            const int32_t* num_tokens_per_expert, int num_experts, const int32_t* channel_prefix,
                            int num_channels, int expert_alignment, int64_t capacity, int64_t num_worst_tokens,
                            int32_t* rank_prefix_matrix, int32_t* recv_channel_prefix,
                            int32_t* num_recv_tokens_per_expert, HostMapped* host_mapped_device, gpuStream_t stream) {
    if (control.num_ranks > kMaxNodeRanks || num_experts / control.num_ranks > kMaxLocalExperts)
        throw std::invalid_argument("mtdeepep: too many ranks per node or experts per rank for the CUDA executor");
    if (num_channels < 1 || num_channels > kMaxChannels)
        throw std::invalid_argument("mtdeepep: the channel count must lie in [1, 128]");
    notify_dispatch_kernel<<<1, kThreads, 0, stream>>>(
        control, peers, num_sent_per_rank, num_tokens_per_expert, num_experts, channel_prefix, num_channels,
        std::max(1, expert_alignment), capacity, num_worst_tokens, rank_prefix_matrix, recv_channel_prefix,
        num_recv_tokens_per_expert, host_mapped_device);
    check_launch("dispatch notify");
}

void launch_barrier(const Control& control, const Peers& peers, gpuStream_t stream) {
    barrier_kernel<<<1, one_block_threads(control.num_ranks), 0, stream>>>(control, peers);
    check_launch("barrier");
}

void launch_dispatch_send(const Control& control, const Peers& peers, const DispatchSource& source,
                          const RowFormat& format, const int32_t* send_head, const int32_t* rank_prefix_matrix,
                          int64_t num_worst_tokens, int num_sms, gpuStream_t stream) {
    dispatch_send_kernel<<<grid_size(num_sms), kThreads, 0, stream>>>(control, peers, source, format, send_head,
                                                                      rank_prefix_matrix, num_worst_tokens);
    check_launch("dispatch send");
}

void launch_dispatch_receive(const Control& control, const Peers& peers, const RowFormat& format,
                             const int32_t* rank_prefix_matrix, const DispatchOutputs& outputs, int num_sms,
                             gpuStream_t stream) {
    launch_wait(control, peers, NormalLayout(control.num_ranks).dispatch_flags, Phase::kDispatchReceive, stream);
    dispatch_receive_kernel<<<grid_size(num_sms), kThreads, 0, stream>>>(control, peers, format, rank_prefix_matrix,
                                                                         outputs);
    check_launch("dispatch receive");
}

void launch_combine_send(const Control& control, const Peers& peers, FloatKind kind, int hidden, int num_topk,
                         const uint8_t* x, const float* topk_weights, const int32_t* rank_prefix_matrix, int num_sms,
                         gpuStream_t stream) {
    combine_send_kernel<<<grid_size(num_sms), kThreads, 0, stream>>>(control, peers, float_kind_bytes(kind) * hidden,
                                                                     num_topk, x, topk_weights, rank_prefix_matrix);
    check_launch("combine send");
}

void launch_combine_reduce(const Control& control, const Peers& peers, FloatKind kind, int hidden, int num_topk,
                           const uint8_t* x, const float* topk_weights, const int32_t* rank_prefix_matrix,
                           const int32_t* send_head, int num_tokens, const uint8_t* bias0, const uint8_t* bias1,
                           uint8_t* out, float* out_weights, int num_sms, gpuStream_t stream) {
    // The vector path needs every row 16-byte aligned: the row size, x, the biases and the output.
    const size_t x_bytes = float_kind_bytes(kind) * hidden;
    const uintptr_t addresses = reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(bias0) |
                                reinterpret_cast<uintptr_t>(bias1) | reinterpret_cast<uintptr_t>(out);
    const bool vector = x_bytes % 16 == 0 && (addresses & 15u) == 0;
    auto kernel = vector ? combine_reduce_kernel<true> : combine_reduce_kernel<false>;
    launch_wait(control, peers, NormalLayout(control.num_ranks).combine_flags, Phase::kCombineReceive, stream);
    kernel<<<grid_size(num_sms), kThreads, 0, stream>>>(control, peers, kind, hidden, num_topk, x, topk_weights,
                                                        rank_prefix_matrix, send_head, num_tokens, bias0, bias1, out,
                                                        out_weights);
    check_launch("combine reduce");
}

}  // namespace mtdeepep::gpu
