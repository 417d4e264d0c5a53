// The control block each rank keeps at the start of its segment, and the barrier built on it.
//
// Every rank runs the same sequence of barriers, so one monotonically increasing counter per rank is enough:
// barrier #n passes once every peer's counter reaches n. A wait that does not finish names the ranks that did not
// arrive and the last phase each of them reached; a peer that failed, exited or destroyed its buffer ends the wait
// at once with that cause, and so does `abort` (the owner was interrupted or is exiting) and a Ctrl-C on the Python
// main thread (poll_interrupt).
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "shm/segment.hpp"

namespace mtdeepep::shm {

constexpr uint64_t kControlMagic = 0x6d74646565706570ull;  // "mtdeepep"
constexpr int kMaxChannels = 128;
constexpr int kMaxExperts = 1 << 16;
constexpr int kOpSignatureInts = 16;

struct alignas(64) ControlHeader {
    uint64_t magic;
    int32_t rank;
    int32_t num_ranks;
    int64_t pid;
    uint64_t data_bytes;                        // the normal-mode region
    uint64_t ll_bytes;                          // the low-latency area
    alignas(64) std::atomic<uint64_t> arrived;  // barriers this rank has arrived at
    alignas(64) std::atomic<int32_t> failed;    // non-zero once the owner failed or destroyed its buffer
    char failure[480];
    char phase[64];  // label of the owner's last barrier, for error messages
};

// Where the per-operation mailbox (counts a rank publishes for its peers) lives inside the control area.
// There are two slots, used by alternate operations: an operation may end without a trailing barrier, so a fast
// rank can publish operation n+1 while a peer still reads operation n; it cannot get further ahead, because it
// waits at n+1's first barrier until every peer has finished n. Field offsets are relative to a slot.
struct MailboxLayout {
    int num_ranks;
    size_t signature_offset;       // int32[kOpSignatureInts]: what the operation is, checked across ranks
    size_t reservation_offset;     // int64[5]: offset, size and placeable bytes of the block lent to this operation,
                                   // then the region offsets of placed outputs (x, scales; -1 when none)
    size_t rank_counts_offset;     // int32[R]: tokens this rank sends to each rank
    size_t channel_counts_offset;  // int32[R * kMaxChannels]: the same per sender channel
    size_t expert_counts_offset;   // int32[kMaxExperts]: tokens this rank sends to each expert
    size_t slot_bytes;             // distance between the two slots
    size_t control_bytes;          // header + mailbox, rounded to pages: the data region starts here

    explicit MailboxLayout(int num_ranks);
};

class PeerGroup {
  public:
    PeerGroup(int rank, int num_ranks, std::vector<uint8_t*> control_areas, std::vector<pid_t> pids, double timeout_s);

    // Arrive at the next barrier and wait for every peer. Throws CommTimeout / CommError.
    void barrier(const char* phase);

    // Waits until ready(peer) holds for every rank in `peers`, calling arrived(peer, waited_ns) as each one does.
    // A peer that failed or exited ends the wait at once, and the timeout ends it with an error naming the ranks
    // that did not arrive and the last barrier each reached; `where` says what was being waited for.
    void wait_for(std::vector<int> peers, const std::function<bool(int)>& ready, const std::string& where,
                  const std::function<void(int, int64_t)>& arrived = nullptr) const;

    // Publishes a failure so peers stop waiting for this rank.
    void mark_failed(const std::string& reason);
    // Ends this rank's current and future waits at once with CommError(reason) (thread-safe).
    void abort(const std::string& reason);

    int32_t* mailbox(int rank, size_t offset) const {
        return reinterpret_cast<int32_t*>(control_areas_[rank] + offset);
    }
    ControlHeader* header(int rank) const { return reinterpret_cast<ControlHeader*>(control_areas_[rank]); }
    uint64_t barriers_passed() const { return arrived_; }
    void set_timeout(double timeout_s) { timeout_s_ = timeout_s; }  // already checked (checked_timeout)
    double timeout() const { return timeout_s_; }

  private:
    int rank_;
    int num_ranks_;
    std::vector<uint8_t*> control_areas_;
    std::vector<pid_t> pids_;
    double timeout_s_;
    uint64_t arrived_ = 0;
    std::atomic<bool> aborted_{false};
    mutable std::mutex abort_mutex_;
    std::string abort_reason_;
};

void init_control_header(uint8_t* control_area, int rank, int num_ranks, size_t data_bytes, size_t ll_bytes);

// The set-up every runtime shares: map each peer's segment (`names`/`pids` per rank, `own` for this rank), check
// that its header belongs to that rank with `data_bytes` + `ll_bytes` of data, wait at `phase` until every rank has
// mapped everything, then unlink this rank's name, so nothing is left in /dev/shm even on SIGKILL. On failure the own
// name and stale ones are unlinked and the error is rethrown.
struct PeerSegments {
    std::vector<std::shared_ptr<SharedSegment>> segments;
    std::unique_ptr<PeerGroup> peers;
};
PeerSegments map_peer_segments(int rank, const std::shared_ptr<SharedSegment>& own,
                               const std::vector<std::string>& names, const std::vector<int64_t>& pids,
                               size_t data_bytes, size_t ll_bytes, double timeout_s, const char* phase);

}  // namespace mtdeepep::shm
