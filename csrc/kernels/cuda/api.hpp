// The CUDA/MUSA kernels of mtdeepep behind a plain C++ launcher API: raw pointers, sizes and a stream, no torch
// headers, so every .cu file compiles alone (scripts/check_cuda.sh) and the host module (csrc/runtime/cuda/) only
// passes addresses through.
//
// Memory of one rank (csrc/runtime/cuda/buffer.hpp allocates it; the peers open it through IPC):
//   - the normal buffer: [NormalControl: flags, counts][data region: num_nvl_bytes]
//   - the low-latency buffer: [LowLatencyControl: flags, counters][half 0][half 1] (num_rdma_bytes)
//   - a host-mapped block (pinned, mapped): the status word the host polls, the abort word the host sets, and the
//     counts the host reads after a dispatch's notify phase (the only host synchronisation, skipped when the caller
//     fixes the receive size with num_worst_tokens).
//
// Every wait on the device is bounded (`Control::timeout_ns`): past it the kernel writes (kind, phase, peer, rank)
// into the status word and returns; the host turns the word into CommTimeoutError / CommError naming the rank and
// phase (error_message below), never a hung GPU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "kernels/cuda/portable.cuh"

#if defined(__CUDACC__) || defined(__MUSACC__)
#define MTDEEPEP_HD __host__ __device__ __forceinline__
#else
#define MTDEEPEP_HD inline
#endif

namespace mtdeepep::gpu {

constexpr int kMaxLocalExperts = 4096;  // experts one rank may own (bounds the per-rank count arrays)
constexpr int kMaxChannels = 128;       // channels of the handle's channel prefix matrices (as the CPU executor)
constexpr int kScaleBlock = 128;        // channels per FP8 scale
constexpr int kScalesPerPack = 4;       // UE8M0 exponents per int32
constexpr size_t kAlignment = 4096;     // regions start page-aligned (and 16-byte aligned rows stay aligned)

// Element types of the float payloads (torch's bfloat16, float16, float32).
enum class FloatKind : int { kBFloat16 = 0, kFloat16 = 1, kFloat32 = 2 };

MTDEEPEP_HD size_t float_kind_bytes(FloatKind kind) {
    return kind == FloatKind::kFloat32 ? 4 : 2;
}

MTDEEPEP_HD size_t align_up(size_t value, size_t alignment) {
    return (value + alignment - 1) / alignment * alignment;
}

// ---- errors ----
// kTimeout: this rank's own bounded wait ran out (peer: the rank it waited for).
// kPeerFailed: this rank stopped because another rank failed first (peer: that rank; the host-mapped `cause` word
//   holds that rank's own error, so a rank stopped by a peer's timeout reports the rank that did not arrive).
// kAborted: the host ended the waits (interrupt, destroy).
// kOverflow, kWorstTokens: a receiver gets more rows than its region holds, or than num_worst_tokens. Every rank
//   derives them from the same traffic matrix before any row moves, so every rank reports them alike, nobody is
//   poisoned, and the buffer stays usable once the host has raised them (`is_recoverable`).
enum class ErrorKind : uint32_t {
    kNone = 0,
    kTimeout = 1,
    kPeerFailed = 2,
    kAborted = 3,
    kOverflow = 4,
    kWorstTokens = 5,
};
MTDEEPEP_HD bool is_recoverable(ErrorKind kind) {
    return kind == ErrorKind::kOverflow || kind == ErrorKind::kWorstTokens;
}
enum class Phase : uint32_t {
    kNone = 0,
    kNotify = 1,           // dispatch: the exchange of counts
    kBarrier = 2,          // every rank entered the operation (combine, cached dispatch)
    kDispatchReceive = 3,  // dispatch: the senders' rows
    kCombineReceive = 4,   // combine: the rows sent back
    kLowLatencyEnter = 5,  // low latency: a peer entered the call (its half of two calls back is free)
    kLowLatencyDispatchReceive = 6,
    kLowLatencyCombineReceive = 7,
};

// kind (bits 56..63), phase (48..55), peer + 1 (24..47), rank + 1 (0..23): never 0 for an error.
MTDEEPEP_HD uint64_t encode_error(ErrorKind kind, Phase phase, int peer, int rank) {
    return (static_cast<uint64_t>(kind) << 56) | (static_cast<uint64_t>(phase) << 48) |
           ((static_cast<uint64_t>(peer + 1) & 0xffffffu) << 24) | (static_cast<uint64_t>(rank + 1) & 0xffffffu);
}
MTDEEPEP_HD ErrorKind error_kind(uint64_t code) {
    return static_cast<ErrorKind>(code >> 56);
}
MTDEEPEP_HD Phase error_phase(uint64_t code) {
    return static_cast<Phase>((code >> 48) & 0xffu);
}
MTDEEPEP_HD int error_peer(uint64_t code) {
    return static_cast<int>((code >> 24) & 0xffffffu) - 1;
}
MTDEEPEP_HD int error_rank(uint64_t code) {
    return static_cast<int>(code & 0xffffffu) - 1;
}

const char* phase_name(Phase phase);
// A sentence naming the rank, the peer and the phase of a status word (host side). `cause`: for kPeerFailed, the
// failed peer's own error word; `detail`: for the overflow kinds, (rows the receiver gets, the bound).
std::string error_message(uint64_t code, uint64_t cause = 0, int64_t detail_rows = 0, int64_t detail_bound = 0);

// What every communicating kernel gets: where to report, when to give up, who it is.
struct Control {
    uint64_t* status;              // device memory, this rank: the first error (0: none)
    uint64_t* host_status;         // host-mapped mirror of `status` (device address of the mapping)
    const int32_t* host_abort;     // host-mapped: the host sets it to end every wait (interrupt, destroy)
    uint64_t* poison;              // this rank's poison word (in its normal buffer): the first failed peer's error
    uint64_t* const* peer_poison;  // [R] device array: every rank's poison word, opened through IPC
    uint64_t* host_cause;          // host-mapped: the peer error that stopped this rank (kPeerFailed)
    int64_t* host_detail;          // host-mapped [2]: (rows, bound) of an overflow
    uint64_t timeout_ns;
    int64_t clock_khz;  // MUSA: clock64() rate for the timeouts (CUDA uses %globaltimer)
    int rank, num_ranks;
};

// The host-mapped block of one rank.
struct HostMapped {
    uint64_t status;
    uint64_t cause;     // kPeerFailed: the failed peer's error word
    int64_t detail[2];  // kOverflow / kWorstTokens: rows the receiver gets, the bound it exceeds
    int32_t abort;
    int32_t num_recv_tokens;  // dispatch notify: rows this rank receives (-1 until written)
    int32_t num_recv_tokens_per_expert[kMaxLocalExperts];
};

// ---- the normal buffer ----
// Control area, then the data region. Offsets depend on the rank count only, so every rank agrees.
struct NormalLayout {
    size_t poison, notify_flags, barrier_flags, dispatch_flags, combine_flags, arrivals, counts, expert_counts,
        channel_counts, plan, op_counter;
    size_t control_bytes;

    MTDEEPEP_HD explicit NormalLayout(int num_ranks) {
        size_t offset = 0;
        auto place = [&](size_t bytes) {
            const size_t at = offset;
            offset = align_up(offset + bytes, 64);
            return at;
        };
        poison = place(sizeof(uint64_t));
        notify_flags = place(sizeof(uint64_t) * num_ranks);
        barrier_flags = place(sizeof(uint64_t) * num_ranks);
        dispatch_flags = place(sizeof(uint64_t) * num_ranks);
        combine_flags = place(sizeof(uint64_t) * num_ranks);
        arrivals = place(sizeof(uint32_t) * 8);
        counts = place(sizeof(int32_t) * 2 * num_ranks * num_ranks);
        expert_counts = place(sizeof(int32_t) * 2 * num_ranks * kMaxLocalExperts);
        channel_counts = place(sizeof(int32_t) * 2 * num_ranks * kMaxChannels);
        plan = place(sizeof(int32_t) * 4);
        op_counter = place(sizeof(uint64_t));
        control_bytes = align_up(offset, kAlignment);
    }
};
// Grid arrival counters (NormalLayout::arrivals) of the kernels that finish with the last-block pattern.
enum ArrivalCounter { kDispatchArrivals = 0, kCombineArrivals = 1 };

// What one dispatched row carries, in the receive region of the data area: x | scales | topk_idx | topk_weights |
// src_idx, each field an array over `capacity` rows (16-byte aligned).
struct RowFormat {
    size_t x_bytes;      // bytes of one x row (hidden * element size)
    int num_scales;      // 0 without scales
    size_t scale_bytes;  // bytes of one scale element (4: float32 or packed UE8M0)
    int num_topk;        // 0 without topk_idx / topk_weights
    MTDEEPEP_HD size_t row_bytes() const {
        return align_up(x_bytes, 16) + align_up(num_scales * scale_bytes, 16) + num_topk * (8 + 4) + 4 + 16;
    }
};
struct RowRegion {
    uint8_t* x;
    uint8_t* scales;
    int64_t* topk_idx;
    float* topk_weights;
    int32_t* src_idx;
    int64_t capacity;
};
MTDEEPEP_HD RowRegion row_region(uint8_t* data, size_t data_bytes, const RowFormat& f) {
    RowRegion r;
    const int64_t capacity = static_cast<int64_t>(data_bytes / f.row_bytes());
    size_t offset = 0;
    auto take = [&](size_t bytes) {
        uint8_t* at = data + offset;
        offset = align_up(offset + bytes * capacity, 16);
        return at;
    };
    r.x = take(f.x_bytes);
    r.scales = take(f.num_scales * f.scale_bytes);
    r.topk_idx = reinterpret_cast<int64_t*>(take(sizeof(int64_t) * f.num_topk));
    r.topk_weights = reinterpret_cast<float*>(take(sizeof(float) * f.num_topk));
    r.src_idx = reinterpret_cast<int32_t*>(take(sizeof(int32_t)));
    r.capacity = capacity;
    return r;
}

// ---- layout ----
// topk_idx [T, K] int64 (-1 = none) -> num_tokens_per_rank [R], num_tokens_per_expert [E] (int32), is_token_in_rank
// [T, R] bool. One thread per token, counters in shared memory (E + R ints) summed into global memory.
void launch_dispatch_layout(const int64_t* topk_idx, int num_tokens, int num_topk, int num_ranks, int num_experts,
                            int32_t* num_tokens_per_rank, int32_t* num_tokens_per_expert, bool* is_token_in_rank,
                            int num_sms, gpuStream_t stream);

// send_head [T, R] int32: token t's position among the tokens sent to rank r (token order), or -1; and the count per
// rank [R]. One block per rank, a block-wide scan over the tokens.
void launch_send_positions(const bool* is_token_in_rank, int num_tokens, int num_ranks, int32_t* send_head,
                           int32_t* num_sent_per_rank, gpuStream_t stream);

// ---- intranode dispatch / combine ----
// Peers' buffers: base[r] is rank r's normal buffer (control area first), opened through IPC (this rank's own at
// base[rank]); a device array of R pointers.
struct Peers {
    uint8_t* const* base;
    size_t data_bytes;  // num_nvl_bytes (the same on every rank)
};

// Notify (one block): publishes this rank's per-rank counts (num_sent_per_rank [R]), the counts per expert of every
// receiver's local experts (num_tokens_per_expert [E]) and its channel prefix matrix (channel_prefix [R, C]: rows
// sent to rank j from channels <= c) into every peer, waits for every peer's, then writes rank_prefix_matrix [R, R]
// (int32, [i][j] = rows ranks 0..i send to rank j), recv_channel_prefix [R, C] (where source i's channel c starts
// among the received rows), num_recv_tokens_per_expert [E / R] (int32, each aligned up to expert_alignment) and,
// into the host-mapped block, the same counts and the number of rows received. A receiver whose rows do not fit the
// data region (`capacity` rows) fails the dispatch on every rank (ErrorKind::kOverflow) before any row moves, and so
// does one that receives more than `num_worst_tokens` rows (> 0; ErrorKind::kWorstTokens: its outputs would drop
// rows).
void launch_notify_dispatch(const Control& control, const Peers& peers, const int32_t* num_sent_per_rank,
                            const int32_t* num_tokens_per_expert, int num_experts, const int32_t* channel_prefix,
                            int num_channels, int expert_alignment, int64_t capacity, int64_t num_worst_tokens,
                            int32_t* rank_prefix_matrix, int32_t* recv_channel_prefix,
                            int32_t* num_recv_tokens_per_expert, HostMapped* host_mapped_device, gpuStream_t stream);

// Every rank sets its flag in every peer and waits for all (one block). Orders a new operation's writes into the
// peers after every rank finished reading its region for the previous one.
void launch_barrier(const Control& control, const Peers& peers, gpuStream_t stream);

// Where the sender's rows come from: token t's x row at x + t * x_stride (bytes); scale s of token t at
// scales + (t * scale_token_stride + s * scale_column_stride) * scale_bytes (any layout, column-major included).
struct DispatchSource {
    const uint8_t* x;
    int64_t x_stride;
    const uint8_t* scales;  // may be null
    int64_t scale_token_stride, scale_column_stride;
    const int64_t* topk_idx;    // [T, K], may be null (cached dispatch)
    const float* topk_weights;  // [T, K], may be null
    int num_tokens;
    int num_experts;  // global experts (topk_idx values)
};

// Writes every token to its exact slot in each receiving rank's data region (rank_prefix_matrix gives where this
// rank's rows start in each receiver, send_head the position), experts rewritten to the receiver's local ids (-1 and
// weight 0 elsewhere); then the last block publishes completion to every receiver. num_sms blocks, a warp per
// (token, destination). The capacity and `num_worst_tokens` checks of the notify are repeated here for the cached
// dispatch, which has no notify.
void launch_dispatch_send(const Control& control, const Peers& peers, const DispatchSource& source,
                          const RowFormat& format, const int32_t* send_head, const int32_t* rank_prefix_matrix,
                          int64_t num_worst_tokens, int num_sms, gpuStream_t stream);

// Where the received rows go (the output tensors); null members are not written.
struct DispatchOutputs {
    uint8_t* x;
    uint8_t* scales;  // [rows, S] row-major
    int64_t* topk_idx;
    float* topk_weights;
    int32_t* src_idx;
    int64_t num_rows;  // rows of the outputs: the rows received, or num_worst_tokens (the rest padded: idx -1)
};

// Waits for every sender (one block), then copies the received rows from this rank's data region into the outputs
// (num_sms blocks, none of which waits: a wide grid never spins while a peer's kernel may still need the SMs).
void launch_dispatch_receive(const Control& control, const Peers& peers, const RowFormat& format,
                             const int32_t* rank_prefix_matrix, const DispatchOutputs& outputs, int num_sms,
                             gpuStream_t stream);

// Combine, send phase: every received row (x [num_recv, H] in `kind`, weights [num_recv, K] or null) goes back to its
// source rank, into that rank's data region at the slot the source reads (rows from rank j after those of ranks < j).
void launch_combine_send(const Control& control, const Peers& peers, FloatKind kind, int hidden, int num_topk,
                         const uint8_t* x, const float* topk_weights, const int32_t* rank_prefix_matrix, int num_sms,
                         gpuStream_t stream);

// Combine, reduce phase: waits for every rank's rows (one block), then out[t] = sum over ranks r with send_head[t, r]
// >= 0 of the row r sent back (this rank's own rows read straight from x) + bias0[t] + bias1[t], accumulated in FP32
// and rounded once to `kind`; out_weights[t, k] the sum of the weights sent back. A warp per token.
void launch_combine_reduce(const Control& control, const Peers& peers, FloatKind kind, int hidden, int num_topk,
                           const uint8_t* x, const float* topk_weights, const int32_t* rank_prefix_matrix,
                           const int32_t* send_head, int num_tokens, const uint8_t* bias0, const uint8_t* bias1,
                           uint8_t* out, float* out_weights, int num_sms, gpuStream_t stream);

// Bytes of the combine region per row (x row + weights), for the capacity check.
MTDEEPEP_HD size_t combine_row_bytes(size_t x_bytes, int num_topk) {
    return align_up(x_bytes, 16) + align_up(sizeof(float) * num_topk, 16);
}

// ---- low-latency mode ----
// Legend: T = num_max_dispatch_tokens_per_rank, H hidden, R ranks, E experts, E_local = E / R, RT = R * T rows per
// local expert, S = ceil(H / 128).
//
// Control area of the low-latency buffer: entered (the last call this rank began), per half and source: dispatch and
// combine signals, per half and local expert: the rows reserved so far (the senders' atomics; reset by the
// receiver). Then two halves of a fixed size (calls alternate: DeepEP's double buffering), each:
//   layout_range [E_local, R] int64 (begin << 32 | count), src_info [E_local, RT] int32, scales [E_local, S, RT]
//   (float32, column-major; UE8M0: int32 [E_local, ceil(S/4), RT] in the same bytes), recv_x [E_local, RT, H]
//   (bfloat16, or e4m3 in the first half of the bytes), combine_recv [E, T, H] bfloat16.
struct LowLatencyControl {
    size_t entered, dispatch_signals, combine_signals, counters, bytes;
    MTDEEPEP_HD explicit LowLatencyControl(int num_ranks) {
        entered = 0;
        dispatch_signals = 64;
        combine_signals = align_up(dispatch_signals + sizeof(uint64_t) * 2 * num_ranks, 64);
        counters = align_up(combine_signals + sizeof(uint64_t) * 2 * num_ranks, 64);
        bytes = align_up(counters + sizeof(uint32_t) * 2 * kMaxLocalExperts, kAlignment);
    }
};

struct LowLatencyHalf {
    int num_ranks, num_experts, num_local_experts, num_max_tokens, hidden, num_scales;
    size_t layout_range, src_info, scales, recv_x, combine_recv, bytes;
    MTDEEPEP_HD LowLatencyHalf(int num_max_tokens, int hidden, int num_ranks, int num_experts)
        : num_ranks(num_ranks),
          num_experts(num_experts),
          num_local_experts(num_experts / num_ranks),
          num_max_tokens(num_max_tokens),
          hidden(hidden),
          num_scales((hidden + kScaleBlock - 1) / kScaleBlock) {
        const size_t rows = static_cast<size_t>(rows_per_expert()) * num_local_experts;
        size_t offset = 0;
        auto place = [&](size_t bytes, size_t alignment) {
            offset = align_up(offset, alignment);
            const size_t at = offset;
            offset += bytes;
            return at;
        };
        layout_range = place(sizeof(int64_t) * num_local_experts * num_ranks, 64);
        src_info = place(sizeof(int32_t) * rows, 64);
        scales = place(sizeof(float) * num_scales * rows, 64);
        recv_x = place(sizeof(uint16_t) * hidden * rows, kAlignment);
        combine_recv = place(sizeof(uint16_t) * hidden * static_cast<size_t>(num_experts) * num_max_tokens, kAlignment);
        bytes = align_up(offset, kAlignment);
    }
    MTDEEPEP_HD int64_t rows_per_expert() const { return static_cast<int64_t>(num_ranks) * num_max_tokens; }
};

// Low-latency peers: base[r] is rank r's low-latency buffer; half_bytes the fixed size of each half.
struct LowLatencyPeers {
    uint8_t* const* base;
    size_t half_bytes;
};

struct LowLatencyDispatchArgs {
    const uint16_t* x;  // [T_this, H] bfloat16, row stride x_stride elements
    int64_t x_stride;
    const int64_t* topk_idx;  // [T_this, K]
    int num_tokens, num_topk, hidden, num_max_tokens, num_experts;
    bool use_fp8, round_scale, use_ue8m0;
    int32_t* slots;          // scratch [T_this, K]: the row of (t, k) among this rank's rows to expert topk_idx[t, k]
    int32_t* expert_counts;  // scratch [E]: rows this rank sends to each expert
    int32_t* expert_begin;   // scratch [E]: where they start in the receiver's rows of that expert
};

// Dispatch, send phase (hook mode: launched at call time): waits until every receiver entered call `seq` (its half
// seq % 2 is free), reserves each expert's rows in the receiver by one atomic per (expert, source), casts each
// token to FP8 once (1x128 blocks, e4m3, scale max(amax, 1e-4) / 448, round_scale / UE8M0 as DeepEP) and writes
// its row, scales and source index into the receiving expert's rows, then signals every receiver.
void launch_low_latency_dispatch_send(const Control& control, const LowLatencyPeers& peers, uint64_t seq,
                                      const LowLatencyDispatchArgs& args, int num_sms, gpuStream_t stream);

// Dispatch, receive phase (the hook): waits for every source's signal, writes recv_count [E_local] (int32) and adds
// it to cumulative_stats (int32 [E_local], may be null); wait_ns [R] (int64, may be null) gets each source's wait;
// resets the half's counters for the call two steps on.
void launch_low_latency_dispatch_receive(const Control& control, const LowLatencyPeers& peers, uint64_t seq,
                                         int num_max_tokens, int hidden, int num_experts, int32_t* recv_count,
                                         int32_t* cumulative_stats, int64_t* wait_ns, gpuStream_t stream);

struct LowLatencyCombineArgs {
    const uint16_t* x;  // [E_local, RT, H] bfloat16 expert outputs
    const int32_t* src_info;
    const int64_t* layout_range;  // [E_local, R]
    const int64_t* topk_idx;      // [T_this, K]
    const float* topk_weights;    // [T_this, K]
    int num_tokens, num_topk, hidden, num_max_tokens, num_experts;
    uint16_t* out;  // [T_this, H] bfloat16
};

// Combine, send phase: waits until every receiver entered call `seq`, writes each received row back into its source
// rank's combine_recv[expert, token], signals.
void launch_low_latency_combine_send(const Control& control, const LowLatencyPeers& peers, uint64_t seq,
                                     const LowLatencyCombineArgs& args, int num_sms, gpuStream_t stream);

// Combine, receive phase: waits for every rank's signal, then out[t] = sum_k w[t, k] * combine_recv[topk_idx[t, k],
// t] in FP32 (slot order), rounded once to bfloat16. wait_ns as in dispatch.
void launch_low_latency_combine_receive(const Control& control, const LowLatencyPeers& peers, uint64_t seq,
                                        const LowLatencyCombineArgs& args, int64_t* wait_ns, int num_sms,
                                        gpuStream_t stream);

// Marks this rank as having entered call `seq` (before its send phase): a peer writes call seq into this rank's half
// seq % 2 only after that.
void launch_low_latency_enter(const LowLatencyPeers& peers, int rank, uint64_t seq, gpuStream_t stream);

// The FP8 cast alone (the same as the fused one): x [T, H] bfloat16 -> e4m3 [T, H], scales [T, S] float32.
void launch_cast_to_fp8(const uint16_t* x, int64_t x_stride, int num_tokens, int hidden, bool round_scale,
                        uint8_t* e4m3, float* scales, int num_sms, gpuStream_t stream);

// Throws std::runtime_error with the toolkit's message if the last launch failed.
void check_launch(const char* what);

// ---- module loading ----
// Loads every kernel of the executor on the current device now (cudaFuncGetAttributes). Under CUDA's lazy module
// loading (the default since CUDA 12) a kernel is loaded at its first launch, and loading may synchronise the whole
// context: a first launch issued while this process's kernels spin-wait for peers blocks until those waits end,
// and if the peers wait for this very launch (ranks of one process, or a host that launches the ranks' kernels in
// turn) only the timeout ends it. Called by every DeviceBuffer at construction, as NCCL loads its kernels at init.
void load_layout_kernels();
void load_intranode_kernels();
void load_low_latency_kernels();
void load_all_kernels();
// Whether the current context loads modules lazily (1), eagerly (0), or unknown (-1: no driver entry point, MUSA).
int module_loading_lazy();
// cudaFuncGetAttributes of one kernel: loads it; throws naming it on failure.
void load_kernel(const void* kernel, const char* name);

}  // namespace mtdeepep::gpu
