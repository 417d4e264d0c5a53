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

HostPool::~HostPool() {
    for (auto& [bytes, ptr] : cached_) std::free(ptr);
}

at::Tensor HostPool::empty(at::IntArrayRef sizes, at::ScalarType dtype) {
    int64_t numel = 1;
    for (int64_t s : sizes) numel *= s;
    const size_t bytes = static_cast<size_t>(numel) * c10::elementSize(dtype);
    if (bytes < kPooledMinimum) return at::empty(sizes, at::TensorOptions().dtype(dtype));
    const size_t rounded = (bytes + kHugePage - 1) / kHugePage * kHugePage;
    void* ptr = nullptr;
    {
        std::lock_guard<std::mutex> lock(mutex_);
        auto hit = cached_.find(rounded);
        if (hit != cached_.end()) {
            ptr = hit->second;
            cached_.erase(hit);
            cached_bytes_ -= rounded;
        }
    }
    if (ptr == nullptr) {
        if (posix_memalign(&ptr, kHugePage, rounded) != 0) throw std::bad_alloc();
        madvise(ptr, rounded, MADV_HUGEPAGE);  // advisory: fewer, larger page faults on first touch
    }
    auto self = shared_from_this();
    return at::from_blob(
        ptr, sizes, [self, rounded](void* p) { self->give_back(p, rounded); }, at::TensorOptions().dtype(dtype));
}

void HostPool::give_back(void* ptr, size_t bytes) {
    {
        std::lock_guard<std::mutex> lock(mutex_);
        if (cached_bytes_ + bytes <= max_cached_bytes_) {
            cached_.emplace(bytes, ptr);
            cached_bytes_ += bytes;
            return;
        }
    }
    std::free(ptr);
}

}  // namespace mtdeepep
