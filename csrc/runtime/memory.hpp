// Where outputs live.
//
// RegionArena hands out blocks of a rank's shared region. Dispatch outputs placed there are written by the
// senders directly (one copy), and stay valid while any tensor viewing them lives: each tensor's deleter holds
// the block, and the arena holds the mapping, so a view outlives `destroy()` and the Buffer itself. HostPool recycles
// large mapped blocks on 2 MiB pages so that outputs allocated every step do not pay a page fault per 4 KiB each time.
#pragma once

#include <ATen/ATen.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <vector>

namespace mtdeepep {

class RegionArena : public std::enable_shared_from_this<RegionArena> {
  public:
    // `mapping` keeps the region mapped for as long as the arena (and so any block held from it) lives.
    RegionArena(size_t num_bytes, std::shared_ptr<void> mapping) : mapping_(std::move(mapping)) {
        free_[0] = num_bytes;
    }

    struct Block {
        size_t offset = 0, size = 0;
    };
    // Takes the largest free block (possibly empty) for the duration of one operation.
    Block reserve_largest();
    // Gives back [offset + keep, offset + size) of a reservation, or all of it with keep = 0.
    void release(Block block, size_t keep = 0);
    // A reference-counted hold on [offset, offset + size): the bytes return to the arena when the last holder goes.
    // `headroom`: bytes that must stay free in one block while the hold lives (to stage the combine that will
    // consume these outputs); see `held_headroom`.
    std::shared_ptr<void> hold(Block block, size_t headroom = 0);
    // The largest headroom a live hold needs (0 when none): a new placement must leave it free.
    size_t held_headroom() const;

  private:
    void free_range(size_t offset, size_t size);
    std::shared_ptr<void> mapping_;
    mutable std::mutex mutex_;
    std::map<size_t, size_t> free_;    // offset -> size, coalesced
    std::multiset<size_t> headrooms_;  // one per live hold
};

// Pre-faulted host memory for large outputs (a page-faulting first touch costs more than the copy into it). Blocks
// are mapped directly (mmap, 2 MiB-aligned, huge pages advised), never from malloc's heap: freed blocks would stay
// in the heap's free lists, fragmented, and the process would grow over runs of varied sizes (issue 23, item 5).
// A freed output's block is kept for reuse: a request takes the smallest cached block of at least its size and at
// most twice it (so varied sizes reuse blocks instead of piling up one per size), and the cache keeps at most
// `max_cached_bytes` and `kMaxCachedBlocks` blocks, the least recently freed ones unmapped first.
class HostPool : public std::enable_shared_from_this<HostPool> {
  public:
    static constexpr size_t kMaxCachedBlocks = 16;
    explicit HostPool(size_t max_cached_bytes) : max_cached_bytes_(max_cached_bytes) {}
    ~HostPool();
    at::Tensor empty(at::IntArrayRef sizes, at::ScalarType dtype);
    size_t cached_bytes() const;

  private:
    struct Cached {
        size_t bytes;
        void* ptr;
        uint64_t freed;  // when it was given back (a counter): the oldest goes first
    };
    void give_back(void* ptr, size_t bytes);
    mutable std::mutex mutex_;
    std::vector<Cached> cached_;
    size_t cached_bytes_ = 0;
    uint64_t clock_ = 0;
    size_t max_cached_bytes_;
};

}  // namespace mtdeepep
