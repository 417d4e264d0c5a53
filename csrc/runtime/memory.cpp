#include "runtime/memory.hpp"

#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <new>

namespace mtdeepep {

RegionArena::Block RegionArena::reserve_largest() {
    std::lock_guard<std::mutex> lock(mutex_);
    auto best =
        std::max_element(free_.begin(), free_.end(), [](const auto& a, const auto& b) { return a.second < b.second; });
    if (best == free_.end()) return {};
    Block block{best->first, best->second};
    free_.erase(best);
    return block;
}

size_t RegionArena::held_headroom() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return headrooms_.empty() ? 0 : *headrooms_.rbegin();
}

void RegionArena::release(Block block, size_t keep) {
    if (block.size > keep) {
        std::lock_guard<std::mutex> lock(mutex_);
        free_range(block.offset + keep, block.size - keep);
    }
}

std::shared_ptr<void> RegionArena::hold(Block block, size_t headroom) {
    auto self = shared_from_this();
    {
        std::lock_guard<std::mutex> lock(mutex_);
        headrooms_.insert(headroom);
    }
    return std::shared_ptr<void>(nullptr, [self, block, headroom](void*) {
        {
            std::lock_guard<std::mutex> lock(self->mutex_);
            self->headrooms_.erase(self->headrooms_.find(headroom));
        }
        self->release(block);
    });
}

void RegionArena::free_range(size_t offset, size_t size) {
    if (size == 0) return;
    auto next = free_.lower_bound(offset);
    if (next != free_.end() && offset + size == next->first) {
        size += next->second;
        next = free_.erase(next);
    }
    if (next != free_.begin()) {
        auto previous = std::prev(next);
        if (previous->first + previous->second == offset) {
            previous->second += size;
            return;
        }
    }
    free_[offset] = size;
}

namespace {
constexpr size_t kHugePage = 2u << 20;
constexpr size_t kPooledMinimum = 1u << 20;  // smaller outputs gain nothing from pooling
}  // namespace

namespace {

// A 2 MiB-aligned anonymous mapping of `bytes` (a multiple of 2 MiB): huge pages can back it.
void* map_block(size_t bytes) {
    const size_t padded = bytes + kHugePage;
    void* raw = mmap(nullptr, padded, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) throw std::bad_alloc();
    const uintptr_t start = reinterpret_cast<uintptr_t>(raw);
    const uintptr_t aligned = (start + kHugePage - 1) / kHugePage * kHugePage;
    if (aligned > start) munmap(raw, aligned - start);  // the unaligned head
    const uintptr_t end = aligned + bytes, padded_end = start + padded;
    if (padded_end > end) munmap(reinterpret_cast<void*>(end), padded_end - end);  // and the tail
    void* block = reinterpret_cast<void*>(aligned);
    madvise(block, bytes, MADV_HUGEPAGE);  // advisory: fewer, larger page faults on first touch
    return block;
}

}  // namespace

HostPool::~HostPool() {
    for (const auto& block : cached_) munmap(block.ptr, block.bytes);
}

size_t HostPool::cached_bytes() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return cached_bytes_;
}

at::Tensor HostPool::empty(at::IntArrayRef sizes, at::ScalarType dtype) {
    int64_t numel = 1;
    for (int64_t s : sizes) numel *= s;
    const size_t bytes = static_cast<size_t>(numel) * c10::elementSize(dtype);
    if (bytes < kPooledMinimum) return at::empty(sizes, at::TensorOptions().dtype(dtype));
    const size_t rounded = (bytes + kHugePage - 1) / kHugePage * kHugePage;
    void* ptr = nullptr;
    size_t block_bytes = rounded;
    {
        std::lock_guard<std::mutex> lock(mutex_);
        // The smallest cached block that holds the request without wasting more than half of it.
        auto best = cached_.end();
        for (auto it = cached_.begin(); it != cached_.end(); ++it)
            if (it->bytes >= rounded && it->bytes <= 2 * rounded && (best == cached_.end() || it->bytes < best->bytes))
                best = it;
        if (best != cached_.end()) {
            ptr = best->ptr;
            block_bytes = best->bytes;
            cached_bytes_ -= best->bytes;
            cached_.erase(best);
        }
    }
    if (ptr == nullptr) ptr = map_block(rounded);
    auto self = shared_from_this();
    return at::from_blob(
        ptr, sizes, [self, block_bytes](void* p) { self->give_back(p, block_bytes); },
        at::TensorOptions().dtype(dtype));
}

void HostPool::give_back(void* ptr, size_t bytes) {
    std::vector<Cached> evicted;
    {
        std::lock_guard<std::mutex> lock(mutex_);
        cached_.push_back({bytes, ptr, ++clock_});
        cached_bytes_ += bytes;
        while (!cached_.empty() && (cached_bytes_ > max_cached_bytes_ || cached_.size() > kMaxCachedBlocks)) {
            auto oldest = std::min_element(cached_.begin(), cached_.end(),
                                           [](const Cached& a, const Cached& b) { return a.freed < b.freed; });
            evicted.push_back(*oldest);
            cached_bytes_ -= oldest->bytes;
            cached_.erase(oldest);
        }
    }
    for (const auto& block : evicted) munmap(block.ptr, block.bytes);  // outside the lock
}

}  // namespace mtdeepep
