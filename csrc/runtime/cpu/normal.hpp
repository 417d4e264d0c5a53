// DeepEP's normal mode (intranode dispatch / combine) on the CPU executor, on top of the runtime base: ranks of one
// host exchange rows through the normal regions of their shared segments. It alone touches tensors and drives the
// raw-pointer kernels of kernels/cpu/api.hpp; Python validates the arguments before calling it.
//
// Identity: every dispatch gets the next sequence number of this runtime; with the runtime's uid (agreed by the ranks
// at set-up) it names the dispatch. Cached dispatch and combine publish the identity of the dispatch whose handle they
// were given (and a checksum of its traffic matrix) in their signature, so ranks that pass handles of different
// dispatches all raise GroupMismatch instead of exchanging rows that do not match. A handle from another live buffer of
// the same group is accepted, as upstream does.
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <optional>
#include <tuple>
#include <vector>

#include "kernels/cpu/api.hpp"
#include "runtime/event.hpp"
#include "runtime/memory.hpp"
#include "runtime/runtime.hpp"

namespace mtdeepep::cpu {

using OptTensor = std::optional<at::Tensor>;
struct TrafficMatrix;

// The identity of a dispatch: the uid of the runtime that made it and its sequence number there.
struct DispatchId {
    int64_t uid = 0;
    int64_t seq = 0;
};

using LayoutResult = std::tuple<at::Tensor, OptTensor, at::Tensor, at::Tensor, EventPtr>;

// recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, rank_prefix_matrix,
// channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx, send_head, dispatch seq, event
using DispatchResult = std::tuple<at::Tensor, OptTensor, OptTensor, OptTensor, std::vector<int>, at::Tensor, at::Tensor,
                                  at::Tensor, at::Tensor, at::Tensor, int64_t, EventPtr>;

using CombineResult = std::tuple<at::Tensor, OptTensor, EventPtr>;

class NormalProtocol : public std::enable_shared_from_this<NormalProtocol> {
  public:
    explicit NormalProtocol(RuntimePtr runtime);

    LayoutResult get_dispatch_layout(const at::Tensor& topk_idx, int num_experts, const EventPtr& previous_event,
                                     bool async_finish);

    // `routing`: is_token_in_rank [T, R] bool. Cached mode (no top-k, no counts): `routing` is the earlier dispatch's
    // send_head [T, R] int32, with its `cached_rank_prefix_matrix` and identity (`cached_uid`, `cached_seq`); both
    // are checked against each other before anything moves.
    //
    // Placed outputs (cached mode only): `out_x` [>= rows received, H] and `out_scales` (when `x_scales` is given)
    // are views of this rank's region from `region_empty`; the senders write their rows straight into them (at this
    // dispatch's receive offsets), and they are returned as recv_x / recv_x_scales, with an empty recv_src_idx.
    DispatchResult dispatch(const at::Tensor& x, const OptTensor& x_scales, const OptTensor& topk_idx,
                            const OptTensor& topk_weights, const at::Tensor& routing,
                            const OptTensor& num_tokens_per_expert, const OptTensor& cached_rank_prefix_matrix,
                            int64_t cached_uid, int64_t cached_seq, int expert_alignment, int num_worst_tokens,
                            int num_channels, const EventPtr& previous_event, bool async_finish, const OptTensor& out_x,
                            const OptTensor& out_scales);

    // `rank_prefix_matrix` [R, R] int32 and `send_head` [T, R] int32 of the dispatch (uid, seq); they are checked
    // (bounds and consistency) before any row moves, so a damaged handle raises instead of reading out of range.
    CombineResult combine(const at::Tensor& x, const OptTensor& topk_weights, const OptTensor& bias0,
                          const OptTensor& bias1, const at::Tensor& rank_prefix_matrix, const at::Tensor& send_head,
                          int64_t uid, int64_t seq, int num_channels, const EventPtr& previous_event,
                          bool async_finish);

    const RuntimePtr& runtime() const { return runtime_; }
    // An output tensor from this protocol's pool of pre-faulted host blocks (large outputs allocated every step
    // would otherwise pay a page fault per 4 KiB on first touch).
    at::Tensor empty(at::IntArrayRef sizes, at::ScalarType dtype) { return pool_->empty(sizes, dtype); }
    // A `[rows, hidden]` tensor in this rank's region, for placed outputs of cached dispatches (peers write it
    // directly, saving the receiver's copy). It keeps its block, and room to stage the combine of `hidden`-wide rows
    // with `num_topk` weights, while it lives (valid after `destroy()`, as dispatch outputs are). nullopt when the
    // region has no such room (or nothing to hold): use `empty` then.
    std::optional<at::Tensor> region_empty(at::IntArrayRef sizes, at::ScalarType dtype, int num_topk);

  private:
    struct DispatchArgs;
    struct CombineArgs;
    void run_dispatch(DispatchArgs& args);
    void fill_dispatch_metadata(DispatchArgs& args, const TrafficMatrix& traffic, const SendPlan& plan,
                                int experts_per_rank);
    // The block of its region a rank lends to an operation, and how much of it outputs may keep.
    struct Reservation {
        RegionArena::Block block;
        size_t placeable = 0;
        int64_t placed_x = -1, placed_scales = -1;  // region offsets of placed outputs, -1 when none
    };
    // Checks that `out` can take `rows` rows like `like` (dtype, width) and lies in this rank's region.
    void check_placed(const at::Tensor& out, const at::Tensor& like, int64_t rows, const char* name) const;
    int64_t region_offset(const at::Tensor& tensor) const;
    void publish_reservation(const Reservation& reservation);
    Reservation read_reservation(int rank);
    void run_combine(CombineArgs& args);

    uint8_t* data_region(int rank) const { return runtime_->nvl_region(rank); }
    // A field of `rank`'s mailbox slot for the current operation.
    int32_t* mailbox(int rank, size_t field) const {
        return runtime_->mailbox(rank, field + (operation_ & 1) * runtime_->mailbox_layout().slot_bytes);
    }
    // Publishes this rank's operation signature, waits at `phase`, and checks every peer published the same.
    void exchange_signature(const std::vector<int32_t>& signature, const char* phase);

    RuntimePtr runtime_;
    int rank_;
    int num_ranks_;
    std::shared_ptr<RegionArena> arena_;  // blocks of this rank's region: outputs and staging
    std::shared_ptr<HostPool> pool_;      // recycled heap blocks for outputs that do not live in the region
    uint64_t operation_ = 0;              // operations that used the mailbox, on the comm thread
    int64_t dispatches_ = 0;              // non-cached dispatches issued (caller's thread): their sequence numbers
};

}  // namespace mtdeepep::cpu
