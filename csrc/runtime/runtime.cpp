#include "runtime/runtime.hpp"

#include <ATen/Parallel.h>
#include <unistd.h>

#include <algorithm>

#include "common/exception.hpp"
#include "common/hooks.hpp"

namespace mtdeepep {

namespace {

constexpr size_t kPage = 4096;

size_t round_up(size_t value, size_t alignment) {
    return (value + alignment - 1) / alignment * alignment;
}

// Every runtime of this process that was not destroyed, for shutdown_all_runtimes().
std::mutex& registry_mutex() {
    static std::mutex mutex;
    return mutex;
}
std::vector<std::weak_ptr<Runtime>>& registry() {
    static auto* runtimes = new std::vector<std::weak_ptr<Runtime>>();  // never destroyed: used at exit
    return *runtimes;
}

}  // namespace

size_t segment_prefix_bytes(int num_ranks, int64_t num_nvl_bytes) {
    return shm::MailboxLayout(num_ranks).control_bytes + round_up(static_cast<size_t>(num_nvl_bytes), kPage);
}

// ---------------------------------------------------------------------------------------------------------------
// Set-up

std::shared_ptr<Runtime> Runtime::create(int rank, int num_ranks, int64_t num_nvl_bytes, int64_t num_ll_bytes,
                                         double timeout_s, int num_threads) {
    // Deleting a runtime joins its comm thread, which may need the GIL to free its last task's tensors.
    std::shared_ptr<Runtime> runtime(new Runtime(rank, num_ranks, num_nvl_bytes, num_ll_bytes, timeout_s, num_threads),
                                     [](Runtime* r) { without_gil([r] { delete r; }); });
    std::lock_guard<std::mutex> lock(registry_mutex());
    auto& live = registry();
    live.erase(std::remove_if(live.begin(), live.end(), [](const auto& weak) { return weak.expired(); }), live.end());
    live.push_back(runtime);
    return runtime;
}

Runtime::Runtime(int rank, int num_ranks, int64_t num_nvl_bytes, int64_t num_ll_bytes, double timeout_s,
                 int num_threads)
    : rank_(rank),
      num_ranks_(num_ranks),
      num_nvl_bytes_(num_nvl_bytes),
      num_ll_bytes_(num_ll_bytes),
      nvl_span_(round_up(static_cast<size_t>(std::max<int64_t>(num_nvl_bytes, 0)), kPage)),
      timeout_s_(checked_timeout(timeout_s)),
      num_threads_(num_threads),
      creator_pid_(getpid()),
      mailbox_(num_ranks) {
    if (num_ranks < 1 || rank < 0 || rank >= num_ranks)
        throw std::invalid_argument(concat("mtdeepep: invalid rank ", rank, " of ", num_ranks));
    if (num_nvl_bytes < 0 || num_ll_bytes < 0)
        throw std::invalid_argument("mtdeepep: buffer sizes must be non-negative");
    shm::cleanup_stale_segments();
    const size_t total = mailbox_.control_bytes + nvl_span_ + static_cast<size_t>(num_ll_bytes);
    own_segment_ = shm::SharedSegment::create(shm::make_segment_name(), total);
    shm::init_control_header(static_cast<uint8_t*>(own_segment_->data()), rank, num_ranks,
                             static_cast<size_t>(num_nvl_bytes), static_cast<size_t>(num_ll_bytes));
}

Runtime::~Runtime() {
    try {
        destroy();
    } catch (...) {
    }
}

std::string Runtime::segment_name() const {
    if (!own_segment_) throw CommError("mtdeepep: the buffer was destroyed");
    return own_segment_->name();
}

void Runtime::connect(const std::vector<std::string>& names, const std::vector<int64_t>& pids, uint64_t uid) {
    if (destroyed_) throw CommError("mtdeepep: the buffer was destroyed");
    if (available_) throw std::logic_error("mtdeepep: the runtime is already connected");
    auto mapped = shm::map_peer_segments(rank_, own_segment_, names, pids, static_cast<size_t>(num_nvl_bytes_),
                                         static_cast<size_t>(num_ll_bytes_), timeout_s_, "setup: all segments mapped");
    segments_ = std::move(mapped.segments);
    peers_ = std::move(mapped.peers);
    uid_ = uid;
    stream_ = std::make_unique<CommStream>();
    available_ = true;
}

uint8_t* Runtime::base(int rank) const {
    return static_cast<uint8_t*>((rank == rank_ ? own_segment_ : segments_[rank])->data());
}

// ---------------------------------------------------------------------------------------------------------------
// Lifecycle

bool Runtime::in_creator_process() const {
    return getpid() == creator_pid_;
}

void Runtime::abandon() {
    // The comm thread does not exist in a forked child and its locks may be in any state: never touch it (releasing
    // the object would join or detach a thread of another process). The shared state belongs to the parent.
    (void)stream_.release();
    peers_.reset();
    segments_.clear();
    own_segment_.reset();  // the child's own mapping only; the parent still owns the name
    available_ = false;
}

void Runtime::destroy() {
    if (destroyed_) return;
    destroyed_ = true;
    if (!in_creator_process()) {
        abandon();
        return;
    }
    if (stream_) stream_->shutdown();  // finish the queued operations first
    if (peers_) {
        std::lock_guard<std::mutex> lock(failure_mutex_);
        peers_->mark_failed(failure_.empty() ? concat("rank ", rank_, " destroyed its buffer") : failure_);
    }
    available_ = false;
    peers_.reset();
    segments_.clear();
    if (own_segment_) own_segment_->unlink();
    own_segment_.reset();  // tensor views hold their own reference to the mapping
}

void Runtime::fail(const std::string& reason) {
    if (!in_creator_process()) return;
    std::lock_guard<std::mutex> lock(failure_mutex_);
    if (!failure_.empty()) return;
    failure_ = reason;
    if (peers_) peers_->mark_failed(concat("rank ", rank_, ": ", reason));
}

void Runtime::interrupt(const std::string& reason) {
    if (!in_creator_process()) return;
    fail(reason);
    if (peers_) peers_->abort(reason);
}

void Runtime::set_timeout(double timeout_s) {
    timeout_s_ = checked_timeout(timeout_s);
    if (peers_) peers_->set_timeout(timeout_s_);
}

void Runtime::check_usable() const {
    if (destroyed_) throw CommError("mtdeepep: the buffer was destroyed");
    if (!available_) throw CommError("mtdeepep: the buffer is not set up (set-up was not run or failed)");
    std::lock_guard<std::mutex> lock(failure_mutex_);
    if (!failure_.empty())
        throw CommError(concat("mtdeepep: the buffer is unusable after an earlier failure: ", failure_));
}

// ---------------------------------------------------------------------------------------------------------------
// Memory

at::Tensor Runtime::view(uint8_t* ptr, at::IntArrayRef sizes, at::IntArrayRef strides, at::ScalarType dtype) const {
    auto mapping = own_segment_;
    return at::from_blob(ptr, sizes, strides, [mapping](void*) {}, at::TensorOptions().dtype(dtype));
}

at::Tensor Runtime::get_local_buffer_tensor(at::ScalarType dtype, int64_t offset, bool low_latency_area) const {
    check_usable();
    const int64_t region_bytes = low_latency_area ? num_ll_bytes_ : num_nvl_bytes_;
    const int64_t element = static_cast<int64_t>(c10::elementSize(dtype));
    if (offset < 0 || offset * element > region_bytes)
        throw std::invalid_argument(
            concat("mtdeepep: offset ", offset, " is outside the ", region_bytes, "-byte buffer"));
    uint8_t* region = low_latency_area ? ll_region(rank_) : nvl_region(rank_);
    const int64_t numel = (region_bytes - offset * element) / element;
    return view(region + offset * element, {numel}, {1}, dtype);
}

// ---------------------------------------------------------------------------------------------------------------
// Execution

EventPtr Runtime::new_event() {
    std::weak_ptr<Runtime> weak = weak_from_this();
    return std::make_shared<Event>([weak](const std::string& reason) {
        if (auto self = weak.lock()) self->interrupt(concat("rank ", self->rank_, " was interrupted: ", reason));
    });
}

EventPtr Runtime::submit(const EventPtr& previous_event, std::function<void()> body, bool poison_on_failure) {
    check_usable();
    auto done = new_event();
    const int num_threads = num_threads_.load();
    auto self = shared_from_this();
    stream_->submit(
        [self, previous = previous_event, body = std::move(body), done, num_threads, poison_on_failure]() mutable {
            std::exception_ptr error;
            try {
                if (previous) previous->wait();
                if (at::get_num_threads() != num_threads) at::set_num_threads(num_threads);
                self->check_usable();
                body();
            } catch (const GroupMismatch&) {
                error = std::current_exception();  // every rank raises it; the ranks stay in step
            } catch (const std::invalid_argument&) {
                error = std::current_exception();
            } catch (const std::exception& failure) {
                error = std::current_exception();
                if (poison_on_failure) self->fail(failure.what());
            }
            // Drop the operation's tensors before the waiter resumes: freeing a tensor that Python once owned takes the
            // GIL, which the waiter may hold again once it stops waiting. This may also drop the last reference to the
            // runtime (`self`), so nothing below touches it.
            body = nullptr;
            previous.reset();
            self.reset();
            done->complete(error);
        });
    return done;
}

EventPtr Runtime::launch(bool async, std::function<void()> body) {
    check_usable();
    if (!async && !has_queued_work()) {
        try {
            if (at::get_num_threads() != num_threads_.load()) at::set_num_threads(num_threads_.load());
            body();
        } catch (const Interrupted& interrupted) {
            interrupt(concat("rank ", rank_, " was interrupted: ", interrupted.what()));
            throw;
        }
        return nullptr;
    }
    auto done = submit(nullptr, std::move(body), /*poison_on_failure=*/false);
    if (!async) done->wait();
    return done;
}

// ---------------------------------------------------------------------------------------------------------------
// Process exit

void shutdown_all_runtimes() {
    std::vector<std::shared_ptr<Runtime>> live;
    {
        std::lock_guard<std::mutex> lock(registry_mutex());
        for (auto& weak : registry())
            if (auto runtime = weak.lock()) live.push_back(runtime);
        registry().clear();
    }
    for (auto& runtime : live) {
        try {
            if (runtime->has_queued_work())
                runtime->interrupt(concat("rank ", runtime->rank(), " is exiting with operations in flight"));
            runtime->destroy();
        } catch (...) {
        }
    }
}

}  // namespace mtdeepep
