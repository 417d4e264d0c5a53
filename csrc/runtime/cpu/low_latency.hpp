// DeepEP's low-latency mode on CPU ranks, on top of the runtime base: it uses the low-latency area of the runtime's
// segments (runtime/cpu/low_latency_layout.hpp), signals and waits through the runtime's peer group, runs on its comm
// thread, and drives the kernels of kernels/cpu/low_latency.hpp. Python (mtdeepep/engines/cpu.py) validates the
// arguments before calling it.
//
// Two transports move the same rows into the same receive layout:
// - shared memory (every rank on one node): the sender writes each (token, expert) row straight into the receiver's
//   slot in the receiver's mapped area, then publishes a per-source signal the receiver waits for;
// - collective (ranks on several nodes): the sender packs one message per (token, expert) row per destination,
//   Python moves them with torch.distributed.all_to_all_single, and the receiver unpacks them into its own area.
//   Its rank numbering is the whole group's (`rank`, `num_ranks`), not the node runtime's.
//
// Every call takes the next op number n; it uses half n % 2 of every area. Before writing op n into a peer's half, a
// sender waits until the peer has entered op n (see Progress); every wait is bounded by the timeout and names the
// ranks that did not arrive.
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "common/exception.hpp"
#include "runtime/cpu/low_latency_layout.hpp"
#include "runtime/event.hpp"
#include "runtime/runtime.hpp"

namespace mtdeepep::cpu {

using OptTensor = std::optional<at::Tensor>;
using Hook = std::function<void()>;

namespace ll {
struct DispatchOp;
struct CombineOp;
}  // namespace ll

// recv_x, recv_x_scales, recv_count, src_info, layout_range, dispatch seq, event (null unless async), hook (only in
// hook mode)
using LowLatencyDispatchResult =
    std::tuple<at::Tensor, OptTensor, at::Tensor, at::Tensor, at::Tensor, int64_t, EventPtr, std::optional<Hook>>;
// combined_x, event, hook
using LowLatencyCombineResult = std::tuple<at::Tensor, EventPtr, std::optional<Hook>>;
// op number, packed messages (uint8), per destination [R, 8] int64 (message bytes, then the call's signature: kind,
// hidden, num_max_dispatch_tokens_per_rank, num_experts, flags, dispatch uid, dispatch seq), the dispatch outputs
using CollectiveDispatchSend =
    std::tuple<int64_t, at::Tensor, at::Tensor, at::Tensor, OptTensor, at::Tensor, at::Tensor, at::Tensor>;
// op number, packed messages (uint8), per destination [R, 8] int64 (message bytes and the signature, as above),
// bytes per source [R] int64, combined_x
using CollectiveCombineSend = std::tuple<int64_t, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

class LowLatencyProtocol : public std::enable_shared_from_this<LowLatencyProtocol> {
  public:
    // `shared_memory`: the runtime's peers are exactly this protocol's ranks (rank == runtime rank); else the
    // collective transport with the whole group's numbering.
    LowLatencyProtocol(RuntimePtr runtime, int rank, int num_ranks, bool shared_memory);

    static int64_t size_hint(int num_max_dispatch_tokens_per_rank, int hidden, int num_ranks, int num_experts);
    bool uses_shared_memory() const { return shared_memory_; }

    // ---- shared-memory transport ----
    LowLatencyDispatchResult dispatch(const at::Tensor& x, const at::Tensor& topk_idx,
                                      const OptTensor& cumulative_stats, const OptTensor& wait_stats,
                                      int num_max_dispatch_tokens_per_rank, int num_experts, bool use_fp8,
                                      bool round_scale, bool use_ue8m0, bool async_finish, bool return_recv_hook);
    // (`dispatch_uid`, `dispatch_seq`): the identity of the dispatch whose handle is passed.
    LowLatencyCombineResult combine(const at::Tensor& x, const at::Tensor& topk_idx, const at::Tensor& topk_weights,
                                    const at::Tensor& src_info, const at::Tensor& layout_range,
                                    const OptTensor& wait_stats, int num_max_dispatch_tokens_per_rank, int num_experts,
                                    int64_t dispatch_uid, int64_t dispatch_seq, bool zero_copy, bool async_finish,
                                    bool return_recv_hook, const OptTensor& out);

    // ---- collective transport: Python moves the packed messages between the two calls ----
    CollectiveDispatchSend collective_dispatch_send(const at::Tensor& x, const at::Tensor& topk_idx,
                                                    int num_max_dispatch_tokens_per_rank, int num_experts, bool use_fp8,
                                                    bool round_scale, bool use_ue8m0);
    // `info`: the [R, 8] rows the sources sent to this rank (their bytes and signatures).
    void collective_dispatch_recv(int64_t op, const at::Tensor& messages, const at::Tensor& info,
                                  const OptTensor& cumulative_stats);
    CollectiveCombineSend collective_combine_send(const at::Tensor& x, const at::Tensor& topk_idx,
                                                  const at::Tensor& topk_weights, const at::Tensor& src_info,
                                                  const at::Tensor& layout_range, int num_max_dispatch_tokens_per_rank,
                                                  int num_experts, int64_t dispatch_uid, int64_t dispatch_seq,
                                                  bool zero_copy, const OptTensor& out);
    void collective_combine_recv(int64_t op, const at::Tensor& messages, const at::Tensor& info);

    // ---- both ----
    // The bfloat16 [E_local, R * T, H] area the next zero-copy combine reads (two areas, alternating).
    at::Tensor next_combine_buffer(int num_max_dispatch_tokens_per_rank, int hidden, int num_experts);
    // Zeroes this rank's signalling state and op numbering. Shared-memory transport: between two barriers of all
    // ranks; collective transport: the caller synchronises the ranks around it.
    void clean(int num_max_dispatch_tokens_per_rank, int hidden, int num_experts);

  private:
    std::shared_ptr<ll::DispatchOp> make_dispatch(const at::Tensor& x, const at::Tensor& topk_idx,
                                                  const OptTensor& cumulative_stats, const OptTensor& wait_stats,
                                                  int num_max_tokens, int num_experts, bool use_fp8, bool round_scale,
                                                  bool use_ue8m0, bool hook_mode);
    std::shared_ptr<ll::CombineOp> make_combine(const at::Tensor& x, const at::Tensor& topk_idx,
                                                const at::Tensor& topk_weights, const at::Tensor& src_info,
                                                const at::Tensor& layout_range, const OptTensor& wait_stats,
                                                int num_max_tokens, int num_experts, int64_t dispatch_uid,
                                                int64_t dispatch_seq, bool zero_copy, const OptTensor& out,
                                                bool hook_mode);
    void send_dispatch(ll::DispatchOp& op);
    void receive_dispatch(ll::DispatchOp& op);
    void finish_dispatch(ll::DispatchOp& op);
    void send_combine(ll::CombineOp& op);
    void receive_combine(ll::CombineOp& op);
    void finish_combine(ll::CombineOp& op);
    void combine_rows(const ll::CombineOp& op, int source, std::vector<int64_t>& src_rows,
                      std::vector<int64_t>& dst_rows) const;
    // Collective transport: the pending op `op_number`, removed from `pending`; the sources' signatures checked
    // against this rank's (GroupMismatch on every rank that sees a difference).
    template <typename Op>
    std::shared_ptr<Op> take_pending(std::map<int64_t, std::shared_ptr<Op>>& pending, int64_t op_number,
                                     const char* what);
    void check_collective_signatures(uint64_t seq, const ll::CallSignature& expected, const at::Tensor& info,
                                     const char* what);

    // The checks every shared-memory call starts with.
    void check_shared_memory_call(bool async_finish, bool return_recv_hook) const;
    // Runs `op`: send and receive now or on the comm thread (`async_finish`: returns the event), or only the send,
    // returning the hook that receives.
    template <typename Op>
    std::pair<EventPtr, std::optional<Hook>> run(const std::shared_ptr<Op>& op, void (LowLatencyProtocol::*send)(Op&),
                                                 void (LowLatencyProtocol::*receive)(Op&), bool async_finish,
                                                 bool return_recv_hook);
    template <typename Op>
    std::optional<Hook> make_hook(const std::shared_ptr<Op>& op, EventPtr sent,
                                  void (LowLatencyProtocol::*receive)(Op&));
    // Hands out the next op number; refuses one whose half still belongs to a hook that was not called.
    uint64_t begin_op(bool hook_mode);
    // The send phase of op `seq` starts: the results of op seq - 2 are given up (see ll::Progress).
    void enter(uint64_t seq);
    void end_receive(uint64_t seq);

    // Waits until `ready(peer)` holds for every peer in `peers`; `wait_ns` ([R], may be null) gets each peer's wait.
    void wait_for(std::vector<int> peers, const std::function<bool(int)>& ready, const std::string& phase, uint64_t seq,
                  int64_t* wait_ns) const;
    // Before writing op `seq` into `peer`'s half: wait until the peer has entered op `seq` (the wait is added to
    // `wait_ns[peer]` when given: time spent because of that peer).
    void wait_peer_entered(int peer, uint64_t seq, const char* what, int64_t* wait_ns) const;
    // Whether `peer` entered call `seq` (so its half of call seq - 2 may be written).
    bool peer_entered(int peer, uint64_t seq) const;
    // Calls `send(peer)` for every peer once it entered call `seq`, readiest first (see the .cpp).
    void send_when_entered(uint64_t seq, const char* what, int64_t* wait_ns,
                           const std::function<void(int)>& send) const;
    // Tells `receiver` that this rank's writes for op `seq` are done.
    void publish(int receiver, uint64_t seq, const ll::CallSignature& signature) const;
    // Waits for every source's signal of op `seq`; returns an error message if they did not all make this call.
    std::string wait_signals(uint64_t seq, const ll::CallSignature& expected, const char* phase,
                             int64_t* wait_ns) const;

    void check_fits(const ll::HalfLayout& layout) const;
    // A rank's area: the runtime's numbering equals this protocol's with shared memory; the collective transport
    // only ever touches this rank's own area.
    uint8_t* area(int rank) const {
        MTDEEPEP_HOST_ASSERT(shared_memory_ || rank == rank_);
        return runtime_->ll_region(shared_memory_ ? rank : runtime_->rank());
    }
    uint8_t* half(int rank, uint64_t seq) const { return area(rank) + control_.bytes + (seq & 1) * half_bytes_; }
    ll::Progress* progress(int rank) const { return reinterpret_cast<ll::Progress*>(area(rank) + control_.progress); }
    ll::Signal* signal_of(int receiver, uint64_t seq, int source) const {
        return reinterpret_cast<ll::Signal*>(area(receiver) + control_.signal(seq & 1, source, num_ranks_));
    }
    std::atomic<uint32_t>* counters_of(int receiver, uint64_t seq) const {
        return reinterpret_cast<std::atomic<uint32_t>*>(area(receiver) + control_.counter_block(seq & 1));
    }

    RuntimePtr runtime_;
    int rank_;
    int num_ranks_;
    bool shared_memory_;
    ll::ControlLayout control_;
    size_t half_bytes_;

    uint64_t seq_ = 0;                                 // op numbers handed out (caller's thread)
    std::atomic<uint64_t> epoch_{0};                   // clean_low_latency_buffer calls
    std::array<std::atomic<bool>, 2> hook_pending_{};  // per half: a hook-mode op whose receive was not run yet
    std::array<at::Tensor, 2> combine_send_;           // zero-copy combine areas
    uint64_t zero_copy_combines_ = 0;
    std::mutex collective_mutex_;
    std::map<int64_t, std::shared_ptr<ll::DispatchOp>> collective_dispatches_;
    std::map<int64_t, std::shared_ptr<ll::CombineOp>> collective_combines_;
};

}  // namespace mtdeepep::cpu
