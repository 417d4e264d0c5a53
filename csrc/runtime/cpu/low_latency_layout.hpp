// Where everything lives in a rank's low-latency area (the CPU analog of DeepEP's low-latency RDMA buffer), the last
// part of the rank's shared segment (see runtime/runtime.hpp):
//
//   [control area]  [half 0]  [half 1]
//
// Consecutive low-latency calls (dispatch or combine) alternate between the two halves, so the results of two calls
// can be alive at once (DeepEP's double buffering). The halves have a fixed place and size, half of what follows the
// control area: a call's layout depends on its shape (hidden size, experts, tokens), but where a half starts does
// not, so a call of another shape never writes over the other half's results.
//
// The control area holds all signalling state, at offsets that depend only on the rank count, so that calls with
// different shapes never mistake data for a signal:
//
//   Progress                      the last op whose send phase started on this rank, and per half the last op whose
//                                 receive phase finished
//   signals   [2][R]              per half and source rank: "my writes for op #n are done" and the call's signature
//   counters  [2][kMaxExperts]    per half and local expert: rows reserved so far (the receiver resets them)
//
// One half, for num_max_dispatch_tokens_per_rank T, hidden H, R ranks, E experts (E_local = E / R per rank,
// RT = R * T rows per local expert, S = ceil(H / 128) scale blocks):
//
//   layout_range  [E_local, R]        int64 (begin << 32) | count of the rows each source wrote
//   src_info      [E_local, RT]       int32 token index on the source rank
//   scales        [E_local, S, RT]    float32, column-major as upstream; UE8M0 packs 4 per int32 in the same bytes
//   recv_x        [E_local, RT, H]    bfloat16 rows, or float8_e4m3fn rows in the first half of the same bytes
//   combine_recv  [E, T, H]           bfloat16: the expert outputs for this rank's tokens, by (expert, token)
//
// Every rank computes the same offsets from the same arguments; the size hint is `area_bytes`.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "kernels/cpu/low_latency.hpp"
#include "shm/peer_group.hpp"

namespace mtdeepep::cpu::ll {

constexpr size_t kPageAlignment = 4096;
constexpr size_t kLineAlignment = 64;

inline size_t align_up(size_t value, size_t alignment) {
    return (value + alignment - 1) / alignment * alignment;
}

// What kind of call wrote a signal, so that a receiver can tell when ranks disagree about the call.
enum class OpKind : int32_t { kDispatch = 1, kCombine = 2 };

// What a call is, as every rank must agree: published next to each signal and checked by the receiver. A dispatch
// carries its own identity, a combine the identity of the dispatch whose handle it was given: ranks that combine
// different dispatches (or a handle of another buffer on one rank only) disagree here.
struct CallSignature {
    int32_t kind;
    int32_t hidden;
    int32_t num_max_dispatch_tokens_per_rank;
    int32_t num_experts;
    int32_t flags;  // dispatch: bit 0 FP8, bit 1 round_scale, bit 2 UE8M0
    int64_t dispatch_uid;
    int64_t dispatch_seq;

    bool operator==(const CallSignature& other) const {
        return kind == other.kind && hidden == other.hidden &&
               num_max_dispatch_tokens_per_rank == other.num_max_dispatch_tokens_per_rank &&
               num_experts == other.num_experts && flags == other.flags && dispatch_uid == other.dispatch_uid &&
               dispatch_seq == other.dispatch_seq;
    }
    bool operator!=(const CallSignature& other) const { return !(*this == other); }
};

// Written by a source rank into a receiver's control area; `seq` is stored last (release) and names the op.
struct alignas(64) Signal {
    std::atomic<uint64_t> seq;
    CallSignature call;
};

// A sender writes op #n into a peer's half only once the peer has *entered* op #n (started its send phase): by then
// the peer made call #n, so the results of call #n-2 in that half are given up, and its calls up to #n-1 have
// finished reading them (a combine may send `recv_x` of the dispatch two calls back straight from the half). `done`:
// per half, the last op whose receive phase finished on this rank (recovery after clean_low_latency_buffer).
struct alignas(64) Progress {
    std::atomic<uint64_t> entered;
    std::atomic<uint64_t> done[2];
};

// Offsets inside the control area; they depend on the rank count only.
struct ControlLayout {
    size_t progress = 0, signals = 0, counters = 0, bytes = 0;

    explicit ControlLayout(int num_ranks) {
        progress = 0;
        signals = align_up(progress + sizeof(Progress), kLineAlignment);
        counters = align_up(signals + 2 * sizeof(Signal) * num_ranks, kLineAlignment);
        bytes = align_up(counters + 2 * sizeof(uint32_t) * shm::kMaxExperts, kPageAlignment);
    }
    size_t signal(int half, int source, int num_ranks) const {
        return signals + sizeof(Signal) * (static_cast<size_t>(half) * num_ranks + source);
    }
    size_t counter_block(int half) const { return counters + sizeof(uint32_t) * shm::kMaxExperts * half; }
};

// Offsets of one call's data inside a half, relative to the half's start.
struct HalfLayout {
    int num_ranks = 0, num_experts = 0, num_local_experts = 0;
    int num_max_tokens = 0, hidden = 0;
    int num_scales = 0, num_packed_scales = 0;
    size_t layout_range = 0, src_info = 0, scales = 0, recv_x = 0, combine_recv = 0;
    size_t bytes = 0;

    HalfLayout() = default;
    HalfLayout(int num_max_tokens, int hidden, int num_ranks, int num_experts)
        : num_ranks(num_ranks),
          num_experts(num_experts),
          num_local_experts(num_experts / num_ranks),
          num_max_tokens(num_max_tokens),
          hidden(hidden),
          num_scales((hidden + kScaleBlock - 1) / kScaleBlock),
          num_packed_scales((num_scales + kScalesPerPack - 1) / kScalesPerPack) {
        const size_t rows = rows_per_expert() * num_local_experts;
        size_t offset = 0;
        auto place = [&](size_t& field, size_t num_bytes, size_t alignment) {
            offset = align_up(offset, alignment);
            field = offset;
            offset += num_bytes;
        };
        place(layout_range, sizeof(int64_t) * num_local_experts * num_ranks, kLineAlignment);
        place(src_info, sizeof(int32_t) * rows, kLineAlignment);
        place(scales, sizeof(float) * num_scales * rows, kLineAlignment);
        place(recv_x, sizeof(uint16_t) * hidden * rows, kPageAlignment);
        place(combine_recv, sizeof(uint16_t) * hidden * static_cast<size_t>(num_experts) * num_max_tokens,
              kPageAlignment);
        bytes = align_up(offset, kPageAlignment);
    }

    int64_t rows_per_expert() const { return static_cast<int64_t>(num_ranks) * num_max_tokens; }
};

// The bytes an area needs for calls with these arguments: the control area and two halves.
inline size_t area_bytes(int num_max_tokens, int hidden, int num_ranks, int num_experts) {
    return ControlLayout(num_ranks).bytes + 2 * HalfLayout(num_max_tokens, hidden, num_ranks, num_experts).bytes;
}

// The fixed size of each half of an area of `num_bytes`.
inline size_t half_bytes(size_t num_bytes, int num_ranks) {
    const size_t control = ControlLayout(num_ranks).bytes;
    return num_bytes > control ? (num_bytes - control) / 2 / kPageAlignment * kPageAlignment : 0;
}

}  // namespace mtdeepep::cpu::ll
