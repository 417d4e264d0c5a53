#include "runtime/cpu/low_latency.hpp"

#include <ATen/Parallel.h>
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <stdexcept>

#include "common/exception.hpp"
#include "kernels/cpu/low_latency.hpp"

namespace mtdeepep::cpu {

using namespace ll;

namespace {

constexpr int kFlagFP8 = 1, kFlagRoundScale = 2, kFlagUE8M0 = 4;
constexpr int kCollectiveInfoColumns = 8;  // message bytes, then the CallSignature fields

int64_t pack_range(int64_t begin, int64_t count) {
    return (begin << 32) | count;
}
int64_t range_begin(int64_t range) {
    return range >> 32;
}
int64_t range_count(int64_t range) {
    return range & 0xffffffffll;
}

// Throws std::invalid_argument (ValueError in Python); the message is only built when the check fails.
template <typename... Parts>
void require(bool condition, const Parts&... message) {
    if (!condition) throw std::invalid_argument(concat("mtdeepep: ", message...));
}

// Every id of topk_idx [T, K] lies in [-1, num_experts) and no row names an expert twice (a token's rows for one
// expert would share one combine slot).
void check_topk_idx(const at::Tensor& topk_idx, int num_experts) {
    const int64_t num_tokens = topk_idx.size(0), num_topk = topk_idx.size(1);
    const int64_t* idx = topk_idx.data_ptr<int64_t>();
    std::vector<int64_t> seen_in_row(num_experts, -1);  // the last row that named each expert
    for (int64_t t = 0; t < num_tokens; ++t) {
        const int64_t* row = idx + t * num_topk;
        for (int64_t k = 0; k < num_topk; ++k) {
            require(row[k] >= -1 && row[k] < num_experts, "topk_idx values must lie in [-1, ", num_experts, "), found ",
                    row[k], " at [", t, ", ", k, "]");
            if (row[k] < 0) continue;
            require(seen_in_row[row[k]] != t, "topk_idx row ", t, " names expert ", row[k], " twice");
            seen_in_row[row[k]] = t;
        }
    }
}

// The comm thread moves data in the background: as SCHED_BATCH (allowed without privileges) it still gets its
// fair share of the cores, but waking it does not preempt the caller, so that a call in hook or async mode returns
// at once even when the ranks have fewer cores than threads.
void make_background_thread() {
    static thread_local bool done = false;
    if (done) return;
    done = true;
    sched_param param{};
    param.sched_priority = 0;
    pthread_setschedparam(pthread_self(), SCHED_BATCH, &param);  // best effort: the default policy also works
}

// The ranks in the order a sender visits them: the next rank first, itself last, so that senders spread out.
std::vector<int> send_order(int rank, int num_ranks) {
    std::vector<int> order;
    for (int step = 1; step <= num_ranks; ++step) order.push_back((rank + step) % num_ranks);
    return order;
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------------
// Ops: arguments, outputs and where in the areas they live

namespace ll {

struct DispatchOp {
    uint64_t seq = 0, epoch = 0;
    int64_t uid = 0;  // the runtime's uid: (uid, seq) names this dispatch
    HalfLayout layout;
    at::Tensor x, topk_idx;
    OptTensor cumulative_stats, wait_stats;
    bool use_fp8 = false, round_scale = false, use_ue8m0 = false;
    // outputs
    at::Tensor recv_x, recv_count, src_info, layout_range;
    OptTensor recv_scales;
    size_t message_bytes = 0;  // collective transport

    CallSignature signature() const {
        CallSignature s{};
        s.kind = static_cast<int32_t>(OpKind::kDispatch);
        s.hidden = layout.hidden;
        s.num_max_dispatch_tokens_per_rank = layout.num_max_tokens;
        s.num_experts = layout.num_experts;
        s.flags = (use_fp8 ? kFlagFP8 : 0) | (use_fp8 && round_scale ? kFlagRoundScale : 0) |
                  (use_fp8 && use_ue8m0 ? kFlagUE8M0 : 0);
        s.dispatch_uid = uid;
        s.dispatch_seq = static_cast<int64_t>(seq);
        return s;
    }
};

struct CombineOp {
    uint64_t seq = 0, epoch = 0;
    int64_t dispatch_uid = 0, dispatch_seq = 0;  // the dispatch whose handle was passed
    HalfLayout layout;
    at::Tensor x;  // the expert outputs: the caller's x or the zero-copy area
    at::Tensor topk_idx, topk_weights, src_info, layout_range;
    OptTensor wait_stats;
    at::Tensor combined;
    size_t message_bytes = 0;  // collective transport

    CallSignature signature() const {
        CallSignature s{};
        s.kind = static_cast<int32_t>(OpKind::kCombine);
        s.hidden = layout.hidden;
        s.num_max_dispatch_tokens_per_rank = layout.num_max_tokens;
        s.num_experts = layout.num_experts;
        s.dispatch_uid = dispatch_uid;
        s.dispatch_seq = dispatch_seq;
        return s;
    }
};

}  // namespace ll

namespace {

// The sender's rows: bfloat16 x, or its FP8 cast, grouped by destination expert.
struct Payload {
    at::Tensor e4m3, scales;  // keep the cast alive
    DispatchPayload rows{};
    std::vector<int32_t> expert_offsets, tokens;  // tokens of expert g: tokens[expert_offsets[g]:expert_offsets[g+1]]
};

Payload prepare_payload(const DispatchOp& op) {
    Payload p;
    const int num_tokens = static_cast<int>(op.x.size(0));
    const int hidden = op.layout.hidden;
    const auto* x = static_cast<const uint8_t*>(op.x.data_ptr());
    if (op.use_fp8) {
        p.e4m3 = at::empty({num_tokens, hidden}, at::kByte);
        p.scales = at::empty({num_tokens, op.layout.num_scales}, at::kFloat);
        cast_to_fp8(reinterpret_cast<const uint16_t*>(x), op.x.stride(0), num_tokens, hidden, op.round_scale,
                    p.e4m3.data_ptr<uint8_t>(), p.scales.data_ptr<float>());
        p.rows = {p.e4m3.data_ptr<uint8_t>(),
                  hidden,
                  static_cast<size_t>(hidden),
                  p.scales.data_ptr<float>(),
                  op.layout.num_scales,
                  op.layout.num_scales,
                  op.use_ue8m0};
    } else {
        p.rows = {x, op.x.stride(0) * 2, static_cast<size_t>(hidden) * 2, nullptr, 0, 0, false};
    }
    group_by_expert(op.topk_idx.data_ptr<int64_t>(), num_tokens, static_cast<int>(op.topk_idx.size(1)),
                    op.layout.num_experts, p.expert_offsets, p.tokens);
    return p;
}

std::string describe(const CallSignature& s) {
    return concat("(kind ", s.kind, ", hidden ", s.hidden, ", num_max_dispatch_tokens_per_rank ",
                  s.num_max_dispatch_tokens_per_rank, ", num_experts ", s.num_experts, ", flags ", s.flags,
                  ", dispatch ", s.dispatch_uid, "#", s.dispatch_seq, ")");
}

void write_info_row(int64_t* row, int64_t bytes, const CallSignature& s) {
    row[0] = bytes;
    row[1] = s.kind;
    row[2] = s.hidden;
    row[3] = s.num_max_dispatch_tokens_per_rank;
    row[4] = s.num_experts;
    row[5] = s.flags;
    row[6] = s.dispatch_uid;
    row[7] = s.dispatch_seq;
}

CallSignature read_info_row(const int64_t* row) {
    return {static_cast<int32_t>(row[1]),
            static_cast<int32_t>(row[2]),
            static_cast<int32_t>(row[3]),
            static_cast<int32_t>(row[4]),
            static_cast<int32_t>(row[5]),
            row[6],
            row[7]};
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------------
// Set-up

LowLatencyProtocol::LowLatencyProtocol(RuntimePtr runtime, int rank, int num_ranks, bool shared_memory)
    : runtime_(std::move(runtime)),
      rank_(rank),
      num_ranks_(num_ranks),
      shared_memory_(shared_memory),
      control_(num_ranks),
      half_bytes_(half_bytes(static_cast<size_t>(runtime_->num_ll_bytes()), num_ranks)) {
    require(num_ranks >= 1 && rank >= 0 && rank < num_ranks, "invalid rank ", rank, " of ", num_ranks);
    require(!shared_memory || (rank == runtime_->rank() && num_ranks == runtime_->num_ranks()),
            "the shared-memory transport needs the runtime's own rank numbering");
    require(runtime_->num_ll_bytes() >= static_cast<int64_t>(control_.bytes),
            "low-latency mode needs num_rdma_bytes >= ", control_.bytes, " (got ", runtime_->num_ll_bytes(),
            "); use Buffer.get_low_latency_rdma_size_hint");
    // The area is zero-filled at creation: every progress counter and signal starts at 0.
}

int64_t LowLatencyProtocol::size_hint(int num_max_dispatch_tokens_per_rank, int hidden, int num_ranks,
                                      int num_experts) {
    require(num_max_dispatch_tokens_per_rank > 0 && hidden > 0 && num_ranks > 0 && num_experts > 0 &&
                num_experts % num_ranks == 0,
            "invalid size-hint arguments (num_max_dispatch_tokens_per_rank=", num_max_dispatch_tokens_per_rank,
            ", hidden=", hidden, ", num_ranks=", num_ranks, ", num_experts=", num_experts, ")");
    return static_cast<int64_t>(area_bytes(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts));
}

void LowLatencyProtocol::check_fits(const HalfLayout& layout) const {
    const size_t needed = control_.bytes + 2 * layout.bytes;
    require(layout.bytes <= half_bytes_, "num_rdma_bytes=", runtime_->num_ll_bytes(),
            " is too small for num_max_dispatch_tokens_per_rank=", layout.num_max_tokens, ", hidden=", layout.hidden,
            ", num_experts=", layout.num_experts, " on ", num_ranks_, " ranks: it needs ", needed,
            " (Buffer.get_low_latency_rdma_size_hint)");
}

// ---------------------------------------------------------------------------------------------------------------
// Op numbering, waiting

uint64_t LowLatencyProtocol::begin_op(bool hook_mode) {
    const uint64_t seq = seq_ + 1;
    if (hook_pending_[seq & 1].load())
        throw std::invalid_argument(
            concat("mtdeepep: low-latency call #", seq, " would reuse the buffer half of call #", seq - 2,
                   ", whose receive hook was not called yet; call that hook first (at most two low-latency "
                   "results can be in flight)"));
    seq_ = seq;
    if (hook_mode) hook_pending_[seq & 1].store(true);
    return seq;
}

void LowLatencyProtocol::enter(uint64_t seq) {
    if (shared_memory_) progress(rank_)->entered.store(seq, std::memory_order_release);
}

void LowLatencyProtocol::end_receive(uint64_t seq) {
    progress(rank_)->done[seq & 1].store(seq, std::memory_order_release);
    hook_pending_[seq & 1].store(false);
}

template <typename Op>
std::optional<Hook> LowLatencyProtocol::make_hook(const std::shared_ptr<Op>& op, EventPtr sent,
                                                  void (LowLatencyProtocol::*receive)(Op&)) {
    struct State {
        std::mutex mutex;
        bool ran = false;
        std::exception_ptr error;
    };
    auto state = std::make_shared<State>();
    auto self = shared_from_this();
    return Hook([self, op, sent, state, receive] {
        std::lock_guard<std::mutex> lock(state->mutex);
        if (!state->ran) {
            state->ran = true;
            try {
                self->runtime_->check_usable();
                if (op->epoch != self->epoch_.load())
                    throw CommError(
                        "mtdeepep: this receive hook belongs to a call made before clean_low_latency_buffer");
                if (sent) sent->wait();
                ((*self).*receive)(*op);
            } catch (const Interrupted& interrupted) {
                self->runtime_->interrupt(
                    concat("rank ", self->runtime_->rank(), " was interrupted: ", interrupted.what()));
                state->error = std::current_exception();
            } catch (...) {
                state->error = std::current_exception();
            }
            if (state->error && op->epoch == self->epoch_.load()) self->hook_pending_[op->seq & 1].store(false);
        }
        if (state->error) std::rethrow_exception(state->error);
    });
}

void LowLatencyProtocol::check_shared_memory_call(bool async_finish, bool return_recv_hook) const {
    runtime_->check_usable();
    require(shared_memory_, "this buffer uses the collective transport");
    require(!(async_finish && return_recv_hook), "async_finish and return_recv_hook cannot both be set");
}

template <typename Op>
std::pair<EventPtr, std::optional<Hook>> LowLatencyProtocol::run(const std::shared_ptr<Op>& op,
                                                                 void (LowLatencyProtocol::*send)(Op&),
                                                                 void (LowLatencyProtocol::*receive)(Op&),
                                                                 bool async_finish, bool return_recv_hook) {
    auto self = shared_from_this();
    if (return_recv_hook) {
        // Only the sends are issued, on the comm thread; the hook waits for them and receives.
        EventPtr sent = runtime_->launch(true, [self, op, send] {
            make_background_thread();
            ((*self).*send)(*op);
        });
        return {nullptr, make_hook(op, sent, receive)};
    }
    EventPtr event = runtime_->launch(async_finish, [self, op, send, receive] {
        if (on_comm_thread()) make_background_thread();
        ((*self).*send)(*op);
        ((*self).*receive)(*op);
    });
    return {event, std::nullopt};
}

void LowLatencyProtocol::wait_for(std::vector<int> peers, const std::function<bool(int)>& ready,
                                  const std::string& phase, uint64_t seq, int64_t* wait_ns) const {
    MTDEEPEP_HOST_ASSERT(shared_memory_);  // only the shared-memory transport waits on flags
    std::function<void(int, int64_t)> record;
    if (wait_ns != nullptr) record = [wait_ns](int peer, int64_t waited) { wait_ns[peer] += waited; };
    runtime_->peers().wait_for(std::move(peers), ready, concat("phase '", phase, "' (low-latency op #", seq, ")"),
                               record);
}

void LowLatencyProtocol::wait_peer_entered(int peer, uint64_t seq, const char* what, int64_t* wait_ns) const {
    if (peer == rank_ || seq <= 2) return;  // this rank entered op seq already; ops 1 and 2 find empty halves
    std::atomic<uint64_t>& entered = progress(peer)->entered;
    if (entered.load(std::memory_order_acquire) >= seq) return;
    wait_for(
        {peer}, [&](int) { return entered.load(std::memory_order_acquire) >= seq; },
        concat(what, ": waiting for the peer to make call #", seq, " (it still uses the half of call #", seq - 2, ")"),
        seq, wait_ns);
}

bool LowLatencyProtocol::peer_entered(int peer, uint64_t seq) const {
    return peer == rank_ || seq <= 2 || progress(peer)->entered.load(std::memory_order_acquire) >= seq;
}

void LowLatencyProtocol::send_when_entered(uint64_t seq, const char* what, int64_t* wait_ns,
                                           const std::function<void(int)>& send) const {
    // Each peer gets its rows as soon as it entered this call, in whatever order the peers do: one that is late
    // (descheduled on an oversubscribed host, say) holds up only its own rows. With none ready, wait for the first.
    std::vector<int> pending = send_order(rank_, num_ranks_);
    while (!pending.empty()) {
        std::vector<int> later;
        for (int peer : pending) {
            if (peer_entered(peer, seq))
                send(peer);
            else
                later.push_back(peer);
        }
        if (!later.empty() && later.size() == pending.size()) wait_peer_entered(later.front(), seq, what, wait_ns);
        pending = std::move(later);
    }
}

void LowLatencyProtocol::publish(int receiver, uint64_t seq, const CallSignature& signature) const {
    Signal* signal = signal_of(receiver, seq, rank_);
    signal->call = signature;
    signal->seq.store(seq, std::memory_order_release);
}

std::string LowLatencyProtocol::wait_signals(uint64_t seq, const CallSignature& expected, const char* phase,
                                             int64_t* wait_ns) const {
    std::vector<int> sources(num_ranks_);
    for (int r = 0; r < num_ranks_; ++r) sources[r] = r;
    wait_for(
        sources, [&](int source) { return signal_of(rank_, seq, source)->seq.load(std::memory_order_acquire) == seq; },
        phase, seq, wait_ns);
    for (int source = 0; source < num_ranks_; ++source) {
        const CallSignature& theirs = signal_of(rank_, seq, source)->call;
        if (theirs != expected)
            return concat("mtdeepep: ranks disagree on low-latency op #", seq, " in phase '", phase, "': rank ", rank_,
                          " has ", describe(expected), " but rank ", source, " has ", describe(theirs),
                          "; kind 1 = dispatch, 2 = combine; flags: 1 FP8, 2 round_scale, 4 UE8M0; a combine carries "
                          "the dispatch of its handle: every rank must combine the same dispatch");
    }
    return {};
}

// ---------------------------------------------------------------------------------------------------------------
// Dispatch

std::shared_ptr<DispatchOp> LowLatencyProtocol::make_dispatch(const at::Tensor& x, const at::Tensor& topk_idx,
                                                              const OptTensor& cumulative_stats,
                                                              const OptTensor& wait_stats, int num_max_tokens,
                                                              int num_experts, bool use_fp8, bool round_scale,
                                                              bool use_ue8m0, bool hook_mode) {
    runtime_->check_usable();
    require(num_max_tokens > 0 && num_experts > 0 && num_experts % num_ranks_ == 0 &&
                num_experts / num_ranks_ <= shm::kMaxExperts,
            "invalid num_max_dispatch_tokens_per_rank=", num_max_tokens, " / num_experts=", num_experts);
    require(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1, "x must be bfloat16 [T, H] rows");
    require(topk_idx.dim() == 2 && topk_idx.scalar_type() == at::kLong && topk_idx.is_contiguous() &&
                topk_idx.size(0) == x.size(0),
            "topk_idx must be contiguous int64 [T, K]");
    require(x.size(0) <= num_max_tokens, "x has ", x.size(0),
            " tokens, more than num_max_dispatch_tokens_per_rank=", num_max_tokens);
    require(!use_fp8 || x.size(1) % kScaleBlock == 0, "FP8 dispatch needs hidden % 128 == 0");
    require(!(use_fp8 && use_ue8m0) || round_scale, "use_ue8m0 needs round_scale");
    check_topk_idx(topk_idx, num_experts);
    auto op = std::make_shared<DispatchOp>();
    op->layout = HalfLayout(num_max_tokens, static_cast<int>(x.size(1)), num_ranks_, num_experts);
    check_fits(op->layout);
    op->x = x;
    op->topk_idx = topk_idx;
    op->cumulative_stats = cumulative_stats;
    op->wait_stats = wait_stats;
    op->use_fp8 = use_fp8;
    op->round_scale = use_fp8 && round_scale;
    op->use_ue8m0 = use_fp8 && use_ue8m0;
    op->seq = begin_op(hook_mode);
    op->epoch = epoch_.load();
    op->uid = static_cast<int64_t>(runtime_->uid());

    const HalfLayout& l = op->layout;
    const int64_t e_local = l.num_local_experts, rt = l.rows_per_expert(), h = l.hidden;
    uint8_t* mine = half(rank_, op->seq);
    op->recv_x =
        runtime_->view(mine + l.recv_x, {e_local, rt, h}, {rt * h, h, 1}, use_fp8 ? at::kFloat8_e4m3fn : at::kBFloat16);
    if (use_fp8) {
        // Column-major per expert (the last two dimensions), as upstream returns them for TMA.
        const int64_t s = op->use_ue8m0 ? l.num_packed_scales : l.num_scales;
        op->recv_scales =
            runtime_->view(mine + l.scales, {e_local, rt, s}, {s * rt, 1, rt}, op->use_ue8m0 ? at::kInt : at::kFloat);
    }
    op->recv_count = at::empty({e_local}, at::kInt);
    op->src_info = at::empty({e_local, rt}, at::kInt);
    op->layout_range = at::empty({e_local, num_ranks_}, at::kLong);
    return op;
}

LowLatencyDispatchResult LowLatencyProtocol::dispatch(const at::Tensor& x, const at::Tensor& topk_idx,
                                                      const OptTensor& cumulative_stats, const OptTensor& wait_stats,
                                                      int num_max_dispatch_tokens_per_rank, int num_experts,
                                                      bool use_fp8, bool round_scale, bool use_ue8m0, bool async_finish,
                                                      bool return_recv_hook) {
    check_shared_memory_call(async_finish, return_recv_hook);
    auto op = make_dispatch(x, topk_idx, cumulative_stats, wait_stats, num_max_dispatch_tokens_per_rank, num_experts,
                            use_fp8, round_scale, use_ue8m0, return_recv_hook);
    auto [event, hook] = run(op, &LowLatencyProtocol::send_dispatch, &LowLatencyProtocol::receive_dispatch,
                             async_finish, return_recv_hook);
    return {op->recv_x,
            op->recv_scales,
            op->recv_count,
            op->src_info,
            op->layout_range,
            static_cast<int64_t>(op->seq),
            event,
            hook};
}

void LowLatencyProtocol::send_dispatch(DispatchOp& op) {
    enter(op.seq);
    const HalfLayout& l = op.layout;
    const Payload payload = prepare_payload(op);
    const CallSignature signature = op.signature();
    std::vector<RowCopy> rows;
    int64_t* wait_ns = op.wait_stats ? op.wait_stats->data_ptr<int64_t>() : nullptr;
    send_when_entered(op.seq, "low-latency dispatch: send", wait_ns, [&](int receiver) {
        uint8_t* dst = half(receiver, op.seq);
        std::atomic<uint32_t>* counters = counters_of(receiver, op.seq);
        auto* ranges = reinterpret_cast<int64_t*>(dst + l.layout_range);
        rows.clear();
        for (int e = 0; e < l.num_local_experts; ++e) {
            const int g = receiver * l.num_local_experts + e;
            const int32_t first = payload.expert_offsets[g];
            const int32_t count = payload.expert_offsets[g + 1] - first;
            // One reservation per (source, expert): this source's rows form one contiguous segment.
            const int64_t begin = count > 0 ? counters[e].fetch_add(count, std::memory_order_relaxed) : 0;
            if (begin + count > l.rows_per_expert())
                throw CommError(concat("mtdeepep: rank ", receiver, " expert ", e, " has ", begin + count,
                                       " rows reserved in op #", op.seq, ", more than its ", l.rows_per_expert(),
                                       " slots; the signalling state is stale: call clean_low_latency_buffer"));
            ranges[e * num_ranks_ + rank_] = pack_range(begin, count);
            for (int32_t i = 0; i < count; ++i) {
                const int32_t token = payload.tokens[first + i];
                rows.push_back({token, token, e, static_cast<int32_t>(begin + i)});
            }
        }
        const DispatchSlots slots{dst + l.recv_x, op.use_fp8 ? dst + l.scales : nullptr,
                                  reinterpret_cast<int32_t*>(dst + l.src_info), l.rows_per_expert()};
        write_dispatch_rows(payload.rows, rows.data(), rows.size(), slots);
        publish(receiver, op.seq, signature);
    });
}

void LowLatencyProtocol::receive_dispatch(DispatchOp& op) {
    const std::string mismatch = wait_signals(op.seq, op.signature(), "low-latency dispatch: receive",
                                              op.wait_stats ? op.wait_stats->data_ptr<int64_t>() : nullptr);
    finish_dispatch(op);  // also on a mismatch: every source is done with this half, so it can be reused
    if (!mismatch.empty()) throw GroupMismatch(mismatch);
}

void LowLatencyProtocol::finish_dispatch(DispatchOp& op) {
    const HalfLayout& l = op.layout;
    uint8_t* mine = half(rank_, op.seq);
    const auto* ranges = reinterpret_cast<const int64_t*>(mine + l.layout_range);
    std::memcpy(op.layout_range.data_ptr<int64_t>(), ranges, sizeof(int64_t) * l.num_local_experts * num_ranks_);
    std::memcpy(op.src_info.data_ptr<int32_t>(), mine + l.src_info,
                sizeof(int32_t) * l.num_local_experts * l.rows_per_expert());
    int32_t* counts = op.recv_count.data_ptr<int32_t>();
    std::atomic<uint32_t>* counters = counters_of(rank_, op.seq);
    for (int e = 0; e < l.num_local_experts; ++e) {
        int64_t total = 0;
        for (int s = 0; s < num_ranks_; ++s) total += range_count(ranges[e * num_ranks_ + s]);
        counts[e] = static_cast<int32_t>(total);
        counters[e].store(0, std::memory_order_relaxed);  // every sender of this op has reserved: reset for op + 2
    }
    if (op.cumulative_stats) {
        int32_t* stats = op.cumulative_stats->data_ptr<int32_t>();
        for (int e = 0; e < l.num_local_experts; ++e) stats[e] += counts[e];
    }
    end_receive(op.seq);
}

// ---------------------------------------------------------------------------------------------------------------
// Combine

std::shared_ptr<CombineOp> LowLatencyProtocol::make_combine(const at::Tensor& x, const at::Tensor& topk_idx,
                                                            const at::Tensor& topk_weights, const at::Tensor& src_info,
                                                            const at::Tensor& layout_range, const OptTensor& wait_stats,
                                                            int num_max_tokens, int num_experts, int64_t dispatch_uid,
                                                            int64_t dispatch_seq, bool zero_copy, const OptTensor& out,
                                                            bool hook_mode) {
    runtime_->check_usable();
    require(num_max_tokens > 0 && num_experts > 0 && num_experts % num_ranks_ == 0,
            "invalid num_max_dispatch_tokens_per_rank=", num_max_tokens, " / num_experts=", num_experts);
    require(x.dim() == 3, "x must be 3-D");
    auto op = std::make_shared<CombineOp>();
    op->layout = HalfLayout(num_max_tokens, static_cast<int>(x.size(2)), num_ranks_, num_experts);
    const HalfLayout& l = op->layout;
    const int64_t e_local = l.num_local_experts, rt = l.rows_per_expert();
    require(x.scalar_type() == at::kBFloat16 && x.size(0) == e_local && x.size(1) == rt && x.is_contiguous(),
            "x must be contiguous bfloat16 [num_local_experts, num_ranks * num_max_dispatch_tokens_per_rank, hidden]");
    require(topk_idx.dim() == 2 && topk_idx.scalar_type() == at::kLong && topk_idx.is_contiguous() &&
                topk_idx.size(0) <= num_max_tokens,
            "topk_idx must be contiguous int64 [T, K] with T <= num_max_dispatch_tokens_per_rank");
    require(topk_weights.sizes() == topk_idx.sizes() && topk_weights.scalar_type() == at::kFloat &&
                topk_weights.is_contiguous(),
            "topk_weights must be contiguous float32 shaped like topk_idx");
    check_topk_idx(topk_idx, num_experts);
    require(src_info.sizes() == at::IntArrayRef({e_local, rt}) && src_info.scalar_type() == at::kInt &&
                src_info.is_contiguous() && layout_range.sizes() == at::IntArrayRef({e_local, num_ranks_}) &&
                layout_range.scalar_type() == at::kLong && layout_range.is_contiguous(),
            "the handle's src_info / layout_range do not match this call's shapes");
    check_fits(l);
    // Every row the handle names must lie inside its expert and point at a token slot of its source.
    const int64_t* ranges = layout_range.data_ptr<int64_t>();
    const int32_t* sources = src_info.data_ptr<int32_t>();
    for (int64_t e = 0; e < e_local; ++e)
        for (int s = 0; s < num_ranks_; ++s) {
            const int64_t begin = range_begin(ranges[e * num_ranks_ + s]),
                          count = range_count(ranges[e * num_ranks_ + s]);
            require(begin >= 0 && begin + count <= rt, "handle: layout_range[", e, ", ", s, "] is out of range");
            for (int64_t i = begin; i < begin + count; ++i)
                require(sources[e * rt + i] >= 0 && sources[e * rt + i] < num_max_tokens, "handle: src_info[", e, ", ",
                        i, "] = ", sources[e * rt + i], " is not a token index");
        }
    const int64_t num_tokens = topk_idx.size(0);
    if (out) {
        require(out->dim() == 2 && out->size(0) == num_tokens && out->size(1) == l.hidden &&
                    out->scalar_type() == at::kBFloat16 && out->is_contiguous(),
                "out must be contiguous bfloat16 [T, hidden]");
        op->combined = *out;
    } else {
        op->combined = at::empty({num_tokens, l.hidden}, at::kBFloat16);
    }
    op->x = x;
    if (zero_copy) {
        const at::Tensor& area = combine_send_[zero_copy_combines_ & 1];
        require(area.defined() && area.sizes() == x.sizes(),
                "zero_copy needs the expert outputs in get_next_low_latency_combine_buffer(handle) first");
        op->x = area;
    }
    op->topk_idx = topk_idx;
    op->topk_weights = topk_weights;
    op->src_info = src_info;
    op->layout_range = layout_range;
    op->wait_stats = wait_stats;
    op->dispatch_uid = dispatch_uid;
    op->dispatch_seq = dispatch_seq;
    op->seq = begin_op(hook_mode);
    op->epoch = epoch_.load();
    if (zero_copy) ++zero_copy_combines_;  // the next zero-copy combine fills the other area
    return op;
}

LowLatencyCombineResult LowLatencyProtocol::combine(const at::Tensor& x, const at::Tensor& topk_idx,
                                                    const at::Tensor& topk_weights, const at::Tensor& src_info,
                                                    const at::Tensor& layout_range, const OptTensor& wait_stats,
                                                    int num_max_dispatch_tokens_per_rank, int num_experts,
                                                    int64_t dispatch_uid, int64_t dispatch_seq, bool zero_copy,
                                                    bool async_finish, bool return_recv_hook, const OptTensor& out) {
    check_shared_memory_call(async_finish, return_recv_hook);
    auto op =
        make_combine(x, topk_idx, topk_weights, src_info, layout_range, wait_stats, num_max_dispatch_tokens_per_rank,
                     num_experts, dispatch_uid, dispatch_seq, zero_copy, out, return_recv_hook);
    auto [event, hook] = run(op, &LowLatencyProtocol::send_combine, &LowLatencyProtocol::receive_combine, async_finish,
                             return_recv_hook);
    return {op->combined, event, hook};
}

// The rows this rank sends back to `source` (expert side): rows of x and where they go in the source's
// combine_recv [E, T, H].
void LowLatencyProtocol::combine_rows(const CombineOp& op, int source, std::vector<int64_t>& src_rows,
                                      std::vector<int64_t>& dst_rows) const {
    const HalfLayout& l = op.layout;
    const int64_t rt = l.rows_per_expert();
    const int64_t* ranges = op.layout_range.data_ptr<int64_t>();
    const int32_t* tokens = op.src_info.data_ptr<int32_t>();
    src_rows.clear();
    dst_rows.clear();
    for (int e = 0; e < l.num_local_experts; ++e) {
        const int64_t range = ranges[e * num_ranks_ + source];
        const int64_t global_expert = static_cast<int64_t>(rank_) * l.num_local_experts + e;
        for (int64_t i = range_begin(range); i < range_begin(range) + range_count(range); ++i) {
            src_rows.push_back(e * rt + i);
            dst_rows.push_back(global_expert * l.num_max_tokens + tokens[e * rt + i]);
        }
    }
}

void LowLatencyProtocol::send_combine(CombineOp& op) {
    enter(op.seq);
    const HalfLayout& l = op.layout;
    const size_t row_bytes = sizeof(uint16_t) * l.hidden;
    const auto* x = static_cast<const uint8_t*>(op.x.data_ptr());
    const CallSignature signature = op.signature();
    std::vector<int64_t> src_rows, dst_rows;
    int64_t* wait_ns = op.wait_stats ? op.wait_stats->data_ptr<int64_t>() : nullptr;
    send_when_entered(op.seq, "low-latency combine: send", wait_ns, [&](int source) {
        combine_rows(op, source, src_rows, dst_rows);
        copy_rows(x, row_bytes, src_rows.data(), half(source, op.seq) + l.combine_recv, row_bytes, dst_rows.data(),
                  src_rows.size(), row_bytes);
        publish(source, op.seq, signature);
    });
}

void LowLatencyProtocol::receive_combine(CombineOp& op) {
    const std::string mismatch = wait_signals(op.seq, op.signature(), "low-latency combine: receive",
                                              op.wait_stats ? op.wait_stats->data_ptr<int64_t>() : nullptr);
    finish_combine(op);
    if (!mismatch.empty()) throw GroupMismatch(mismatch);
}

void LowLatencyProtocol::finish_combine(CombineOp& op) {
    const HalfLayout& l = op.layout;
    const auto* rows = reinterpret_cast<const uint16_t*>(half(rank_, op.seq) + l.combine_recv);
    weighted_combine(op.topk_idx.data_ptr<int64_t>(), op.topk_weights.data_ptr<float>(),
                     static_cast<int>(op.topk_idx.size(0)), static_cast<int>(op.topk_idx.size(1)), l.hidden, rows,
                     l.num_max_tokens, reinterpret_cast<uint16_t*>(op.combined.data_ptr()));
    end_receive(op.seq);
}

// ---------------------------------------------------------------------------------------------------------------
// Collective transport

template <typename Op>
std::shared_ptr<Op> LowLatencyProtocol::take_pending(std::map<int64_t, std::shared_ptr<Op>>& pending, int64_t op_number,
                                                     const char* what) {
    std::shared_ptr<Op> op;
    {
        std::lock_guard<std::mutex> lock(collective_mutex_);
        auto it = pending.find(op_number);
        require(it != pending.end(), "no pending collective ", what, " #", op_number);
        op = it->second;
        pending.erase(it);
    }
    runtime_->check_usable();
    return op;
}

void LowLatencyProtocol::check_collective_signatures(uint64_t seq, const CallSignature& expected,
                                                     const at::Tensor& info, const char* what) {
    for (int source = 0; source < num_ranks_; ++source) {
        const CallSignature theirs = read_info_row(info.data_ptr<int64_t>() + source * kCollectiveInfoColumns);
        if (theirs == expected) continue;
        end_receive(seq);  // nothing was unpacked; the half is free again
        throw GroupMismatch(concat("mtdeepep: ranks disagree on low-latency op #", seq, " (collective ", what,
                                   "): rank ", rank_, " has ", describe(expected), " but rank ", source, " has ",
                                   describe(theirs),
                                   "; flags: 1 FP8, 2 round_scale, 4 UE8M0; a combine carries the dispatch of its "
                                   "handle: every rank must combine the same dispatch"));
    }
}

CollectiveDispatchSend LowLatencyProtocol::collective_dispatch_send(const at::Tensor& x, const at::Tensor& topk_idx,
                                                                    int num_max_dispatch_tokens_per_rank,
                                                                    int num_experts, bool use_fp8, bool round_scale,
                                                                    bool use_ue8m0) {
    auto op = make_dispatch(x, topk_idx, std::nullopt, std::nullopt, num_max_dispatch_tokens_per_rank, num_experts,
                            use_fp8, round_scale, use_ue8m0, /*hook_mode=*/true);
    const HalfLayout& l = op->layout;
    const Payload payload = prepare_payload(*op);
    op->message_bytes = dispatch_message_bytes(payload.rows.row_bytes, op->use_fp8 ? l.num_scales : 0);
    // Messages grouped by destination rank, then by its local expert, tokens ascending.
    // Per destination: the message bytes, then this call's signature, which the receiver checks.
    std::vector<RowCopy> rows;
    const CallSignature signature = op->signature();
    auto info = at::empty({num_ranks_, kCollectiveInfoColumns}, at::kLong);
    for (int receiver = 0; receiver < num_ranks_; ++receiver) {
        const size_t before = rows.size();
        for (int e = 0; e < l.num_local_experts; ++e) {
            const int g = receiver * l.num_local_experts + e;
            for (int32_t i = payload.expert_offsets[g]; i < payload.expert_offsets[g + 1]; ++i)
                rows.push_back({payload.tokens[i], payload.tokens[i], e, 0});
        }
        write_info_row(info.data_ptr<int64_t>() + receiver * kCollectiveInfoColumns,
                       static_cast<int64_t>((rows.size() - before) * op->message_bytes), signature);
    }
    auto messages = at::empty({static_cast<int64_t>(rows.size() * op->message_bytes)}, at::kByte);
    pack_dispatch_messages(payload.rows, rows.data(), rows.size(), messages.data_ptr<uint8_t>(), op->message_bytes);
    {
        std::lock_guard<std::mutex> lock(collective_mutex_);
        collective_dispatches_[static_cast<int64_t>(op->seq)] = op;
    }
    return {static_cast<int64_t>(op->seq),
            messages,
            info,
            op->recv_x,
            op->recv_scales,
            op->recv_count,
            op->src_info,
            op->layout_range};
}

void LowLatencyProtocol::collective_dispatch_recv(int64_t op_number, const at::Tensor& messages, const at::Tensor& info,
                                                  const OptTensor& cumulative_stats) {
    auto op = take_pending(collective_dispatches_, op_number, "dispatch");
    check_collective_signatures(op->seq, op->signature(), info, "dispatch");
    const HalfLayout& l = op->layout;
    const uint8_t* data = messages.data_ptr<uint8_t>();
    uint8_t* mine = half(rank_, op->seq);
    auto* ranges = reinterpret_cast<int64_t*>(mine + l.layout_range);
    // Sources in rank order: source s's rows for expert e follow those of sources < s (deterministic layout).
    std::vector<int64_t> next_slot(l.num_local_experts, 0);
    std::vector<RowCopy> rows;
    int64_t message = 0;
    for (int source = 0; source < num_ranks_; ++source) {
        const int64_t num_messages =
            info.data_ptr<int64_t>()[source * kCollectiveInfoColumns] / static_cast<int64_t>(op->message_bytes);
        std::vector<int64_t> begin(next_slot);
        for (int64_t i = 0; i < num_messages; ++i, ++message) {
            MessageHeader header;
            std::memcpy(&header, data + message * op->message_bytes, sizeof(header));
            if (header.expert < 0 || header.expert >= l.num_local_experts || header.token < 0 ||
                header.token >= l.num_max_tokens || next_slot[header.expert] >= l.rows_per_expert())
                throw CommError(concat("mtdeepep: rank ", rank_, " received a malformed low-latency dispatch message",
                                       " from rank ", source, " (token ", header.token, ", expert ", header.expert,
                                       "); ranks disagree on the call?"));
            rows.push_back({static_cast<int32_t>(message), header.token, header.expert,
                            static_cast<int32_t>(next_slot[header.expert]++)});
        }
        for (int e = 0; e < l.num_local_experts; ++e)
            ranges[e * num_ranks_ + source] = pack_range(begin[e], next_slot[e] - begin[e]);
    }
    const DispatchPayload payload{
        data + sizeof(MessageHeader),
        static_cast<int64_t>(op->message_bytes),
        op->use_fp8 ? static_cast<size_t>(l.hidden) : sizeof(uint16_t) * l.hidden,
        op->use_fp8 ? reinterpret_cast<const float*>(data + sizeof(MessageHeader) + l.hidden) : nullptr,
        static_cast<int64_t>(op->message_bytes / sizeof(float)),
        op->use_fp8 ? l.num_scales : 0,
        op->use_ue8m0};
    const DispatchSlots slots{mine + l.recv_x, op->use_fp8 ? mine + l.scales : nullptr,
                              reinterpret_cast<int32_t*>(mine + l.src_info), l.rows_per_expert()};
    write_dispatch_rows(payload, rows.data(), rows.size(), slots);
    op->cumulative_stats = cumulative_stats;
    finish_dispatch(*op);
}

CollectiveCombineSend LowLatencyProtocol::collective_combine_send(
    const at::Tensor& x, const at::Tensor& topk_idx, const at::Tensor& topk_weights, const at::Tensor& src_info,
    const at::Tensor& layout_range, int num_max_dispatch_tokens_per_rank, int num_experts, int64_t dispatch_uid,
    int64_t dispatch_seq, bool zero_copy, const OptTensor& out) {
    auto op = make_combine(x, topk_idx, topk_weights, src_info, layout_range, std::nullopt,
                           num_max_dispatch_tokens_per_rank, num_experts, dispatch_uid, dispatch_seq, zero_copy, out,
                           /*hook_mode=*/true);
    const HalfLayout& l = op->layout;
    const size_t row_bytes = sizeof(uint16_t) * l.hidden;
    op->message_bytes = combine_message_bytes(l.hidden);
    const CallSignature signature = op->signature();
    std::vector<int64_t> src_rows, dst_rows, all_src_rows;
    std::vector<MessageHeader> headers;
    auto info = at::empty({num_ranks_, kCollectiveInfoColumns}, at::kLong);
    for (int source = 0; source < num_ranks_; ++source) {
        combine_rows(*op, source, src_rows, dst_rows);
        for (size_t i = 0; i < src_rows.size(); ++i) {
            all_src_rows.push_back(src_rows[i]);
            headers.push_back({static_cast<int32_t>(dst_rows[i] % l.num_max_tokens),
                               static_cast<int32_t>(dst_rows[i] / l.num_max_tokens)});
        }
        write_info_row(info.data_ptr<int64_t>() + source * kCollectiveInfoColumns,
                       static_cast<int64_t>(src_rows.size() * op->message_bytes), signature);
    }
    auto messages = at::empty({static_cast<int64_t>(headers.size() * op->message_bytes)}, at::kByte);
    uint8_t* data = messages.data_ptr<uint8_t>();
    for (size_t i = 0; i < headers.size(); ++i)
        std::memcpy(data + i * op->message_bytes, &headers[i], sizeof(MessageHeader));
    copy_rows(static_cast<const uint8_t*>(op->x.data_ptr()), row_bytes, all_src_rows.data(),
              data + sizeof(MessageHeader), op->message_bytes, nullptr, headers.size(), row_bytes);
    // This rank receives one row per valid (token, slot) from the slot's expert owner.
    auto bytes_per_source = at::zeros({num_ranks_}, at::kLong);
    const int64_t* idx = topk_idx.data_ptr<int64_t>();
    for (int64_t i = 0; i < topk_idx.numel(); ++i)
        if (idx[i] >= 0) bytes_per_source.data_ptr<int64_t>()[idx[i] / l.num_local_experts] += op->message_bytes;
    {
        std::lock_guard<std::mutex> lock(collective_mutex_);
        collective_combines_[static_cast<int64_t>(op->seq)] = op;
    }
    return {static_cast<int64_t>(op->seq), messages, info, bytes_per_source, op->combined};
}

void LowLatencyProtocol::collective_combine_recv(int64_t op_number, const at::Tensor& messages,
                                                 const at::Tensor& info) {
    auto op = take_pending(collective_combines_, op_number, "combine");
    check_collective_signatures(op->seq, op->signature(), info, "combine");
    const HalfLayout& l = op->layout;
    const size_t row_bytes = sizeof(uint16_t) * l.hidden;
    const uint8_t* data = messages.data_ptr<uint8_t>();
    const int64_t num_messages = messages.numel() / static_cast<int64_t>(op->message_bytes);
    std::vector<int64_t> dst_rows(num_messages);
    for (int64_t i = 0; i < num_messages; ++i) {
        MessageHeader header;
        std::memcpy(&header, data + i * op->message_bytes, sizeof(header));
        if (header.expert < 0 || header.expert >= l.num_experts || header.token < 0 || header.token >= l.num_max_tokens)
            throw CommError(concat("mtdeepep: rank ", rank_, " received a malformed low-latency combine message",
                                   " (token ", header.token, ", expert ", header.expert,
                                   "); ranks disagree on the call?"));
        dst_rows[i] = static_cast<int64_t>(header.expert) * l.num_max_tokens + header.token;
    }
    copy_rows(data + sizeof(MessageHeader), op->message_bytes, nullptr, half(rank_, op->seq) + l.combine_recv,
              row_bytes, dst_rows.data(), num_messages, row_bytes);
    finish_combine(*op);
}

// ---------------------------------------------------------------------------------------------------------------
// Zero-copy area and clean

at::Tensor LowLatencyProtocol::next_combine_buffer(int num_max_dispatch_tokens_per_rank, int hidden, int num_experts) {
    runtime_->check_usable();
    require(num_max_dispatch_tokens_per_rank > 0 && hidden > 0 && num_experts > 0 && num_experts % num_ranks_ == 0,
            "invalid handle values");
    const std::vector<int64_t> sizes{num_experts / num_ranks_,
                                     static_cast<int64_t>(num_ranks_) * num_max_dispatch_tokens_per_rank, hidden};
    at::Tensor& area = combine_send_[zero_copy_combines_ & 1];
    if (!area.defined() || area.sizes() != at::IntArrayRef(sizes)) area = at::zeros(sizes, at::kBFloat16);
    return area;
}

void LowLatencyProtocol::clean(int num_max_dispatch_tokens_per_rank, int hidden, int num_experts) {
    runtime_->check_usable();
    const HalfLayout layout(num_max_dispatch_tokens_per_rank, hidden, num_ranks_, num_experts);
    check_fits(layout);
    if (runtime_->has_queued_work()) runtime_->launch(false, [] {});  // finish this rank's queued calls
    if (shared_memory_) runtime_->peers().barrier("low-latency clean: every rank stopped sending");
    uint8_t* mine = area(rank_);
    std::memset(mine, 0, control_.bytes);  // progress, signals, counters
    for (uint64_t h = 0; h < 2; ++h)
        std::memset(half(rank_, h) + layout.layout_range, 0, sizeof(int64_t) * layout.num_local_experts * num_ranks_);
    {
        std::lock_guard<std::mutex> lock(collective_mutex_);
        collective_dispatches_.clear();
        collective_combines_.clear();
    }
    seq_ = 0;
    ++epoch_;
    hook_pending_[0].store(false);
    hook_pending_[1].store(false);
    if (shared_memory_) runtime_->peers().barrier("low-latency clean: every rank zeroed its state");
}

}  // namespace mtdeepep::cpu
