// The host side of the CUDA/MUSA executor for one Buffer on one rank: device memory (cudaMalloc), its IPC handles
// and the peers' opened ones, the host-mapped status block, and the pointer tables the kernels index. Everything
// else (tensors, streams, events, the caching allocator) stays with torch in Python (mtdeepep/engines/cuda.py): this
// class only owns raw memory and turns the device status word into messages.
//
// Lifetime: `destroy()` sets the abort word (every device wait ends), synchronises the device, closes the peers'
// IPC mappings, then frees. After a failure the peers may still write into this rank's memory for up to their own
// timeout (their kernels are bounded, not stopped), so a failed buffer's exported memory is quarantined instead of
// freed: released by a later construction or destroy once `2 * timeout + 1 s` passed (or at exit), never reused
// while a late peer write could land in it. A process that forked after creating the buffer must not call it (CUDA
// contexts do not survive fork); Python only destroys in the creating process.
//
// Memory shared with the peers (the normal and the low-latency buffers) is allocated in whole 2 MiB granules: CUDA
// IPC exports the whole underlying allocation, and a smaller cudaMalloc may share its granule with unrelated memory.
//
// Single-process mode (`connect_local`): the ranks are buffers of one process on one device, their peer tables
// filled with each other's device pointers instead of IPC handles; the same kernels then run concurrently on the
// ranks' streams (real concurrency, unlike processes time-sliced on one GPU).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/cuda/api.hpp"

namespace mtdeepep::gpu {

class DeviceBuffer {
  public:
    DeviceBuffer(int rank, int num_ranks, int64_t num_nvl_bytes, int64_t num_ll_bytes, double timeout_s, int device);
    ~DeviceBuffer();
    DeviceBuffer(const DeviceBuffer&) = delete;
    DeviceBuffer& operator=(const DeviceBuffer&) = delete;

    // ---- set-up ----
    // This rank's IPC handles (normal buffer, low-latency buffer) as one hex string, for the set-up exchange.
    std::string ipc_entry() const;
    // Opens every peer's buffers from their entries (this rank's own is used in place).
    void connect(const std::vector<std::string>& entries);
    // Single-process mode: every rank's normal and low-latency base addresses (this process, this device).
    void connect_local(const std::vector<uintptr_t>& nvl_bases, const std::vector<uintptr_t>& ll_bases);
    bool connected() const { return connected_; }

    // ---- state ----
    uint64_t status() const;      // the host-mapped status word: 0, or an error (error_message)
    uint64_t cause() const;       // kPeerFailed: the failed peer's error word
    int64_t detail(int i) const;  // overflow kinds: (rows, bound)
    // Clears a recoverable error (`is_recoverable`) once every kernel queued on `stream` finished (synchronises it).
    void clear_error(gpuStream_t stream);
    void abort();  // ends every device wait of this rank (the kernels report kAborted)
    void set_timeout(double timeout_s);
    void destroy();
    bool destroyed() const { return destroyed_; }

    // ---- what the launchers need ----
    Control control() const;
    Peers peers() const;
    LowLatencyPeers low_latency_peers() const;
    HostMapped* host_mapped() { return host_mapped_; }                // host address
    HostMapped* host_mapped_device() { return host_mapped_device_; }  // device address of the same block
    uint8_t* nvl_base() const { return nvl_base_; }
    size_t nvl_alloc_bytes() const { return nvl_alloc_bytes_; }
    uint8_t* ll_base() const { return ll_base_; }
    int64_t num_nvl_bytes() const { return num_nvl_bytes_; }
    int64_t num_ll_bytes() const { return num_ll_bytes_; }
    size_t ll_half_bytes() const { return ll_half_bytes_; }
    int rank() const { return rank_; }
    int num_ranks() const { return num_ranks_; }
    int device() const { return device_; }
    int num_sms() const { return num_sms_; }

  private:
    void release();
    void make_tables();  // the device copies of the peer tables, from peer_nvl_ / peer_ll_

    int rank_, num_ranks_, device_, num_sms_ = 0;
    int64_t num_nvl_bytes_, num_ll_bytes_;
    size_t nvl_alloc_bytes_ = 0, ll_alloc_bytes_ = 0, ll_half_bytes_ = 0;
    uint64_t timeout_ns_;
    int64_t clock_khz_ = 1;
    uint8_t* nvl_base_ = nullptr;  // this rank's normal buffer: NormalLayout control, then num_nvl_bytes
    uint8_t* ll_base_ = nullptr;   // this rank's low-latency buffer (null without one)
    uint64_t* status_ = nullptr;   // device word: the first error
    HostMapped* host_mapped_ = nullptr;
    HostMapped* host_mapped_device_ = nullptr;
    std::vector<uint8_t*> peer_nvl_, peer_ll_;  // every rank's buffers in this process (own ones included)
    bool peers_opened_ = false;                 // peer_nvl_ / peer_ll_ came from IPC handles (to be closed)
    uint8_t** nvl_table_ = nullptr;             // device copies of the tables
    uint8_t** ll_table_ = nullptr;
    uint64_t** poison_table_ = nullptr;
    bool connected_ = false, destroyed_ = false;
};

}  // namespace mtdeepep::gpu
