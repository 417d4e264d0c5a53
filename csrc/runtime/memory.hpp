// Where outputs live.
//
// RegionArena hands out blocks of a rank's shared region. Dispatch outputs placed there are written by the
// senders directly (one copy), and stay valid while any tensor viewing them lives: each tensor's deleter holds
// the block, and the arena holds the mapping, so a view outlives `destroy()` and the Buffer itself. HostPool recycles
// large heap blocks on 2 MiB pages so that outputs allocated every step do not pay a page fault per 4 KiB each time.
#pragma once

#include <ATen/ATen.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>

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

class HostPool : public std::enable_shared_from_this<HostPool> {
  public:
    explicit HostPool(size_t max_cached_bytes) : max_cached_bytes_(max_cached_bytes) {}
    ~HostPool();
    at::Tensor empty(at::IntArrayRef sizes, at::ScalarType dtype);

  private:
    void give_back(void* ptr, size_t bytes);
    std::mutex mutex_;
    std::multimap<size_t, void*> cached_;
    size_t cached_bytes_ = 0;
    size_t max_cached_bytes_;
};

}  // namespace mtdeepep
