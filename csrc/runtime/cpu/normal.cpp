#include "runtime/cpu/normal.hpp"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

#include "common/exception.hpp"
#include "kernels/cpu/api.hpp"

namespace mtdeepep::cpu {

namespace {

constexpr size_t kFieldAlignment = 64;
constexpr size_t kMaxCachedHostBytes = size_t(2) << 30;  // freed outputs kept for reuse, per buffer

size_t align_up(size_t value, size_t alignment) {
    return (value + alignment - 1) / alignment * alignment;
}

int64_t ceil_div(int64_t a, int64_t b) {
    return (a + b - 1) / b;
}

enum OpKind : int32_t { kDispatchOp = 1, kCachedDispatchOp = 2, kCombineOp = 3 };

// What one dispatched or combined row carries besides its hidden bytes.
struct RowFormat {
    size_t x_bytes = 0, scale_bytes = 0;
    int num_topk = 0;
    bool with_topk = false, with_weights = false, with_src = false;

    size_t row_bytes() const {
        return x_bytes + scale_bytes + (with_topk ? num_topk * sizeof(int64_t) : 0) +
               (with_weights ? num_topk * sizeof(float) : 0) + (with_src ? sizeof(int32_t) : 0);
    }
    // The smallest block that holds one row with every field aligned.
    size_t min_block_bytes() const { return 5 * kFieldAlignment + row_bytes(); }
};

// Room a held dispatch output keeps free to stage its combine: rows of `hidden` float32 values (the widest a combine's
// x is) with `num_topk` weights; its outputs stay held until after that combine.
size_t combine_headroom(int64_t hidden, int num_topk) {
    RowFormat combine_row;
    combine_row.x_bytes = static_cast<size_t>(hidden) * sizeof(float);
    combine_row.num_topk = std::max(num_topk, 1);
    combine_row.with_weights = true;
    return combine_row.min_block_bytes();
}

// Struct-of-arrays placement of `capacity` rows inside a block; every rank computes the same one.
struct RegionLayout {
    size_t capacity = 0;
    size_t total_bytes = 0;
    size_t x_offset = 0, scale_offset = 0, idx_offset = 0, weight_offset = 0, src_offset = 0;
    RowFormat format;

    static RegionLayout for_rows(const RowFormat& format, size_t rows) {
        RegionLayout layout;
        layout.format = format;
        layout.capacity = rows;
        size_t offset = 0;
        auto place = [&](size_t& field, size_t bytes_per_row, bool used) {
            field = offset;
            if (used) offset = align_up(offset + rows * bytes_per_row, kFieldAlignment);
        };
        place(layout.x_offset, format.x_bytes, true);
        place(layout.scale_offset, format.scale_bytes, format.scale_bytes > 0);
        place(layout.idx_offset, format.num_topk * sizeof(int64_t), format.with_topk);
        place(layout.weight_offset, format.num_topk * sizeof(float), format.with_weights);
        place(layout.src_offset, sizeof(int32_t), format.with_src);
        layout.total_bytes = offset;
        return layout;
    }

    // As many rows as fit in `block_bytes` (a staging area for rounds).
    static RegionLayout fitting(const RowFormat& format, size_t block_bytes) {
        const size_t slack = 5 * kFieldAlignment;
        return for_rows(format, block_bytes > slack ? (block_bytes - slack) / format.row_bytes() : 0);
    }

    RowArrays arrays(uint8_t* base) const {
        return {base + x_offset, format.scale_bytes > 0 ? base + scale_offset : nullptr,
                format.with_topk ? reinterpret_cast<int64_t*>(base + idx_offset) : nullptr,
                format.with_weights ? reinterpret_cast<float*>(base + weight_offset) : nullptr,
                format.with_src ? reinterpret_cast<int32_t*>(base + src_offset) : nullptr};
    }
};

// Gives a reservation's unused part back to the arena when the operation ends, however it ends.
struct ReservationGuard {
    RegionArena& arena;
    RegionArena::Block block;
    size_t keep = 0;
    ~ReservationGuard() { arena.release(block, keep); }
};

}  // namespace

// counts[i][j]: tokens rank i sends to rank j. Every rank derives the same plan from it.
struct TrafficMatrix {
    int num_ranks;
    std::vector<int64_t> counts;

    int64_t at(int i, int j) const { return counts[static_cast<size_t>(i) * num_ranks + j]; }
    // Rows of receiver j that come from sources before i (j's recv_x segment of source i starts here).
    int64_t recv_offset(int i, int j) const {
        int64_t sum = 0;
        for (int s = 0; s < i; ++s) sum += at(s, j);
        return sum;
    }
    int64_t total_received(int j) const { return recv_offset(num_ranks, j); }
    // Where source i's rows start among the rows receiver j gets from *other* ranks (the region's order).
    int64_t remote_offset(int i, int j) const {
        int64_t sum = 0;
        for (int s = 0; s < i; ++s)
            if (s != j) sum += at(s, j);
        return sum;
    }
    int64_t remote_received(int j) const { return total_received(j) - at(j, j); }

    static TrafficMatrix from_prefix(const at::Tensor& rank_prefix_matrix) {
        TrafficMatrix m{static_cast<int>(rank_prefix_matrix.size(0)), {}};
        auto prefix = rank_prefix_matrix.accessor<int32_t, 2>();
        m.counts.resize(static_cast<size_t>(m.num_ranks) * m.num_ranks);
        for (int i = 0; i < m.num_ranks; ++i)
            for (int j = 0; j < m.num_ranks; ++j)
                m.counts[i * m.num_ranks + j] = prefix[i][j] - (i > 0 ? prefix[i - 1][j] : 0);
        return m;
    }
};

namespace {

// The rows [lo, hi) of a round that fall inside a sender's block [begin, begin + count).
struct Overlap {
    int64_t begin, end;
    bool empty() const { return end <= begin; }
};
Overlap overlap(int64_t block_begin, int64_t block_count, int64_t lo, int64_t hi) {
    return {std::max(block_begin, lo), std::min(block_begin + block_count, hi)};
}

FloatKind float_kind(at::ScalarType dtype) {
    switch (dtype) {
        case at::kBFloat16:
            return FloatKind::kBFloat16;
        case at::kHalf:
            return FloatKind::kFloat16;
        case at::kFloat:
            return FloatKind::kFloat32;
        default:
            throw std::invalid_argument("mtdeepep: combine supports bfloat16, float16 and float32");
    }
}

}  // namespace

// Identity and handle checks

namespace {

// FNV-1a over the traffic matrix, folded to 31 bits: ranks compare it to make sure they combine the same dispatch.
int32_t traffic_checksum(const at::Tensor& rank_prefix_matrix) {
    const auto* data = rank_prefix_matrix.data_ptr<int32_t>();
    uint64_t hash = 1469598103934665603ull;
    for (int64_t i = 0; i < rank_prefix_matrix.numel(); ++i) {
        hash ^= static_cast<uint32_t>(data[i]);
        hash *= 1099511628211ull;
    }
    return static_cast<int32_t>((hash ^ (hash >> 32)) & 0x7fffffff);
}

void push_int64(std::vector<int32_t>& signature, int64_t value) {
    signature.push_back(static_cast<int32_t>(value & 0xffffffff));
    signature.push_back(static_cast<int32_t>(static_cast<uint64_t>(value) >> 32));
}

template <typename... Parts>
void require(bool condition, const Parts&... message) {
    if (!condition) throw std::invalid_argument(concat("mtdeepep: ", message...));
}

// A handle's rank prefix matrix [R, R] int32: inclusive prefix sums over sources, so every column is non-decreasing
// from 0; returns the traffic matrix it encodes.
TrafficMatrix checked_traffic(const at::Tensor& rank_prefix_matrix, int num_ranks) {
    require(rank_prefix_matrix.dim() == 2 && rank_prefix_matrix.size(0) == num_ranks &&
                rank_prefix_matrix.size(1) == num_ranks && rank_prefix_matrix.scalar_type() == at::kInt &&
                rank_prefix_matrix.is_contiguous(),
            "the handle's rank_prefix_matrix must be a contiguous int32 [", num_ranks, ", ", num_ranks, "] tensor");
    const TrafficMatrix traffic = TrafficMatrix::from_prefix(rank_prefix_matrix);
    for (int64_t count : traffic.counts)
        require(count >= 0, "the handle's rank_prefix_matrix is not a prefix sum over source ranks (was it modified?)");
    return traffic;
}

// A handle's send_head [T, R] int32: for every destination rank j, the positions of the tokens sent to j, each of
// 0 .. sent(j) - 1 exactly once, -1 for tokens not sent there.
void check_send_head(const at::Tensor& send_head, const TrafficMatrix& traffic, int rank, int64_t num_tokens) {
    const int num_ranks = traffic.num_ranks;
    require(send_head.dim() == 2 && send_head.size(0) == num_tokens && send_head.size(1) == num_ranks &&
                send_head.scalar_type() == at::kInt && send_head.is_contiguous(),
            "the handle's send_head must be a contiguous int32 [", num_tokens, ", ", num_ranks, "] tensor");
    const int32_t* head = send_head.data_ptr<int32_t>();
    for (int j = 0; j < num_ranks; ++j) {
        const int64_t sent = traffic.at(rank, j);
        std::vector<bool> seen(static_cast<size_t>(sent), false);
        int64_t found = 0;
        for (int64_t t = 0; t < num_tokens; ++t) {
            const int32_t position = head[t * num_ranks + j];
            if (position < 0) continue;
            require(position < sent && !seen[position], "the handle's send_head does not match its rank_prefix_matrix",
                    " (token ", t, " -> rank ", j, "; was the handle modified?)");
            seen[position] = true;
            ++found;
        }
        require(found == sent, "the handle's send_head sends ", found, " tokens to rank ", j,
                " but its rank_prefix_matrix says ", sent, " (was the handle modified?)");
    }
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------------
// Set-up

NormalProtocol::NormalProtocol(RuntimePtr runtime)
    : runtime_(std::move(runtime)),
      rank_(runtime_->rank()),
      num_ranks_(runtime_->num_ranks()),
      arena_(std::make_shared<RegionArena>(static_cast<size_t>(runtime_->num_nvl_bytes()), runtime_->own_mapping())),
      pool_(std::make_shared<HostPool>(kMaxCachedHostBytes)) {}

void NormalProtocol::exchange_signature(const std::vector<int32_t>& signature, const char* phase) {
    MTDEEPEP_HOST_ASSERT(signature.size() <= static_cast<size_t>(shm::kOpSignatureInts));
    int32_t* mine = mailbox(rank_, runtime_->mailbox_layout().signature_offset);
    std::fill(mine, mine + shm::kOpSignatureInts, 0);
    std::copy(signature.begin(), signature.end(), mine);
    runtime_->peers().barrier(phase);
    for (int r = 0; r < num_ranks_; ++r) {
        const int32_t* theirs = mailbox(r, runtime_->mailbox_layout().signature_offset);
        if (!std::equal(signature.begin(), signature.end(), theirs)) {
            std::string a, b;
            for (size_t i = 0; i < signature.size(); ++i) {
                a += concat(i ? "," : "", signature[i]);
                b += concat(i ? "," : "", theirs[i]);
            }
            const bool same_call = std::equal(signature.begin(), signature.begin() + 7, theirs);
            throw GroupMismatch(concat(
                "mtdeepep: ranks disagree on the operation in phase '", phase, "': rank ", rank_, " has (", a,
                ") but rank ", r, " has (", b,
                ") [kind, row bytes, scale bytes, top-k, weights, experts, worst tokens, ",
                "dispatch uid (2), dispatch seq (2), traffic checksum]",
                same_call
                    ? "; the ranks passed handles of different dispatches (e.g. interleaved micro-batches): every "
                      "rank must combine (or re-dispatch) the same dispatch"
                    : ""));
        }
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Layout

LayoutResult NormalProtocol::get_dispatch_layout(const at::Tensor& topk_idx, int num_experts,
                                                 const EventPtr& previous_event, bool async_finish) {
    const int num_tokens = static_cast<int>(topk_idx.size(0));
    const int num_topk = static_cast<int>(topk_idx.size(1));
    auto num_tokens_per_rank = at::empty({num_ranks_}, at::kInt);
    auto num_tokens_per_expert = at::empty({num_experts}, at::kInt);
    auto is_token_in_rank = at::empty({num_tokens, num_ranks_}, at::kBool);
    const int num_ranks = num_ranks_;
    auto event = runtime_->submit(previous_event, [=]() mutable {
        cpu::get_dispatch_layout(topk_idx.data_ptr<int64_t>(), num_tokens, num_topk, num_ranks, num_experts,
                                 num_tokens_per_rank.data_ptr<int32_t>(), num_tokens_per_expert.data_ptr<int32_t>(),
                                 is_token_in_rank.data_ptr<bool>());
    });
    if (!async_finish) event->wait();
    return {num_tokens_per_rank, std::nullopt, num_tokens_per_expert, is_token_in_rank, event};
}

// ---------------------------------------------------------------------------------------------------------------
// Dispatch

struct NormalProtocol::DispatchArgs {
    at::Tensor x;
    OptTensor x_scales, topk_idx, topk_weights, num_tokens_per_expert;
    at::Tensor routing;  // is_token_in_rank [T, R] bool, or in cached mode the handle's send_head [T, R] int32
    OptTensor cached_rank_prefix_matrix;
    DispatchId id;
    int32_t checksum = 0;
    int expert_alignment, num_worst_tokens, num_channels;
    OptTensor out_x, out_scales;  // placed outputs (cached mode), views of this rank's region
    // Outputs, published through `allocated` before the data moves.
    at::Tensor recv_x, send_head, rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx;
    OptTensor recv_x_scales, recv_topk_idx, recv_topk_weights;
    std::vector<int> num_recv_tokens_per_expert;
    EventPtr allocated;
};

DispatchResult NormalProtocol::dispatch(const at::Tensor& x, const OptTensor& x_scales, const OptTensor& topk_idx,
                                        const OptTensor& topk_weights, const at::Tensor& routing,
                                        const OptTensor& num_tokens_per_expert,
                                        const OptTensor& cached_rank_prefix_matrix, int64_t cached_uid,
                                        int64_t cached_seq, int expert_alignment, int num_worst_tokens,
                                        int num_channels, const EventPtr& previous_event, bool async_finish,
                                        const OptTensor& out_x, const OptTensor& out_scales) {
    runtime_->check_usable();
    auto args = std::make_shared<DispatchArgs>();
    require(cached_rank_prefix_matrix || !(out_x || out_scales), "placed outputs need a cached dispatch");
    if (cached_rank_prefix_matrix) {
        // Cached mode routes by the handle's send_head (passed as `routing`), checked against its traffic matrix.
        const TrafficMatrix traffic = checked_traffic(*cached_rank_prefix_matrix, num_ranks_);
        check_send_head(routing, traffic, rank_, x.size(0));
        args->id = {cached_uid, cached_seq};
        args->checksum = traffic_checksum(*cached_rank_prefix_matrix);
        if (out_x || out_scales) {
            // Peers will write these rows without further checks: they must fit, and lie in this rank's region.
            require(out_x && out_scales.has_value() == x_scales.has_value(),
                    "placed outputs need out_x, and out_scales exactly when x_scales is given");
            const int64_t rows = num_worst_tokens > 0 ? num_worst_tokens : traffic.total_received(rank_);
            check_placed(*out_x, x, rows, "out_x");
            if (out_scales) check_placed(*out_scales, *x_scales, rows, "out_scales");
            args->out_x = out_x;
            args->out_scales = out_scales;
        }
    } else {
        args->id = {static_cast<int64_t>(runtime_->uid()), ++dispatches_};
    }
    args->x = x;
    args->x_scales = x_scales;
    args->topk_idx = topk_idx;
    args->topk_weights = topk_weights;
    args->num_tokens_per_expert = num_tokens_per_expert;
    args->routing = routing;
    args->cached_rank_prefix_matrix = cached_rank_prefix_matrix;
    args->expert_alignment = expert_alignment;
    args->num_worst_tokens = num_worst_tokens;
    args->num_channels = std::clamp(num_channels, 1, shm::kMaxChannels);
    args->allocated = runtime_->new_event();
    auto self = shared_from_this();
    auto event = runtime_->submit(previous_event, [self, args] {
        try {
            self->run_dispatch(*args);
        } catch (...) {
            // Before the outputs were published the caller learns of the error there; after, through the event.
            if (!args->allocated->query()) args->allocated->complete(std::current_exception());
            throw;
        }
    });
    try {
        args->allocated->wait();  // the host needs the receive counts to return sized tensors, as upstream's CPU sync
    } catch (const GroupMismatch&) {
        // The ranks disagreed before any row moved (every rank raises): this dispatch never happened, so it must not
        // take a number, or this rank's next dispatch would carry another number than its peers' and disagree too.
        if (!cached_rank_prefix_matrix && dispatches_ == args->id.seq) --dispatches_;
        throw;
    }
    if (!async_finish) event->wait();
    auto& a = *args;
    return {a.recv_x,
            a.recv_x_scales,
            a.recv_topk_idx,
            a.recv_topk_weights,
            a.num_recv_tokens_per_expert,
            a.rank_prefix_matrix,
            a.channel_prefix_matrix,
            a.recv_channel_prefix_matrix,
            a.recv_src_idx,
            a.send_head,
            a.id.seq,
            event};
}

void NormalProtocol::run_dispatch(DispatchArgs& a) {
    ++operation_;  // switch mailbox slots before publishing anything
    const bool cached = a.cached_rank_prefix_matrix.has_value();
    const int num_tokens = static_cast<int>(a.x.size(0));
    const int num_channels = a.num_channels;
    const int num_topk = a.topk_idx ? static_cast<int>(a.topk_idx->size(1)) : 0;
    const int num_experts = a.num_tokens_per_expert ? static_cast<int>(a.num_tokens_per_expert->size(0)) : 0;
    const int experts_per_rank = num_experts / num_ranks_;
    const int num_scales = a.x_scales ? static_cast<int>(a.x_scales->size(1)) : 0;
    const size_t scale_element_bytes = a.x_scales ? a.x_scales->element_size() : 0;
    RowFormat format;
    format.x_bytes = a.x.size(1) * a.x.element_size();
    format.scale_bytes = num_scales * scale_element_bytes;
    format.num_topk = num_topk;
    format.with_topk = num_topk > 0;
    format.with_weights = a.topk_weights.has_value();
    format.with_src = true;

    SendPlan plan;
    if (cached) {
        a.send_head = a.routing;
        plan = send_plan_from_head(a.send_head.data_ptr<int32_t>(), num_tokens, num_ranks_, num_channels);
    } else {
        a.send_head = at::empty({num_tokens, num_ranks_}, at::kInt);
        plan = make_send_plan(a.routing.data_ptr<bool>(), num_tokens, num_ranks_, num_channels,
                              a.send_head.data_ptr<int32_t>());
    }

    // Phase 1: publish this rank's counts (non-cached) and the block of its region it lends to this operation,
    // then agree. The block will hold its outputs if they fit (senders write them directly), else it stages rounds.
    // Outputs still held in the region (earlier dispatches not combined yet) need room to stage their combines:
    // outputs may be placed only in the part of the block that leaves the largest such headroom free (staging,
    // which ends with this operation, may use all of it).
    ReservationGuard reservation{*arena_, arena_->reserve_largest()};
    const size_t held = arena_->held_headroom();
    const bool placed = a.out_x.has_value();
    publish_reservation({reservation.block, reservation.block.size > held ? reservation.block.size - held : 0,
                         placed ? region_offset(*a.out_x) : -1, a.out_scales ? region_offset(*a.out_scales) : -1});
    TrafficMatrix traffic{num_ranks_, {}};
    std::vector<int32_t> signature = {cached ? kCachedDispatchOp : kDispatchOp,
                                      static_cast<int32_t>(format.x_bytes),
                                      static_cast<int32_t>(format.scale_bytes),
                                      num_topk,
                                      format.with_weights,
                                      num_experts,
                                      a.num_worst_tokens};
    push_int64(signature, a.id.uid);
    push_int64(signature, a.id.seq);
    signature.push_back(a.checksum);
    if (cached) {
        traffic = TrafficMatrix::from_prefix(*a.cached_rank_prefix_matrix);
        exchange_signature(signature, "dispatch (cached): begin");
    } else {
        int32_t* rank_counts = mailbox(rank_, runtime_->mailbox_layout().rank_counts_offset);
        int32_t* channel_counts = mailbox(rank_, runtime_->mailbox_layout().channel_counts_offset);
        for (int r = 0; r < num_ranks_; ++r) {
            rank_counts[r] = static_cast<int32_t>(plan.tokens_per_rank[r].size());
            std::copy_n(plan.channel_counts.data() + r * num_channels, num_channels,
                        channel_counts + r * shm::kMaxChannels);
        }
        std::copy_n(a.num_tokens_per_expert->data_ptr<int32_t>(), num_experts,
                    mailbox(rank_, runtime_->mailbox_layout().expert_counts_offset));
        exchange_signature(signature, "dispatch: counts published");
        traffic.counts.resize(static_cast<size_t>(num_ranks_) * num_ranks_);
        for (int i = 0; i < num_ranks_; ++i)
            for (int j = 0; j < num_ranks_; ++j)
                traffic.counts[i * num_ranks_ + j] = mailbox(i, runtime_->mailbox_layout().rank_counts_offset)[j];
    }
    if (a.num_worst_tokens > 0) {
        for (int j = 0; j < num_ranks_; ++j)
            if (traffic.total_received(j) > a.num_worst_tokens)
                throw GroupMismatch(concat("mtdeepep: rank ", j, " receives ", traffic.total_received(j),
                                           " tokens, more than num_worst_tokens=", a.num_worst_tokens));
    }

    // Every rank derives, for every receiver, where its rows go: straight into its outputs (placed by the receiver,
    // or laid out in the block it lent), or via staging.
    const size_t headroom = combine_headroom(a.x.size(1), num_topk);
    std::vector<RegionLayout> output_layout(num_ranks_), staging_layout(num_ranks_);
    std::vector<bool> direct(num_ranks_);
    std::vector<uint8_t*> block_base(num_ranks_);
    std::vector<RowArrays> direct_arrays(num_ranks_);
    for (int j = 0; j < num_ranks_; ++j) {
        const Reservation lent = read_reservation(j);
        const RegionArena::Block& block = lent.block;
        const int64_t rows = a.num_worst_tokens > 0 ? a.num_worst_tokens : traffic.total_received(j);
        output_layout[j] = RegionLayout::for_rows(format, rows);
        block_base[j] = data_region(j) + block.offset;
        if (lent.placed_x >= 0) {
            // Placed outputs: x (and scales) only; a cached dispatch carries no top-k and returns no source index.
            direct[j] = true;
            direct_arrays[j] = {data_region(j) + lent.placed_x,
                                lent.placed_scales >= 0 ? data_region(j) + lent.placed_scales : nullptr, nullptr,
                                nullptr, nullptr};
            continue;
        }
        // Outputs live in the region only if they leave room to stage one row of the matching combine: its rows are
        // at most float32 with the same top-k weights, and the outputs stay there until after that combine.
        direct[j] = output_layout[j].total_bytes + headroom <= lent.placeable;
        direct_arrays[j] = output_layout[j].arrays(block_base[j]);
        staging_layout[j] = RegionLayout::fitting(format, block.size);
        if (!direct[j] && traffic.remote_received(j) > 0 && staging_layout[j].capacity == 0)
            throw GroupMismatch(concat(
                "mtdeepep: rank ", j, " has ", block.size, " free bytes of num_nvl_bytes=", runtime_->num_nvl_bytes(),
                ", which cannot hold one token row; dispatch needs at least ", format.min_block_bytes(), " bytes"));
    }

    // Phase 2: outputs, published to the caller before the data moves.
    const int64_t num_recv = traffic.total_received(rank_);
    const int64_t num_rows = output_layout[rank_].capacity;
    const int64_t hidden = a.x.size(1);
    if (placed) {
        a.recv_x = *a.out_x;
        a.recv_x_scales = a.out_scales;
        a.recv_src_idx = at::empty({0}, at::kInt);
    } else if (direct[rank_]) {
        // The outputs are views of this rank's region; the block returns to the arena with the last of them.
        reservation.keep = output_layout[rank_].total_bytes;
        auto owner = arena_->hold({reservation.block.offset, reservation.keep}, headroom);
        const RowArrays views = output_layout[rank_].arrays(block_base[rank_]);
        auto view = [&](void* ptr, at::IntArrayRef sizes, at::ScalarType dtype) {
            return at::from_blob(ptr, sizes, [owner](void*) {}, at::TensorOptions().dtype(dtype));
        };
        a.recv_x = view(views.x, {num_rows, hidden}, a.x.scalar_type());
        if (a.x_scales) a.recv_x_scales = view(views.scales, {num_rows, num_scales}, a.x_scales->scalar_type());
        a.recv_src_idx = view(views.src_idx, {num_rows}, at::kInt);
        if (num_topk > 0) a.recv_topk_idx = view(views.topk_idx, {num_rows, num_topk}, at::kLong);
        if (format.with_weights) a.recv_topk_weights = view(views.topk_weights, {num_rows, num_topk}, at::kFloat);
    } else {
        a.recv_x = pool_->empty({num_rows, hidden}, a.x.scalar_type());
        if (a.x_scales) a.recv_x_scales = pool_->empty({num_rows, num_scales}, a.x_scales->scalar_type());
        a.recv_src_idx = at::empty({num_rows}, at::kInt);
        if (num_topk > 0) a.recv_topk_idx = at::empty({num_rows, num_topk}, at::kLong);
        if (format.with_weights) a.recv_topk_weights = at::empty({num_rows, num_topk}, at::kFloat);
    }
    if (num_rows > num_recv && !placed) {
        a.recv_src_idx.narrow(0, num_recv, num_rows - num_recv).fill_(-1);
        if (a.recv_topk_idx) a.recv_topk_idx->narrow(0, num_recv, num_rows - num_recv).fill_(-1);
        if (a.recv_topk_weights) a.recv_topk_weights->narrow(0, num_recv, num_rows - num_recv).zero_();
    }
    fill_dispatch_metadata(a, traffic, plan, experts_per_rank);
    a.allocated->complete();

    // Phase 3: move the rows. Own rows and rows for receivers with room go straight into their outputs (one
    // copy); the others are staged in the receivers' blocks, in rounds when they do not fit at once.
    const DispatchSource source{static_cast<const uint8_t*>(a.x.data_ptr()),
                                a.x.stride(0) * a.x.element_size(),
                                format.x_bytes,
                                a.x_scales ? static_cast<const uint8_t*>(a.x_scales->data_ptr()) : nullptr,
                                a.x_scales ? a.x_scales->stride(0) : 0,
                                a.x_scales ? a.x_scales->stride(1) : 0,
                                num_scales,
                                scale_element_bytes,
                                a.topk_idx ? a.topk_idx->data_ptr<int64_t>() : nullptr,
                                format.with_weights ? a.topk_weights->data_ptr<float>() : nullptr,
                                num_topk};
    const RowArrays outputs =
        placed ? direct_arrays[rank_]
               : RowArrays{static_cast<uint8_t*>(a.recv_x.data_ptr()),
                           a.recv_x_scales ? static_cast<uint8_t*>(a.recv_x_scales->data_ptr()) : nullptr,
                           a.recv_topk_idx ? a.recv_topk_idx->data_ptr<int64_t>() : nullptr,
                           a.recv_topk_weights ? a.recv_topk_weights->data_ptr<float>() : nullptr,
                           a.recv_src_idx.data_ptr<int32_t>()};
    int64_t num_rounds = 0, remote_rows = 0;
    for (int j = 0; j < num_ranks_; ++j) {
        const int64_t first_local_expert = static_cast<int64_t>(j) * experts_per_rank;
        remote_rows += traffic.remote_received(j);
        if (j == rank_) {
            write_dispatch_rows(source, plan.tokens_per_rank[j].data(), 0, traffic.at(j, j), outputs,
                                traffic.recv_offset(j, j), first_local_expert, experts_per_rank);
        } else if (direct[j]) {
            write_dispatch_rows(source, plan.tokens_per_rank[j].data(), 0, traffic.at(rank_, j), direct_arrays[j],
                                traffic.recv_offset(rank_, j), first_local_expert, experts_per_rank);
        }
        // Every rank must count the same rounds: include every staged receiver, this one too.
        if (!direct[j] && traffic.remote_received(j) > 0)
            num_rounds =
                std::max(num_rounds, ceil_div(traffic.remote_received(j), int64_t(staging_layout[j].capacity)));
    }
    if (num_rounds == 0) {
        if (remote_rows > 0) runtime_->peers().barrier("dispatch: rows written");
        return;
    }
    for (int64_t round = 0; round < num_rounds; ++round) {
        for (int j = 0; j < num_ranks_; ++j) {
            if (j == rank_ || direct[j]) continue;
            const int64_t capacity = staging_layout[j].capacity, lo = round * capacity;
            const int64_t begin = traffic.remote_offset(rank_, j);
            const Overlap part = overlap(begin, traffic.at(rank_, j), lo, lo + capacity);
            if (part.empty()) continue;
            write_dispatch_rows(source, plan.tokens_per_rank[j].data(), part.begin - begin, part.end - begin,
                                staging_layout[j].arrays(block_base[j]), part.begin - lo,
                                static_cast<int64_t>(j) * experts_per_rank, experts_per_rank);
        }
        runtime_->peers().barrier("dispatch: rows written");
        if (!direct[rank_]) {
            const int64_t capacity = staging_layout[rank_].capacity, lo = round * capacity;
            for (int i = 0; i < num_ranks_; ++i) {
                if (i == rank_) continue;
                const int64_t begin = traffic.remote_offset(i, rank_);
                const Overlap part = overlap(begin, traffic.at(i, rank_), lo, lo + capacity);
                if (part.empty()) continue;
                copy_rows(staging_layout[rank_].arrays(block_base[rank_]), part.begin - lo, outputs,
                          traffic.recv_offset(i, rank_) + (part.begin - begin), part.end - part.begin, format.x_bytes,
                          format.scale_bytes, num_topk);
            }
        }
        if (round + 1 < num_rounds) runtime_->peers().barrier("dispatch: round consumed");
    }
}

void NormalProtocol::fill_dispatch_metadata(DispatchArgs& a, const TrafficMatrix& traffic, const SendPlan& plan,
                                            int experts_per_rank) {
    if (a.cached_rank_prefix_matrix) {
        a.rank_prefix_matrix = *a.cached_rank_prefix_matrix;
        a.channel_prefix_matrix = at::empty({0}, at::kInt);
        a.recv_channel_prefix_matrix = at::empty({0}, at::kInt);
        return;
    }
    const int num_channels = a.num_channels;
    a.rank_prefix_matrix = at::empty({num_ranks_, num_ranks_}, at::kInt);
    a.channel_prefix_matrix = at::empty({num_ranks_, num_channels}, at::kInt);
    a.recv_channel_prefix_matrix = at::empty({num_ranks_, num_channels}, at::kInt);
    auto prefix = a.rank_prefix_matrix.accessor<int32_t, 2>();
    auto channel_prefix = a.channel_prefix_matrix.accessor<int32_t, 2>();
    auto recv_channel_prefix = a.recv_channel_prefix_matrix.accessor<int32_t, 2>();
    for (int i = 0; i < num_ranks_; ++i) {
        const int32_t* their_channels =
            mailbox(i, runtime_->mailbox_layout().channel_counts_offset) + rank_ * shm::kMaxChannels;
        int64_t mine = 0, theirs = traffic.recv_offset(i, rank_);
        for (int c = 0; c < num_channels; ++c) {
            recv_channel_prefix[i][c] = static_cast<int32_t>(theirs);  // where source i's channel c starts
            theirs += their_channels[c];
            mine += plan.channel_counts[i * num_channels + c];
            channel_prefix[i][c] = static_cast<int32_t>(mine);  // tokens to rank i from channels <= c
        }
        for (int j = 0; j < num_ranks_; ++j) prefix[i][j] = static_cast<int32_t>(traffic.recv_offset(i + 1, j));
    }
    if (a.num_worst_tokens > 0) return;  // no host-visible counts in worst-case mode, as upstream
    a.num_recv_tokens_per_expert.assign(experts_per_rank, 0);
    for (int i = 0; i < num_ranks_; ++i) {
        const int32_t* expert_counts = mailbox(i, runtime_->mailbox_layout().expert_counts_offset);
        for (int e = 0; e < experts_per_rank; ++e)
            a.num_recv_tokens_per_expert[e] += expert_counts[rank_ * experts_per_rank + e];
    }
    for (int& count : a.num_recv_tokens_per_expert)
        count = static_cast<int>(ceil_div(count, a.expert_alignment) * a.expert_alignment);
}

void NormalProtocol::publish_reservation(const Reservation& reservation) {
    const int64_t values[5] = {
        static_cast<int64_t>(reservation.block.offset), static_cast<int64_t>(reservation.block.size),
        static_cast<int64_t>(reservation.placeable), reservation.placed_x, reservation.placed_scales};
    std::memcpy(mailbox(rank_, runtime_->mailbox_layout().reservation_offset), values, sizeof(values));
}

NormalProtocol::Reservation NormalProtocol::read_reservation(int rank) {
    int64_t values[5];
    std::memcpy(values, mailbox(rank, runtime_->mailbox_layout().reservation_offset), sizeof(values));
    return {{static_cast<size_t>(values[0]), static_cast<size_t>(values[1])},
            static_cast<size_t>(values[2]),
            values[3],
            values[4]};
}

int64_t NormalProtocol::region_offset(const at::Tensor& tensor) const {
    if (tensor.numel() == 0) return 0;  // no rows to write (and no data pointer)
    return static_cast<const uint8_t*>(tensor.data_ptr()) - data_region(rank_);
}

void NormalProtocol::check_placed(const at::Tensor& out, const at::Tensor& like, int64_t rows, const char* name) const {
    require(out.dim() == 2 && out.scalar_type() == like.scalar_type() && out.size(1) == like.size(1) &&
                out.size(0) >= rows && out.is_contiguous(),
            name, " must be a contiguous [>= ", rows, ", ", like.size(1), "] tensor of the input's dtype");
    if (out.numel() == 0) return;
    const auto* begin = static_cast<const uint8_t*>(out.data_ptr());
    const uint8_t* region = data_region(rank_);
    require(begin >= region && begin + out.nbytes() <= region + runtime_->num_nvl_bytes(), name,
            " must be a view of this rank's region (from region_empty)");
}

std::optional<at::Tensor> NormalProtocol::region_empty(at::IntArrayRef sizes, at::ScalarType dtype, int num_topk) {
    require(sizes.size() == 2 && sizes[0] >= 0 && sizes[1] > 0, "region_empty takes [rows, hidden] sizes");
    const size_t bytes = align_up(static_cast<size_t>(sizes[0] * sizes[1]) * c10::elementSize(dtype), kFieldAlignment);
    if (bytes == 0) return std::nullopt;
    const size_t headroom = combine_headroom(sizes[1], num_topk);
    ReservationGuard reservation{*arena_, arena_->reserve_largest()};
    // What stays free must still stage the combine of this and of every output held so far.
    if (reservation.block.size < bytes + std::max(headroom, arena_->held_headroom())) return std::nullopt;
    reservation.keep = bytes;
    auto owner = arena_->hold({reservation.block.offset, bytes}, headroom);
    return at::from_blob(
        data_region(rank_) + reservation.block.offset, sizes, [owner](void*) {}, at::TensorOptions().dtype(dtype));
}

// ---------------------------------------------------------------------------------------------------------------
// Combine

struct NormalProtocol::CombineArgs {
    at::Tensor x;
    OptTensor topk_weights, bias0, bias1;
    at::Tensor rank_prefix_matrix, send_head;
    DispatchId id;
    int32_t checksum = 0;
    int num_channels;
    at::Tensor combined_x;
    OptTensor combined_topk_weights;
};

CombineResult NormalProtocol::combine(const at::Tensor& x, const OptTensor& topk_weights, const OptTensor& bias0,
                                      const OptTensor& bias1, const at::Tensor& rank_prefix_matrix,
                                      const at::Tensor& send_head, int64_t uid, int64_t seq, int num_channels,
                                      const EventPtr& previous_event, bool async_finish) {
    runtime_->check_usable();
    // The handle decides which rows of which peer region are read: check it before anything moves.
    const TrafficMatrix traffic = checked_traffic(rank_prefix_matrix, num_ranks_);
    require(x.dim() == 2 && x.size(0) >= traffic.total_received(rank_), "x has ", x.size(0),
            " rows but the handle's dispatch received ", traffic.total_received(rank_));
    check_send_head(send_head, traffic, rank_, send_head.size(0));
    auto args = std::make_shared<CombineArgs>();
    args->x = x;
    args->topk_weights = topk_weights;
    args->bias0 = bias0;
    args->bias1 = bias1;
    args->rank_prefix_matrix = rank_prefix_matrix;
    args->send_head = send_head;
    args->id = {uid, seq};
    args->checksum = traffic_checksum(rank_prefix_matrix);
    args->num_channels = std::clamp(num_channels, 1, shm::kMaxChannels);
    const int64_t num_tokens = send_head.size(0);
    args->combined_x = pool_->empty({num_tokens, x.size(1)}, x.scalar_type());
    if (topk_weights) args->combined_topk_weights = at::empty({num_tokens, topk_weights->size(1)}, at::kFloat);
    auto self = shared_from_this();
    auto event = runtime_->submit(previous_event, [self, args] { self->run_combine(*args); });
    if (!async_finish) event->wait();
    return {args->combined_x, args->combined_topk_weights, event};
}

void NormalProtocol::run_combine(CombineArgs& a) {
    ++operation_;
    const int num_tokens = static_cast<int>(a.send_head.size(0));
    const int hidden = static_cast<int>(a.x.size(1));
    const int num_topk = a.topk_weights ? static_cast<int>(a.topk_weights->size(1)) : 0;
    const bool with_weights = a.topk_weights.has_value();
    RowFormat format;
    format.x_bytes = hidden * a.x.element_size();
    format.num_topk = num_topk;
    format.with_weights = with_weights;
    const FloatKind kind = float_kind(a.x.scalar_type());
    const TrafficMatrix traffic = TrafficMatrix::from_prefix(a.rank_prefix_matrix);

    ReservationGuard reservation{*arena_, arena_->reserve_largest()};
    publish_reservation({reservation.block, reservation.block.size});
    std::vector<int32_t> signature = {kCombineOp, static_cast<int32_t>(format.x_bytes), 0, num_topk, with_weights, 0,
                                      0};
    push_int64(signature, a.id.uid);
    push_int64(signature, a.id.seq);
    signature.push_back(a.checksum);
    exchange_signature(signature, "combine: begin");

    // Rank i stages the rows of the tokens it sent, from every other rank j (ordered by j), in the block it lent.
    std::vector<RegionLayout> staging(num_ranks_);
    std::vector<uint8_t*> block_base(num_ranks_);
    int64_t num_rounds = 0;
    for (int i = 0; i < num_ranks_; ++i) {
        const RegionArena::Block block = read_reservation(i).block;
        staging[i] = RegionLayout::fitting(format, block.size);
        block_base[i] = data_region(i) + block.offset;
        int64_t incoming = 0;
        for (int j = 0; j < num_ranks_; ++j)
            if (j != i) incoming += traffic.at(i, j);
        if (incoming == 0) continue;
        if (staging[i].capacity == 0)
            throw GroupMismatch(concat(
                "mtdeepep: rank ", i, " has ", block.size, " free bytes of num_nvl_bytes=", runtime_->num_nvl_bytes(),
                ", which cannot hold one token row; combine needs at least ", format.min_block_bytes(), " bytes"));
        num_rounds = std::max(num_rounds, ceil_div(incoming, int64_t(staging[i].capacity)));
    }
    // Offset of sender j's rows among receiver i's staged rows: the transpose of dispatch's traffic.
    auto combine_offset = [&](int j, int i) {
        int64_t sum = 0;
        for (int s = 0; s < j; ++s)
            if (s != i) sum += traffic.at(i, s);
        return sum;
    };
    const uint8_t* x_rows = static_cast<const uint8_t*>(a.x.data_ptr());
    const float* weight_rows = with_weights ? a.topk_weights->data_ptr<float>() : nullptr;
    const RowArrays my_rows{const_cast<uint8_t*>(x_rows), nullptr, nullptr, const_cast<float*>(weight_rows), nullptr};
    const RowArrays my_staging = staging[rank_].arrays(block_base[rank_]);
    const uint8_t* bias0 = a.bias0 ? static_cast<const uint8_t*>(a.bias0->data_ptr()) : nullptr;
    const uint8_t* bias1 = a.bias1 ? static_cast<const uint8_t*>(a.bias1->data_ptr()) : nullptr;
    uint8_t* out = static_cast<uint8_t*>(a.combined_x.data_ptr());
    float* out_weights = with_weights ? a.combined_topk_weights->data_ptr<float>() : nullptr;

    auto send_round = [&](int64_t round) {
        for (int i = 0; i < num_ranks_; ++i) {
            if (i == rank_ || staging[i].capacity == 0) continue;
            const int64_t capacity = staging[i].capacity, lo = round * capacity;
            const int64_t begin = combine_offset(rank_, i);
            const Overlap part = overlap(begin, traffic.at(i, rank_), lo, lo + capacity);
            if (part.empty()) continue;
            copy_rows(my_rows, traffic.recv_offset(i, rank_) + (part.begin - begin), staging[i].arrays(block_base[i]),
                      part.begin - lo, part.end - part.begin, format.x_bytes, 0, num_topk);
        }
    };

    if (num_rounds <= 1) {
        // Everything fits: one pass per token over its contributions, straight into the output.
        if (num_rounds == 1) {
            send_round(0);
            runtime_->peers().barrier("combine: rows written");
        }
        CombineSources sources{a.send_head.data_ptr<int32_t>(), num_ranks_, {}, {}, {}};
        for (int j = 0; j < num_ranks_; ++j) {
            const bool local = j == rank_;
            sources.rows.push_back(local ? x_rows : my_staging.x);
            sources.row_offset.push_back(local ? traffic.recv_offset(rank_, rank_) : combine_offset(j, rank_));
            sources.weight_rows.push_back(local ? weight_rows : my_staging.topk_weights);
        }
        combine_reduce(kind, sources, num_tokens, hidden, num_topk, bias0, bias1, out, out_weights);
        return;
    }

    // Several rounds: accumulate each round's rows into an FP32 buffer, then cast once.
    const SendPlan plan = send_plan_from_head(a.send_head.data_ptr<int32_t>(), num_tokens, num_ranks_, 1);
    auto acc = at::zeros({num_tokens, hidden}, at::kFloat);
    // Through the pointer, as a device kernel would write: `zero_()` would record an in-place change of an output
    // the caller already holds (and may have viewed inside an autograd Function).
    if (with_weights) std::memset(out_weights, 0, a.combined_topk_weights->nbytes());
    accumulate_rows(kind, x_rows + traffic.recv_offset(rank_, rank_) * format.x_bytes,
                    with_weights ? weight_rows + traffic.recv_offset(rank_, rank_) * num_topk : nullptr,
                    plan.tokens_per_rank[rank_].data(), traffic.at(rank_, rank_), hidden, num_topk,
                    acc.data_ptr<float>(), out_weights);
    for (int64_t round = 0; round < num_rounds; ++round) {
        send_round(round);
        runtime_->peers().barrier("combine: rows written");
        const int64_t capacity = staging[rank_].capacity, lo = round * capacity;
        for (int j = 0; j < num_ranks_ && capacity > 0; ++j) {
            if (j == rank_) continue;
            const int64_t begin = combine_offset(j, rank_);
            const Overlap part = overlap(begin, traffic.at(rank_, j), lo, lo + capacity);
            if (part.empty()) continue;
            accumulate_rows(kind, my_staging.x + (part.begin - lo) * format.x_bytes,
                            with_weights ? my_staging.topk_weights + (part.begin - lo) * num_topk : nullptr,
                            plan.tokens_per_rank[j].data() + (part.begin - begin), part.end - part.begin, hidden,
                            num_topk, acc.data_ptr<float>(), out_weights);
        }
        if (round + 1 < num_rounds) runtime_->peers().barrier("combine: round consumed");
    }
    finish_accumulation(kind, acc.data_ptr<float>(), num_tokens, hidden, bias0, bias1, out);
}

}  // namespace mtdeepep::cpu
