#include "shm/peer_group.hpp"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <thread>

#include "common/exception.hpp"
#include "common/hooks.hpp"
#include "shm/segment.hpp"

namespace mtdeepep::shm {

namespace {

size_t round_up(size_t value, size_t alignment) {
    return (value + alignment - 1) / alignment * alignment;
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
}

void copy_label(char* dst, size_t capacity, const std::string& text) {
    size_t n = std::min(capacity - 1, text.size());
    std::memcpy(dst, text.data(), n);
    dst[n] = '\0';
}

// This host's name: the peers of a group share its memory, so they run here (named with their pid when they exit).
std::string host_name() {
    char name[256] = {};
    if (gethostname(name, sizeof(name) - 1) != 0) return "?";
    return name;
}

}  // namespace

MailboxLayout::MailboxLayout(int num_ranks) : num_ranks(num_ranks) {
    size_t offset = round_up(sizeof(ControlHeader), 64);
    signature_offset = offset;
    offset = round_up(offset + kOpSignatureInts * sizeof(int32_t), 64);
    reservation_offset = offset;
    offset = round_up(offset + 5 * sizeof(int64_t), 64);
    rank_counts_offset = offset;
    offset = round_up(offset + num_ranks * sizeof(int32_t), 64);
    channel_counts_offset = offset;
    offset = round_up(offset + static_cast<size_t>(num_ranks) * kMaxChannels * sizeof(int32_t), 64);
    expert_counts_offset = offset;
    offset += kMaxExperts * sizeof(int32_t);
    slot_bytes = round_up(offset - signature_offset, 64);
    control_bytes = round_up(signature_offset + 2 * slot_bytes, 4096);
}

void init_control_header(uint8_t* control_area, int rank, int num_ranks, size_t data_bytes, size_t ll_bytes) {
    auto* header = new (control_area) ControlHeader();
    header->rank = rank;
    header->num_ranks = num_ranks;
    header->pid = getpid();
    header->data_bytes = data_bytes;
    header->ll_bytes = ll_bytes;
    header->arrived.store(0, std::memory_order_relaxed);
    header->failed.store(0, std::memory_order_relaxed);
    copy_label(header->phase, sizeof(header->phase), "created");
    std::atomic_thread_fence(std::memory_order_release);
    header->magic = kControlMagic;
}

PeerGroup::PeerGroup(int rank, int num_ranks, std::vector<uint8_t*> control_areas, std::vector<pid_t> pids,
                     double timeout_s)
    : rank_(rank),
      num_ranks_(num_ranks),
      control_areas_(std::move(control_areas)),
      pids_(std::move(pids)),
      timeout_s_(timeout_s) {}

void PeerGroup::mark_failed(const std::string& reason) {
    ControlHeader* self = header(rank_);
    copy_label(self->failure, sizeof(self->failure), reason);
    self->failed.store(1, std::memory_order_release);
}

void PeerGroup::abort(const std::string& reason) {
    {
        std::lock_guard<std::mutex> lock(abort_mutex_);
        if (abort_reason_.empty()) abort_reason_ = reason;
    }
    aborted_.store(true, std::memory_order_release);
}

void PeerGroup::barrier(const char* phase) {
    const uint64_t target = ++arrived_;
    ControlHeader* self = header(rank_);
    copy_label(self->phase, sizeof(self->phase), phase);
    self->arrived.store(target, std::memory_order_release);
    std::vector<int> others;
    for (int peer = 0; peer < num_ranks_; ++peer)
        if (peer != rank_) others.push_back(peer);
    wait_for(
        others, [&](int peer) { return header(peer)->arrived.load(std::memory_order_acquire) >= target; },
        concat("phase '", phase, "' (barrier #", target, ")"));
}

void PeerGroup::wait_for(std::vector<int> peers, const std::function<bool(int)>& ready, const std::string& where,
                         const std::function<void(int, int64_t)>& arrived) const {
    using clock = std::chrono::steady_clock;
    const auto start = clock::now();
    auto next_check = start + std::chrono::milliseconds(20);
    for (uint64_t iteration = 0; !peers.empty(); ++iteration) {
        for (size_t i = 0; i < peers.size();) {
            if (ready(peers[i])) {
                if (arrived)
                    arrived(peers[i],
                            std::chrono::duration_cast<std::chrono::nanoseconds>(clock::now() - start).count());
                peers[i] = peers.back();
                peers.pop_back();
                continue;
            }
            const ControlHeader* peer = header(peers[i]);
            if (peer->failed.load(std::memory_order_acquire) != 0)
                throw CommError(concat("mtdeepep: rank ", rank_, " stopped waiting in ", where, ": rank ", peers[i],
                                       " failed: ", std::string(peer->failure)));
            ++i;
        }
        if (peers.empty()) break;
        if (aborted_.load(std::memory_order_acquire)) {
            std::lock_guard<std::mutex> lock(abort_mutex_);
            throw CommError(concat("mtdeepep: rank ", rank_, " stopped waiting in ", where, ": ", abort_reason_));
        }

        // Spin briefly (peers usually arrive within microseconds), then yield the core: with more ranks than
        // cores a spinning waiter would starve the rank it waits for.
        if (iteration < 2000) {
            cpu_relax();
        } else if (iteration < 20000) {
            sched_yield();
        } else {
            std::this_thread::sleep_for(std::chrono::microseconds(50));
        }
        if ((iteration & 255) != 0) continue;

        const auto now = clock::now();
        if (now < next_check) continue;
        next_check = now + std::chrono::milliseconds(20);
        poll_interrupt();
        for (int peer : peers) {
            if (!process_alive(pids_[peer]))
                throw CommError(concat("mtdeepep: rank ", rank_, " stopped waiting in ", where, ": rank ", peer,
                                       " (pid ", pids_[peer], ", host ", host_name(), ") exited without arriving"));
        }
        if (std::chrono::duration<double>(now - start).count() > timeout_s_) {
            std::string missing, detail;
            std::sort(peers.begin(), peers.end());
            for (int peer : peers) {
                missing += concat(missing.empty() ? "" : ", ", peer);
                const ControlHeader* p = header(peer);
                detail += concat("; rank ", peer, " last arrived at '", std::string(p->phase), "' (barrier #",
                                 p->arrived.load(), ")");
            }
            throw CommTimeout(concat("mtdeepep: rank ", rank_, " timed out after ", timeout_s_, " s in ", where,
                                     ": rank(s) [", missing, "] did not arrive", detail));
        }
    }
}

PeerSegments map_peer_segments(int rank, const std::shared_ptr<SharedSegment>& own,
                               const std::vector<std::string>& names, const std::vector<int64_t>& pids,
                               size_t data_bytes, size_t ll_bytes, double timeout_s, const char* phase) {
    const int num_ranks = static_cast<int>(names.size());
    if (static_cast<int>(pids.size()) != num_ranks || rank < 0 || rank >= num_ranks)
        throw std::invalid_argument("mtdeepep: set-up needs one segment name and pid per rank");
    PeerSegments result;
    try {
        std::vector<uint8_t*> control_areas(num_ranks);
        std::vector<pid_t> peer_pids(num_ranks);
        for (int r = 0; r < num_ranks; ++r) {
            result.segments.push_back(r == rank ? own : SharedSegment::open(names[r], own->size()));
            control_areas[r] = static_cast<uint8_t*>(result.segments[r]->data());
            peer_pids[r] = static_cast<pid_t>(pids[r]);
            const auto* header = reinterpret_cast<const ControlHeader*>(control_areas[r]);
            if (header->magic != kControlMagic || header->rank != r || header->num_ranks != num_ranks ||
                header->pid != pids[r] || header->data_bytes != data_bytes || header->ll_bytes != ll_bytes)
                throw CommError(concat("mtdeepep: segment ", names[r], " does not belong to rank ", r, " of ",
                                       num_ranks, " (pid ", pids[r], ") with ", data_bytes, " + ", ll_bytes,
                                       " data bytes (ranks disagree on num_nvl_bytes / num_rdma_bytes?)"));
        }
        result.peers = std::make_unique<PeerGroup>(rank, num_ranks, control_areas, peer_pids, timeout_s);
        result.peers->barrier(phase);
    } catch (...) {
        own->unlink();
        cleanup_stale_segments();
        throw;
    }
    own->unlink();
    return result;
}

}  // namespace mtdeepep::shm
