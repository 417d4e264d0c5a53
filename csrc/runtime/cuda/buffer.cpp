#include "runtime/cuda/buffer.hpp"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <stdexcept>

namespace mtdeepep::gpu {

namespace {

void check(gpuError_t error, const char* what) {
    if (error != gpuSuccess)
        throw std::runtime_error(std::string("mtdeepep: ") + what + " failed: " + gpuGetErrorString(error));
}

// Runs the calls of one method on the buffer's device, restoring the caller's.
class DeviceGuard {
  public:
    explicit DeviceGuard(int device) {
        check(gpuGetDevice(&previous_), "getting the current device");
        if (previous_ != device) check(gpuSetDevice(device), "setting the device");
    }
    ~DeviceGuard() { gpuSetDevice(previous_); }

  private:
    int previous_ = 0;
};

uint64_t checked_timeout_ns(double timeout_s) {
    if (!std::isfinite(timeout_s) || timeout_s <= 0)
        throw std::invalid_argument("mtdeepep: the timeout must be a finite number of seconds > 0");
    return static_cast<uint64_t>(timeout_s * 1e9);
}

std::string to_hex(const void* data, size_t bytes) {
    static const char* digits = "0123456789abcdef";
    std::string out;
    out.reserve(2 * bytes);
    for (size_t i = 0; i < bytes; ++i) {
        const uint8_t byte = static_cast<const uint8_t*>(data)[i];
        out.push_back(digits[byte >> 4]);
        out.push_back(digits[byte & 15]);
    }
    return out;
}

void from_hex(const std::string& text, void* data, size_t bytes) {
    if (text.size() != 2 * bytes) throw std::invalid_argument("mtdeepep: malformed IPC handle in the set-up entry");
    auto value = [](char c) -> int {
        if (c >= '0' && c <= '9') return c - '0';
        if (c >= 'a' && c <= 'f') return c - 'a' + 10;
        throw std::invalid_argument("mtdeepep: malformed IPC handle in the set-up entry");
    };
    for (size_t i = 0; i < bytes; ++i)
        static_cast<uint8_t*>(data)[i] = static_cast<uint8_t>(value(text[2 * i]) << 4 | value(text[2 * i + 1]));
}

constexpr size_t kIpcGranule = size_t(2) << 20;  // CUDA IPC shares whole allocations: export whole 2 MiB granules

// Memory of failed buffers that peers might still write (see buffer.hpp), with the time after which none can.
struct Quarantined {
    void* memory;
    int device;
    std::chrono::steady_clock::time_point release_after;
};
std::mutex quarantine_mutex;
std::vector<Quarantined>& quarantine() {
    static auto* entries = new std::vector<Quarantined>();  // never destroyed: process exit releases device memory
    return *entries;
}

void quarantine_memory(void* memory, int device, double timeout_s) {
    if (memory == nullptr) return;
    const auto grace = std::chrono::duration<double>(2 * timeout_s + 1.0);
    std::lock_guard<std::mutex> lock(quarantine_mutex);
    quarantine().push_back(
        {memory, device,
         std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(grace)});
}

// Frees the quarantined memory whose grace period is over (on its own device).
void release_quarantine() {
    std::lock_guard<std::mutex> lock(quarantine_mutex);
    auto& entries = quarantine();
    const auto now = std::chrono::steady_clock::now();
    for (size_t i = 0; i < entries.size();) {
        if (entries[i].release_after > now) {
            ++i;
            continue;
        }
        int previous = 0;
        gpuGetDevice(&previous);
        gpuSetDevice(entries[i].device);
        gpuFree(entries[i].memory);
        gpuSetDevice(previous);
        entries[i] = entries.back();
        entries.pop_back();
    }
}

}  // namespace

DeviceBuffer::DeviceBuffer(int rank, int num_ranks, int64_t num_nvl_bytes, int64_t num_ll_bytes, double timeout_s,
                           int device)
    : rank_(rank),
      num_ranks_(num_ranks),
      device_(device),
      num_nvl_bytes_(num_nvl_bytes),
      num_ll_bytes_(num_ll_bytes),
      timeout_ns_(checked_timeout_ns(timeout_s)) {
    if (num_ranks < 1 || rank < 0 || rank >= num_ranks)
        throw std::invalid_argument("mtdeepep: invalid rank " + std::to_string(rank) + " of " +
                                    std::to_string(num_ranks));
    if (num_nvl_bytes < 0 || num_ll_bytes < 0) throw std::invalid_argument("mtdeepep: buffer sizes must be >= 0");
    DeviceGuard guard(device_);
    release_quarantine();
    try {
        load_all_kernels();  // never at a first launch while this process's kernels wait for peers (api.hpp)
        check(gpuDeviceGetAttribute(&num_sms_, gpuDevAttrMultiProcessorCount, device_), "reading the SM count");
#if defined(MTDEEPEP_MUSA)
        int khz = 0;
        check(musaDeviceGetAttribute(&khz, musaDevAttrClockRate, device_), "reading the clock rate");
        clock_khz_ = khz > 0 ? khz : 1;
#endif
        nvl_alloc_bytes_ = align_up(
            NormalLayout(num_ranks).control_bytes + align_up(static_cast<size_t>(num_nvl_bytes), 16), kIpcGranule);
        check(gpuMalloc(reinterpret_cast<void**>(&nvl_base_), nvl_alloc_bytes_), "allocating the normal buffer");
        check(gpuMemset(nvl_base_, 0, NormalLayout(num_ranks).control_bytes), "clearing the normal buffer");
        if (num_ll_bytes > 0) {
            const size_t control = LowLatencyControl(num_ranks).bytes;
            if (static_cast<size_t>(num_ll_bytes) <= control)
                throw std::invalid_argument("mtdeepep: num_rdma_bytes is smaller than the low-latency control area (" +
                                            std::to_string(control) + " bytes)");
            ll_half_bytes_ = (static_cast<size_t>(num_ll_bytes) - control) / 2 / kAlignment * kAlignment;
            ll_alloc_bytes_ = align_up(control + 2 * ll_half_bytes_, kIpcGranule);
            check(gpuMalloc(reinterpret_cast<void**>(&ll_base_), ll_alloc_bytes_), "allocating the low-latency buffer");
            check(gpuMemset(ll_base_, 0, ll_alloc_bytes_), "clearing the low-latency buffer");
        }
        check(gpuMalloc(reinterpret_cast<void**>(&status_), 256), "allocating the status word");
        check(gpuMemset(status_, 0, 256), "clearing the status word");
        check(gpuHostAlloc(reinterpret_cast<void**>(&host_mapped_), sizeof(HostMapped),
                           gpuHostAllocMapped | gpuHostAllocPortable),
              "allocating the host-mapped block");
        std::memset(host_mapped_, 0, sizeof(HostMapped));
        host_mapped_->num_recv_tokens = -1;
        check(gpuHostGetDevicePointer(reinterpret_cast<void**>(&host_mapped_device_), host_mapped_, 0),
              "mapping the host block");
        check(gpuDeviceSynchronize(), "clearing the buffers");
    } catch (...) {
        release();
        throw;
    }
}

DeviceBuffer::~DeviceBuffer() {
    try {
        destroy();
    } catch (...) {
    }
}

std::string DeviceBuffer::ipc_entry() const {
    if (destroyed_) throw std::runtime_error("mtdeepep: the buffer was destroyed");
    DeviceGuard guard(device_);
    gpuIpcMemHandle_t nvl{}, ll{};
    check(gpuIpcGetMemHandle(&nvl, nvl_base_), "getting the normal buffer's IPC handle");
    if (ll_base_ != nullptr) check(gpuIpcGetMemHandle(&ll, ll_base_), "getting the low-latency buffer's IPC handle");
    return to_hex(&nvl, sizeof(nvl)) + ":" + (ll_base_ != nullptr ? to_hex(&ll, sizeof(ll)) : std::string("-"));
}

void DeviceBuffer::connect(const std::vector<std::string>& entries) {
    if (destroyed_) throw std::runtime_error("mtdeepep: the buffer was destroyed");
    if (connected_) throw std::logic_error("mtdeepep: the buffer is already connected");
    if (static_cast<int>(entries.size()) != num_ranks_)
        throw std::invalid_argument("mtdeepep: expected one set-up entry per rank");
    DeviceGuard guard(device_);
    peer_nvl_.assign(num_ranks_, nullptr);
    peer_ll_.assign(num_ranks_, nullptr);
    peers_opened_ = true;
    for (int r = 0; r < num_ranks_; ++r) {
        if (r == rank_) {
            peer_nvl_[r] = nvl_base_;
            peer_ll_[r] = ll_base_;
            continue;
        }
        const std::string& entry = entries[r];
        const size_t colon = entry.find(':');
        if (colon == std::string::npos) throw std::invalid_argument("mtdeepep: malformed set-up entry");
        gpuIpcMemHandle_t handle{};
        from_hex(entry.substr(0, colon), &handle, sizeof(handle));
        void* opened = nullptr;
        check(gpuIpcOpenMemHandle(&opened, handle, gpuIpcMemLazyEnablePeerAccess),
              ("opening rank " + std::to_string(r) + "'s normal buffer").c_str());
        peer_nvl_[r] = static_cast<uint8_t*>(opened);
        const std::string ll = entry.substr(colon + 1);
        if ((ll == "-") != (ll_base_ == nullptr))
            throw std::invalid_argument("mtdeepep: ranks disagree on whether the buffer has a low-latency area");
        if (ll != "-") {
            from_hex(ll, &handle, sizeof(handle));
            check(gpuIpcOpenMemHandle(&opened, handle, gpuIpcMemLazyEnablePeerAccess),
                  ("opening rank " + std::to_string(r) + "'s low-latency buffer").c_str());
            peer_ll_[r] = static_cast<uint8_t*>(opened);
        }
    }
    make_tables();
}

void DeviceBuffer::connect_local(const std::vector<uintptr_t>& nvl_bases, const std::vector<uintptr_t>& ll_bases) {
    if (destroyed_) throw std::runtime_error("mtdeepep: the buffer was destroyed");
    if (connected_) throw std::logic_error("mtdeepep: the buffer is already connected");
    if (static_cast<int>(nvl_bases.size()) != num_ranks_ || static_cast<int>(ll_bases.size()) != num_ranks_)
        throw std::invalid_argument("mtdeepep: expected one base address per rank");
    if (nvl_bases[rank_] != reinterpret_cast<uintptr_t>(nvl_base_) ||
        ll_bases[rank_] != reinterpret_cast<uintptr_t>(ll_base_))
        throw std::invalid_argument("mtdeepep: the local peer table does not hold this rank's own buffers");
    for (int r = 0; r < num_ranks_; ++r)
        if (nvl_bases[r] == 0 || ((ll_bases[r] == 0) != (ll_base_ == nullptr)))
            throw std::invalid_argument("mtdeepep: ranks disagree on whether the buffer has a low-latency area");
    DeviceGuard guard(device_);
    peers_opened_ = false;
    peer_nvl_.assign(num_ranks_, nullptr);
    peer_ll_.assign(num_ranks_, nullptr);
    for (int r = 0; r < num_ranks_; ++r) {
        peer_nvl_[r] = reinterpret_cast<uint8_t*>(nvl_bases[r]);
        peer_ll_[r] = reinterpret_cast<uint8_t*>(ll_bases[r]);
    }
    make_tables();
}

void DeviceBuffer::make_tables() {
    std::vector<uint64_t*> poison(num_ranks_);
    const size_t poison_offset = NormalLayout(num_ranks_).poison;
    for (int r = 0; r < num_ranks_; ++r) poison[r] = reinterpret_cast<uint64_t*>(peer_nvl_[r] + poison_offset);
    const size_t table_bytes = sizeof(void*) * num_ranks_;
    check(gpuMalloc(reinterpret_cast<void**>(&nvl_table_), table_bytes), "allocating the peer table");
    check(gpuMalloc(reinterpret_cast<void**>(&ll_table_), table_bytes), "allocating the peer table");
    check(gpuMalloc(reinterpret_cast<void**>(&poison_table_), table_bytes), "allocating the peer table");
    check(gpuMemcpy(nvl_table_, peer_nvl_.data(), table_bytes, gpuMemcpyHostToDevice), "copying the peer table");
    check(gpuMemcpy(ll_table_, peer_ll_.data(), table_bytes, gpuMemcpyHostToDevice), "copying the peer table");
    check(gpuMemcpy(poison_table_, poison.data(), table_bytes, gpuMemcpyHostToDevice), "copying the peer table");
    connected_ = true;
}

uint64_t DeviceBuffer::status() const {
    if (host_mapped_ == nullptr) return 0;
    return *reinterpret_cast<volatile uint64_t*>(&host_mapped_->status);
}

uint64_t DeviceBuffer::cause() const {
    if (host_mapped_ == nullptr) return 0;
    return *reinterpret_cast<volatile uint64_t*>(&host_mapped_->cause);
}

int64_t DeviceBuffer::detail(int i) const {
    if (host_mapped_ == nullptr || i < 0 || i > 1) return 0;
    return reinterpret_cast<volatile int64_t*>(host_mapped_->detail)[i];
}

void DeviceBuffer::clear_error(gpuStream_t stream) {
    const uint64_t code = status();
    if (code == 0) return;
    if (!is_recoverable(error_kind(code)))
        throw std::logic_error("mtdeepep: only an overflow leaves the buffer usable; this error is final");
    DeviceGuard guard(device_);
    // Every kernel of the failed operation (which all returned early) is done before the word is cleared.
    check(gpuMemsetAsync(status_, 0, sizeof(uint64_t), stream), "clearing the status word");
    check(gpuStreamSynchronize(stream), "clearing the status word");
    host_mapped_->cause = 0;
    host_mapped_->detail[0] = host_mapped_->detail[1] = 0;
    *reinterpret_cast<volatile uint64_t*>(&host_mapped_->status) = 0;
}

void DeviceBuffer::abort() {
    if (host_mapped_ != nullptr) *reinterpret_cast<volatile int32_t*>(&host_mapped_->abort) = 1;
}

void DeviceBuffer::set_timeout(double timeout_s) {
    timeout_ns_ = checked_timeout_ns(timeout_s);
}

Control DeviceBuffer::control() const {
    if (destroyed_) throw std::runtime_error("mtdeepep: the buffer was destroyed");
    if (!connected_) throw std::runtime_error("mtdeepep: the buffer is not set up");
    Control c{};
    c.status = status_;
    c.host_status = &host_mapped_device_->status;
    c.host_abort = &host_mapped_device_->abort;
    c.host_cause = &host_mapped_device_->cause;
    c.host_detail = host_mapped_device_->detail;
    c.poison = reinterpret_cast<uint64_t*>(nvl_base_ + NormalLayout(num_ranks_).poison);
    c.peer_poison = poison_table_;
    c.timeout_ns = timeout_ns_;
    c.clock_khz = clock_khz_;
    c.rank = rank_;
    c.num_ranks = num_ranks_;
    return c;
}

Peers DeviceBuffer::peers() const {
    return {nvl_table_, static_cast<size_t>(num_nvl_bytes_)};
}

LowLatencyPeers DeviceBuffer::low_latency_peers() const {
    if (ll_base_ == nullptr) throw std::invalid_argument("mtdeepep: this buffer has no low-latency area");
    return {ll_table_, ll_half_bytes_};
}

void DeviceBuffer::destroy() {
    if (destroyed_) return;
    destroyed_ = true;
    abort();  // a kernel still waiting for a peer ends now
    DeviceGuard guard(device_);
    gpuDeviceSynchronize();
    if (status() != 0 && !is_recoverable(error_kind(status())) && connected_ && peers_opened_) {
        // Peers may still write into this rank's memory until their own bounded waits end: keep it out of reuse.
        const double timeout_s = static_cast<double>(timeout_ns_) / 1e9;
        quarantine_memory(nvl_base_, device_, timeout_s);
        quarantine_memory(ll_base_, device_, timeout_s);
        nvl_base_ = ll_base_ = nullptr;
    }
    release();
    release_quarantine();
}

void DeviceBuffer::release() {
    for (int r = 0; r < static_cast<int>(peer_nvl_.size()) && peers_opened_; ++r) {
        if (r == rank_) continue;
        if (peer_nvl_[r] != nullptr) gpuIpcCloseMemHandle(peer_nvl_[r]);
        if (peer_ll_[r] != nullptr) gpuIpcCloseMemHandle(peer_ll_[r]);
    }
    peer_nvl_.clear();
    peer_ll_.clear();
    for (void* p : {static_cast<void*>(nvl_table_), static_cast<void*>(ll_table_), static_cast<void*>(poison_table_),
                    static_cast<void*>(status_), static_cast<void*>(nvl_base_), static_cast<void*>(ll_base_)})
        if (p != nullptr) gpuFree(p);
    nvl_table_ = ll_table_ = nullptr;
    poison_table_ = nullptr;
    status_ = nullptr;
    nvl_base_ = ll_base_ = nullptr;
    if (host_mapped_ != nullptr) gpuFreeHost(host_mapped_);
    host_mapped_ = host_mapped_device_ = nullptr;
    connected_ = false;
}

}  // namespace mtdeepep::gpu
