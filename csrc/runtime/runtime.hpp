// The C++ runtime behind mtdeepep.Buffer for ranks that share a host: it alone touches tensors, owns the shared
// segments and the comm thread, and drives the CPU kernels. Python validates arguments before calling it.
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/cpu/api.hpp"
#include "runtime/event.hpp"
#include "runtime/memory.hpp"
#include "shm/peer_group.hpp"
#include "shm/segment.hpp"

namespace mtdeepep {

using OptTensor = std::optional<at::Tensor>;
struct TrafficMatrix;

using LayoutResult = std::tuple<at::Tensor, OptTensor, at::Tensor, at::Tensor, EventPtr>;

// recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, rank_prefix_matrix,
// channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx, send_head, event
using DispatchResult = std::tuple<at::Tensor, OptTensor, OptTensor, OptTensor, std::vector<int>, at::Tensor, at::Tensor,
                                  at::Tensor, at::Tensor, at::Tensor, EventPtr>;

using CombineResult = std::tuple<at::Tensor, OptTensor, EventPtr>;

class Runtime {
  public:
    Runtime(int rank, int num_ranks, int64_t num_nvl_bytes, double timeout_s, int num_threads);
    ~Runtime();

    // Set-up: every rank passes all ranks' segment names and pids (gathered by Python).
    std::string segment_name() const { return own_segment_->name(); }
    int64_t pid() const;
    void sync(const std::vector<std::string>& names, const std::vector<int64_t>& pids);
    bool is_available() const { return available_; }
    void destroy();

    void set_timeout(double timeout_s);
    void set_num_threads(int num_threads) { num_threads_ = num_threads; }
    int64_t num_nvl_bytes() const { return num_nvl_bytes_; }
    // A view of this rank's data region; it keeps the mapping alive while it exists.
    at::Tensor get_local_buffer_tensor(at::ScalarType dtype, int64_t offset) const;

    LayoutResult get_dispatch_layout(const at::Tensor& topk_idx, int num_experts, const EventPtr& previous_event,
                                     bool async_finish);

    DispatchResult intranode_dispatch(const at::Tensor& x, const OptTensor& x_scales, const OptTensor& topk_idx,
                                      const OptTensor& topk_weights, const OptTensor& num_tokens_per_rank,
                                      const at::Tensor& is_token_in_rank, const OptTensor& num_tokens_per_expert,
                                      const OptTensor& cached_rank_prefix_matrix, int expert_alignment,
                                      int num_worst_tokens, int num_channels, const EventPtr& previous_event,
                                      bool async_finish);

    CombineResult intranode_combine(const at::Tensor& x, const OptTensor& topk_weights, const OptTensor& bias0,
                                    const OptTensor& bias1, const at::Tensor& rank_prefix_matrix,
                                    const at::Tensor& send_head, int num_channels, const EventPtr& previous_event,
                                    bool async_finish);

  private:
    struct DispatchArgs;
    struct CombineArgs;
    void run_dispatch(DispatchArgs& args);
    void fill_dispatch_metadata(DispatchArgs& args, const TrafficMatrix& traffic, const cpu::SendPlan& plan,
                                int experts_per_rank);
    void publish_reservation(const RegionArena::Block& block);
    RegionArena::Block read_reservation(int rank);
    void run_combine(CombineArgs& args);

    // Runs `body` on the comm thread after `previous_event`; returns the completion event. Failures that leave
    // the ranks out of step poison the runtime and are published to the peers.
    EventPtr submit(const EventPtr& previous_event, std::function<void()> body);
    void check_usable() const;
    uint8_t* data_region(int rank) const;
    // A field of `rank`'s mailbox slot for the current operation.
    int32_t* mailbox(int rank, size_t field) const {
        return peers_->mailbox(rank, field + (operation_ & 1) * layout_.slot_bytes);
    }
    // Publishes this rank's operation signature, waits at `phase`, and checks every peer published the same.
    void exchange_signature(const std::vector<int32_t>& signature, const char* phase);

    int rank_;
    int num_ranks_;
    int64_t num_nvl_bytes_;
    double timeout_s_;
    int num_threads_;
    shm::MailboxLayout layout_;
    std::shared_ptr<shm::SharedSegment> own_segment_;
    std::vector<std::shared_ptr<shm::SharedSegment>> segments_;
    std::unique_ptr<shm::PeerGroup> peers_;
    std::unique_ptr<CommStream> stream_;
    std::shared_ptr<RegionArena> arena_;  // blocks of this rank's region: outputs and staging
    std::shared_ptr<HostPool> pool_;      // recycled heap blocks for outputs that do not live in the region
    uint64_t operation_ = 0;              // operations that used the mailbox, on the comm thread
    bool available_ = false;
    bool destroyed_ = false;
    std::string failure_;  // set by the comm thread; read by callers after waiting on an event
    mutable std::mutex failure_mutex_;
};

}  // namespace mtdeepep
