// The runtime base of one Buffer on one rank, shared by every protocol (runtime/cpu/normal.hpp for normal mode,
// runtime/cpu/low_latency.hpp for low-latency mode):
//
//   - one POSIX shared-memory segment per rank: [control block + normal-mode mailbox][normal region: num_nvl_bytes]
//     [low-latency area: num_ll_bytes], mapped by every rank of the host (the CPU analog of DeepEP's IPC buffer);
//   - the peer group built on the control blocks: barriers and bounded waits that name the ranks that did not
//     arrive, and the failure flag each rank publishes for its peers;
//   - one comm thread (the CPU counterpart of a comm stream) on which operations run in order;
//   - the lifecycle: set-up, failure state (an operation that fails with the ranks out of step poisons the runtime
//     and tells the peers), interruption (Ctrl-C, process exit), and destroy.
//
// Lifetime rules:
//   - tensor views of the regions (received rows, `get_local_buffer_tensor`) keep the mapping alive: they stay valid
//     while they are held, whatever happens to the runtime;
//   - `destroy()` first finishes the queued operations, then tells the peers and releases everything else;
//   - only the process that created the runtime touches the shared state or the comm thread: a forked child that
//     drops an inherited runtime abandons it silently (the parent's group is not affected);
//   - `shutdown_all_runtimes()` (registered by Python at exit) aborts and joins every live runtime's comm thread while
//     the interpreter can still run it, so no exit path leaves a thread that needs the GIL during finalisation.
#pragma once

#include <ATen/ATen.h>
#include <sys/types.h>

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "runtime/event.hpp"
#include "shm/peer_group.hpp"
#include "shm/segment.hpp"

namespace mtdeepep {

class Runtime : public std::enable_shared_from_this<Runtime> {
  public:
    // Creates this rank's segment (mode 0600). `timeout_s` is checked (finite, > 0). `num_ll_bytes` = 0: no
    // low-latency area.
    static std::shared_ptr<Runtime> create(int rank, int num_ranks, int64_t num_nvl_bytes, int64_t num_ll_bytes,
                                           double timeout_s, int num_threads);
    ~Runtime();
    Runtime(const Runtime&) = delete;
    Runtime& operator=(const Runtime&) = delete;

    // ---- set-up: every rank passes all ranks' segment names and pids (gathered by Python) and the buffer id the
    // ranks agreed on; maps the peers' segments, waits until every rank did, unlinks the names, starts the comm
    // thread. `connect_local()`: no peer is mapped (a low-latency area used by the collective transport only).
    std::string segment_name() const;
    int64_t pid() const { return creator_pid_; }
    void connect(const std::vector<std::string>& names, const std::vector<int64_t>& pids, uint64_t uid);
    bool is_available() const { return available_; }
    uint64_t uid() const { return uid_; }
    int rank() const { return rank_; }
    int num_ranks() const { return num_ranks_; }

    // ---- lifecycle ----
    void destroy();
    // Ends every wait of this rank at once and poisons the runtime; the peers see `reason` (Ctrl-C, process exit).
    void interrupt(const std::string& reason);
    void set_timeout(double timeout_s);
    double timeout_s() const { return timeout_s_; }
    void set_num_threads(int num_threads) { num_threads_ = num_threads; }
    // Throws CommError when destroyed, not set up, or poisoned by an earlier failure.
    void check_usable() const;
    // Publishes a failure that left the ranks out of step: the runtime refuses further work, peers stop waiting.
    void fail(const std::string& reason);

    // ---- memory ----
    int64_t num_nvl_bytes() const { return num_nvl_bytes_; }
    int64_t num_ll_bytes() const { return num_ll_bytes_; }
    uint8_t* nvl_region(int rank) const { return base(rank) + mailbox_.control_bytes; }
    uint8_t* ll_region(int rank) const { return base(rank) + mailbox_.control_bytes + nvl_span_; }
    // Keeps this rank's mapping alive while held.
    std::shared_ptr<void> own_mapping() const { return own_segment_; }
    // A tensor over this rank's mapped memory that keeps the mapping alive.
    at::Tensor view(uint8_t* ptr, at::IntArrayRef sizes, at::IntArrayRef strides, at::ScalarType dtype) const;
    // A 1-D view of this rank's normal region (or low-latency area) from element `offset` on.
    at::Tensor get_local_buffer_tensor(at::ScalarType dtype, int64_t offset, bool low_latency_area) const;

    // ---- peers and execution ----
    shm::PeerGroup& peers() const { return *peers_; }
    bool has_peers() const { return peers_ != nullptr; }
    const shm::MailboxLayout& mailbox_layout() const { return mailbox_; }
    int32_t* mailbox(int rank, size_t offset) const { return peers_->mailbox(rank, offset); }
    // An event whose interrupted wait (Ctrl-C) interrupts this runtime.
    EventPtr new_event();
    // Runs `body` on the comm thread after `previous_event`; returns its completion. A failure poisons the runtime
    // (unless `poison_on_failure` is false or it is a GroupMismatch / invalid argument, which every rank raises).
    EventPtr submit(const EventPtr& previous_event, std::function<void()> body, bool poison_on_failure = true);
    // Runs `body` now on the caller's thread when nothing is queued and the caller waits (returns nullptr), else on
    // the comm thread (returns its event, already waited for unless `async`). Failures do not poison the runtime
    // (low-latency mode recovers with clean_low_latency_buffer), but an interruption does.
    EventPtr launch(bool async, std::function<void()> body);
    bool has_queued_work() const { return stream_ != nullptr && stream_->pending() > 0; }

  private:
    Runtime(int rank, int num_ranks, int64_t num_nvl_bytes, int64_t num_ll_bytes, double timeout_s, int num_threads);
    uint8_t* base(int rank) const;
    bool in_creator_process() const;
    void abandon();  // a forked child: release nothing shared, join no thread

    int rank_;
    int num_ranks_;
    int64_t num_nvl_bytes_;
    int64_t num_ll_bytes_;
    size_t nvl_span_;  // num_nvl_bytes rounded up to a page: the low-latency area starts page-aligned
    double timeout_s_;
    std::atomic<int> num_threads_;
    pid_t creator_pid_;
    uint64_t uid_ = 0;
    shm::MailboxLayout mailbox_;
    std::shared_ptr<shm::SharedSegment> own_segment_;
    std::vector<std::shared_ptr<shm::SharedSegment>> segments_;
    std::unique_ptr<shm::PeerGroup> peers_;
    std::unique_ptr<CommStream> stream_;
    bool available_ = false;
    bool destroyed_ = false;
    std::string failure_;  // set by the comm thread or an interrupt; read by callers
    mutable std::mutex failure_mutex_;
};

using RuntimePtr = std::shared_ptr<Runtime>;

// Aborts (reason "the process is exiting") and destroys every live runtime of this process, joining the comm threads.
void shutdown_all_runtimes();

// Bytes of one rank's segment before the low-latency area: control block + mailbox + normal region.
size_t segment_prefix_bytes(int num_ranks, int64_t num_nvl_bytes);

}  // namespace mtdeepep
