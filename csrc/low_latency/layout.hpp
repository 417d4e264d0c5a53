// Where everything lives in a rank's low-latency region (the CPU analog of DeepEP's low-latency RDMA buffer).
//
//   [control area]  [half 0]  [half 1]
//
// Consecutive low-latency calls (dispatch or combine) alternate between the two halves, so the results of two
// calls can be alive at once (DeepEP's double buffering).
//
// The control area holds all signalling state, at offsets that depend only on the rank count, so that calls with
// different shapes never mistake data for a signal:
//
//   ControlHeader                 PeerGroup's barrier state (set-up and clean_low_latency_buffer)
//   RecvProgress                  per half, the last op whose receive phase finished on this rank
//   signals   [2][R]              per half and source rank: "my writes for op #n are done"
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
// Every rank computes the same offsets from the same arguments; the size hint is `region_bytes`.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "shm/peer_group.hpp"

namespace mtdeepep::low_latency {

constexpr int kScaleBlock = 128;   // channels per FP8 scale
constexpr int kScalesPerPack = 4;  // UE8M0 exponents per int32
constexpr size_t kPageAlignment = 4096;
constexpr size_t kLineAlignment = 64;

inline size_t align_up(size_t value, size_t alignment) {
    return (value + alignment - 1) / alignment * alignment;
}

// What kind of call wrote a signal, so that a receiver can tell when ranks disagree about the call.
enum class OpKind : int32_t { kDispatch = 1, kCombine = 2 };

// What a call is, as every rank must agree: published next to each signal and checked by the receiver.
struct CallSignature {
    int32_t kind;
    int32_t hidden;
    int32_t num_max_dispatch_tokens_per_rank;
    int32_t num_experts;
    int32_t flags;  // dispatch: bit 0 FP8, bit 1 round_scale, bit 2 UE8M0

    bool operator==(const CallSignature& other) const {
        return kind == other.kind && hidden == other.hidden &&
               num_max_dispatch_tokens_per_rank == other.num_max_dispatch_tokens_per_rank &&
               num_experts == other.num_experts && flags == other.flags;
    }
    bool operator!=(const CallSignature& other) const { return !(*this == other); }
};

// Written by a source rank into a receiver's control area; `seq` is stored last (release) and names the op.
struct alignas(64) Signal {
    std::atomic<uint64_t> seq;
    CallSignature call;
};

// Per half, the last op whose receive phase finished on the owning rank. A sender writes op #n into a peer's half
// only once the peer finished op #n-2 there.
struct alignas(64) RecvProgress {
    std::atomic<uint64_t> done[2];
};

// Offsets inside the control area; they depend on the rank count only.
struct ControlLayout {
    size_t progress = 0, signals = 0, counters = 0, bytes = 0;

    explicit ControlLayout(int num_ranks) {
        progress = align_up(sizeof(shm::ControlHeader), kLineAlignment);
        signals = align_up(progress + sizeof(RecvProgress), kLineAlignment);
        counters = align_up(signals + 2 * sizeof(Signal) * num_ranks, kLineAlignment);
        bytes = align_up(counters + 2 * sizeof(uint32_t) * shm::kMaxExperts, kPageAlignment);
    }
    size_t signal(int half, int source, int num_ranks) const {
        return signals + sizeof(Signal) * (static_cast<size_t>(half) * num_ranks + source);
    }
    size_t counter_block(int half) const { return counters + sizeof(uint32_t) * shm::kMaxExperts * half; }
};

// Offsets of one half, relative to the half's start.
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

// The bytes a region needs for these arguments: the control area and two halves.
inline size_t region_bytes(int num_max_tokens, int hidden, int num_ranks, int num_experts) {
    return ControlLayout(num_ranks).bytes + 2 * HalfLayout(num_max_tokens, hidden, num_ranks, num_experts).bytes;
}

}  // namespace mtdeepep::low_latency
