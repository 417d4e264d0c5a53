// The C++ runtime of DeepEP's low-latency mode on CPU ranks: it owns this rank's low-latency region (a POSIX
// shared-memory segment of num_rdma_bytes), maps the peers' regions, signals and waits, and drives the kernels of
// low_latency/kernels.hpp. Python (mtdeepep/low_latency.py) validates arguments before calling it.
//
// Two transports move the same rows into the same receive layout (low_latency/layout.hpp):
// - shared memory (every rank on one node): the sender writes each (token, expert) row straight into the
//   receiver's slot in the receiver's mapped region, then publishes a per-source signal the receiver waits for;
// - collective (ranks on several nodes): the sender packs one message per (token, expert) row per destination,
//   Python moves them with torch.distributed.all_to_all_single, and the receiver unpacks them into its own region.
//
// Every call takes the next op number n; it uses half n % 2 of every region. Before writing op n into a peer's
// half, a sender waits until the peer finished receiving op n - 2 there; every wait is bounded by the timeout and
// names the ranks that did not arrive.
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
#include <vector>

#include "low_latency/layout.hpp"
#include "runtime/event.hpp"
#include "shm/peer_group.hpp"
#include "shm/segment.hpp"

namespace mtdeepep::low_latency {

using OptTensor = std::optional<at::Tensor>;
using Hook = std::function<void()>;

// recv_x, recv_x_scales, recv_count, src_info, layout_range, event (null unless async), hook (only in hook mode)
using DispatchResult =
    std::tuple<at::Tensor, OptTensor, at::Tensor, at::Tensor, at::Tensor, EventPtr, std::optional<Hook>>;
// combined_x, event, hook
using CombineResult = std::tuple<at::Tensor, EventPtr, std::optional<Hook>>;
// op number, packed messages (uint8), per destination [R, 6] int64 (message bytes, then the call's signature:
// kind, hidden, num_max_dispatch_tokens_per_rank, num_experts, flags), the dispatch outputs
using CollectiveDispatchSend =
    std::tuple<int64_t, at::Tensor, at::Tensor, at::Tensor, OptTensor, at::Tensor, at::Tensor, at::Tensor>;
// op number, packed messages (uint8), bytes per destination [R] int64, bytes per source [R] int64, combined_x
using CollectiveCombineSend = std::tuple<int64_t, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

struct DispatchOp;
struct CombineOp;

class LowLatencyRuntime : public std::enable_shared_from_this<LowLatencyRuntime> {
  public:
    LowLatencyRuntime(int rank, int num_ranks, int64_t num_rdma_bytes, double timeout_s, int num_threads);
    ~LowLatencyRuntime();
    LowLatencyRuntime(const LowLatencyRuntime&) = delete;
    LowLatencyRuntime& operator=(const LowLatencyRuntime&) = delete;

    // Set-up. Shared-memory transport: every rank passes all ranks' segment names and pids (gathered by Python).
    // Collective transport: `sync_local` (no peer is mapped).
    std::string segment_name() const { return own_segment_->name(); }
    int64_t pid() const;
    void sync(const std::vector<std::string>& names, const std::vector<int64_t>& pids);
    void sync_local();
    bool uses_shared_memory() const { return !segments_.empty(); }
    void destroy();
    void set_timeout(double timeout_s);
    void set_num_threads(int num_threads) { num_threads_ = num_threads; }
    int64_t num_rdma_bytes() const { return num_rdma_bytes_; }

    static int64_t size_hint(int num_max_dispatch_tokens_per_rank, int hidden, int num_ranks, int num_experts);

    // ---- shared-memory transport ----
    DispatchResult dispatch(const at::Tensor& x, const at::Tensor& topk_idx, const OptTensor& cumulative_stats,
                            const OptTensor& wait_stats, int num_max_dispatch_tokens_per_rank, int num_experts,
                            bool use_fp8, bool round_scale, bool use_ue8m0, bool async_finish, bool return_recv_hook);
    CombineResult combine(const at::Tensor& x, const at::Tensor& topk_idx, const at::Tensor& topk_weights,
                          const at::Tensor& src_info, const at::Tensor& layout_range, const OptTensor& wait_stats,
                          int num_max_dispatch_tokens_per_rank, int num_experts, bool zero_copy, bool async_finish,
                          bool return_recv_hook, const OptTensor& out);

    // ---- collective transport: Python moves the packed messages between the two calls ----
    CollectiveDispatchSend collective_dispatch_send(const at::Tensor& x, const at::Tensor& topk_idx,
                                                    int num_max_dispatch_tokens_per_rank, int num_experts, bool use_fp8,
                                                    bool round_scale, bool use_ue8m0);
    // `info`: the [R, 6] rows the sources sent to this rank (their bytes and signatures).
    void collective_dispatch_recv(int64_t op, const at::Tensor& messages, const at::Tensor& info,
                                  const OptTensor& cumulative_stats);
    CollectiveCombineSend collective_combine_send(const at::Tensor& x, const at::Tensor& topk_idx,
                                                  const at::Tensor& topk_weights, const at::Tensor& src_info,
                                                  const at::Tensor& layout_range, int num_max_dispatch_tokens_per_rank,
                                                  int num_experts, bool zero_copy, const OptTensor& out);
    void collective_combine_recv(int64_t op, const at::Tensor& messages);

    // ---- both ----
    // The bfloat16 [E_local, R * T, H] area the next zero-copy combine reads (two areas, alternating).
    at::Tensor next_combine_buffer(int num_max_dispatch_tokens_per_rank, int hidden, int num_experts);
    // Zeroes this rank's signalling state and op numbering. Shared-memory transport: between two barriers of all
    // ranks; collective transport: the caller synchronises the ranks around it.
    void clean(int num_max_dispatch_tokens_per_rank, int hidden, int num_experts);

  private:
    // Ops
    std::shared_ptr<DispatchOp> make_dispatch(const at::Tensor& x, const at::Tensor& topk_idx,
                                              const OptTensor& cumulative_stats, const OptTensor& wait_stats,
                                              int num_max_tokens, int num_experts, bool use_fp8, bool round_scale,
                                              bool use_ue8m0, bool hook_mode);
    std::shared_ptr<CombineOp> make_combine(const at::Tensor& x, const at::Tensor& topk_idx,
                                            const at::Tensor& topk_weights, const at::Tensor& src_info,
                                            const at::Tensor& layout_range, const OptTensor& wait_stats,
                                            int num_max_tokens, int num_experts, bool zero_copy, const OptTensor& out,
                                            bool hook_mode);
    void send_dispatch(DispatchOp& op);
    void receive_dispatch(DispatchOp& op);
    void finish_dispatch(DispatchOp& op);
    void send_combine(CombineOp& op);
    void receive_combine(CombineOp& op);
    void finish_combine(CombineOp& op);
    void combine_rows(const CombineOp& op, int source, std::vector<int64_t>& src_rows,
                      std::vector<int64_t>& dst_rows) const;

    // Execution: `launch` runs `body` inline when nothing is queued and the caller waits, else on the comm thread.
    EventPtr launch(bool async, std::function<void()> body);
    template <typename Op>
    std::optional<Hook> make_hook(const std::shared_ptr<Op>& op, EventPtr sent,
                                  void (LowLatencyRuntime::*receive)(Op&));
    // Hands out the next op number; refuses one whose half still belongs to a hook that was not called.
    uint64_t begin_op(bool hook_mode);
    void end_receive(uint64_t seq);

    // Waits until `ready(peer)` holds for every peer in `peers`; `wait_ns` ([R], may be null) gets each peer's wait.
    void wait_for(std::vector<int> peers, const std::function<bool(int)>& ready, const std::string& phase, uint64_t seq,
                  int64_t* wait_ns) const;
    // Before writing op `seq` into `peer`'s half: wait until the peer finished receiving op seq - 2 there.
    void wait_half_free(int peer, uint64_t seq, const char* what) const;
    // Tells `receiver` that this rank's writes for op `seq` are done.
    void publish(int receiver, uint64_t seq, const CallSignature& signature) const;
    // Waits for every source's signal of op `seq`; returns an error message if they did not all make this call.
    std::string wait_signals(uint64_t seq, const CallSignature& expected, const char* phase, int64_t* wait_ns) const;

    void check_usable() const;
    void check_fits(const HalfLayout& layout) const;
    uint8_t* region(int rank) const;
    uint8_t* half(int rank, const HalfLayout& layout, uint64_t seq) const {
        return region(rank) + control_.bytes + (seq & 1) * layout.bytes;
    }
    RecvProgress* progress(int rank) const { return reinterpret_cast<RecvProgress*>(region(rank) + control_.progress); }
    Signal* signal_of(int receiver, uint64_t seq, int source) const {
        return reinterpret_cast<Signal*>(region(receiver) + control_.signal(seq & 1, source, num_ranks_));
    }
    std::atomic<uint32_t>* counters_of(int receiver, uint64_t seq) const {
        return reinterpret_cast<std::atomic<uint32_t>*>(region(receiver) + control_.counter_block(seq & 1));
    }
    at::Tensor region_view(uint8_t* ptr, at::IntArrayRef sizes, at::IntArrayRef strides, at::ScalarType dtype) const;

    int rank_;
    int num_ranks_;
    int64_t num_rdma_bytes_;
    double timeout_s_;
    int num_threads_;
    ControlLayout control_;
    std::shared_ptr<shm::SharedSegment> own_segment_;
    std::vector<std::shared_ptr<shm::SharedSegment>> segments_;  // empty for the collective transport
    std::unique_ptr<shm::PeerGroup> peers_;
    std::unique_ptr<CommStream> stream_;
    std::atomic<int> queued_{0};  // tasks submitted to the comm thread and not finished
    bool available_ = false;
    bool destroyed_ = false;

    uint64_t seq_ = 0;                                 // op numbers handed out (caller's thread)
    std::atomic<uint64_t> epoch_{0};                   // clean_low_latency_buffer calls
    std::array<std::atomic<bool>, 2> hook_pending_{};  // per half: a hook-mode op whose receive was not run yet
    std::array<at::Tensor, 2> combine_send_;           // zero-copy combine areas
    uint64_t zero_copy_combines_ = 0;
    std::mutex collective_mutex_;
    std::map<int64_t, std::shared_ptr<DispatchOp>> collective_dispatches_;
    std::map<int64_t, std::shared_ptr<CombineOp>> collective_combines_;
};

}  // namespace mtdeepep::low_latency
