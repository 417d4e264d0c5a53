// Device-side building blocks shared by the CUDA/MUSA kernels: bounded waits that report into an error word instead
// of hanging, flags with release/acquire ordering across GPUs (peer memory opened through IPC), the "last block"
// completion pattern, warp-wide vectorised copies with a tail, and bit-exact float conversions.
#pragma once

#if defined(MTDEEPEP_MUSA)
#include <musa_fp16.h>
#else
#include <cuda_fp16.h>
#endif

#include <algorithm>
#include <stdexcept>

#include "kernels/cuda/api.hpp"

namespace mtdeepep::gpu {

constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;

// ---- time ----
// Nanoseconds from a clock every SM shares: %globaltimer on CUDA; MUSA has no PTX, so clock64() scaled by the clock
// rate the host passes (`Control::clock_khz`).
__device__ __forceinline__ uint64_t now_ns(const Control& control) {
#if defined(MTDEEPEP_MUSA)
    return static_cast<uint64_t>(clock64()) * 1000000ull / static_cast<uint64_t>(control.clock_khz);
#else
    (void)control;
    uint64_t ns;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
    return ns;
#endif
}

// ---- flags across GPUs ----
// Release: every write of this thread (and, after a __syncthreads, of its block) is visible system-wide before the
// flag. Acquire: reads after the flag see what the writer published. A spin reads the flag with relaxed loads
// (`load_relaxed`: no fence per iteration, which would serialise the SM's memory traffic) and fences once after it
// sees the value (`acquire_fence`). Volatile accesses plus system fences are what MUSA supports (no PTX there).
__device__ __forceinline__ void store_release(uint64_t* flag, uint64_t value) {
    __threadfence_system();
    *reinterpret_cast<volatile uint64_t*>(flag) = value;
}

__device__ __forceinline__ uint64_t load_relaxed(const uint64_t* flag) {
#if defined(MTDEEPEP_MUSA)
    return *reinterpret_cast<const volatile uint64_t*>(flag);
#else
    uint64_t value;
    asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(flag) : "memory");
    return value;
#endif
}

__device__ __forceinline__ void acquire_fence() {
    __threadfence_system();
}

__device__ __forceinline__ uint64_t load_acquire(const uint64_t* flag) {
    const uint64_t value = load_relaxed(flag);
    acquire_fence();
    return value;
}

__device__ __forceinline__ uint64_t load_volatile(const uint64_t* word) {
    return *reinterpret_cast<const volatile uint64_t*>(word);
}

// ---- errors ----
// The first failure of this rank wins the device status word (atomicCAS in device memory), then is mirrored into
// the host-mapped words the host polls. A rank's own failure (a timeout, the host's abort) poisons its peers: their
// poison word gets this rank's error word, so that their waits end at once (a peer that never arrives costs the
// group one timeout, not one per rank and phase) and they report who failed and why (a peer stopped by this rank's
// timeout names the rank that did not arrive, not this one). The peer this rank timed out on is not poisoned: it is
// the one most likely dead, and a dead process's memory must not be written. A rank stopped by a poison does not
// poison further (the first failure already told every peer); the overflow kinds poison nobody (every rank finds
// them alike).
__device__ __forceinline__ void report_error(const Control& control, ErrorKind kind, Phase phase, int peer,
                                             uint64_t cause = 0, int64_t detail_rows = 0, int64_t detail_bound = 0) {
    const uint64_t code = encode_error(kind, phase, peer, control.rank);
    if (atomicCAS(reinterpret_cast<unsigned long long*>(control.status), 0ull, static_cast<unsigned long long>(code)) !=
        0ull)
        return;
    *reinterpret_cast<volatile uint64_t*>(control.host_cause) = cause;
    reinterpret_cast<volatile int64_t*>(control.host_detail)[0] = detail_rows;
    reinterpret_cast<volatile int64_t*>(control.host_detail)[1] = detail_bound;
    __threadfence_system();  // the details before the status word the host reads first
    *reinterpret_cast<volatile uint64_t*>(control.host_status) = code;
    if (kind == ErrorKind::kTimeout || kind == ErrorKind::kAborted) {
        const int suspect = kind == ErrorKind::kTimeout ? peer : -1;
        for (int r = 0; r < control.num_ranks; ++r)
            if (r != control.rank && r != suspect)
                atomicCAS(reinterpret_cast<unsigned long long*>(control.peer_poison[r]), 0ull,
                          static_cast<unsigned long long>(code));
    }
    __threadfence_system();
}

// Whether this rank must stop: an earlier failure of this rank, the host's abort (interrupt, destroy), or a peer's
// poison. Reports the cause once (the first reporter wins).
__device__ __forceinline__ bool must_stop(const Control& control, Phase phase) {
    if (load_volatile(control.status) != 0) return true;
    if (*reinterpret_cast<const volatile int32_t*>(control.host_abort) != 0) {
        report_error(control, ErrorKind::kAborted, phase, control.rank);
        return true;
    }
    const uint64_t poison = load_volatile(control.poison);
    if (poison != 0) {
        report_error(control, ErrorKind::kPeerFailed, phase, error_rank(poison), poison);
        return true;
    }
    return false;
}

// Spins until `*flag >= target` (a flag that only grows), at most `control.timeout_ns`; false on timeout or stop,
// with the error reported (`peer`: whose flag this is). Called by one thread. The rank's own clock is checked before
// the poison: a rank whose own wait ran out reports the missing peer itself.
__device__ __forceinline__ bool wait_flag(const Control& control, const uint64_t* flag, uint64_t target, Phase phase,
                                          int peer) {
    if (load_relaxed(flag) >= target) {
        acquire_fence();
        return true;
    }
    const uint64_t start = now_ns(control);
    for (uint32_t spin = 1;; ++spin) {
        if (load_relaxed(flag) >= target) {
            acquire_fence();
            return true;
        }
        if ((spin & 63u) == 0) {
            if (now_ns(control) - start > control.timeout_ns) {
                report_error(control, ErrorKind::kTimeout, phase, peer);
                return false;
            }
            if (must_stop(control, phase)) return false;
        }
    }
}

// Every thread of the block: wait for the flags of all ranks (thread r waits for `flags[r * stride]`, rank r's).
// Returns false on every thread if any wait failed. `wait_ns` (optional, [R]): time each peer took to arrive. Run by
// one-block kernels only (see `wait_kernel` users): a block that spins holds its SM.
__device__ __forceinline__ bool block_wait_flags(const Control& control, const uint64_t* flags, int stride,
                                                 uint64_t target, Phase phase, int64_t* wait_ns = nullptr) {
    bool ok = true;
    for (int r = threadIdx.x; r < control.num_ranks; r += blockDim.x) {
        const uint64_t start = wait_ns != nullptr ? now_ns(control) : 0;
        ok = wait_flag(control, flags + static_cast<size_t>(r) * stride, target, phase, r) && ok;
        if (wait_ns != nullptr) atomicAdd(reinterpret_cast<unsigned long long*>(wait_ns + r), now_ns(control) - start);
    }
    return __syncthreads_and(ok) != 0;
}

// The last block of a grid to call this gets true, once every other block's writes (peer memory included) are
// visible system-wide; it resets the counter for the next launch. Called by every thread after the block's writes.
__device__ __forceinline__ bool last_block_done(uint32_t* counter) {
    __shared__ bool is_last;
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0) {
        const uint32_t arrived = atomicAdd(counter, 1u);
        is_last = arrived == gridDim.x - 1;
        if (is_last) *counter = 0;
    }
    __syncthreads();
    if (is_last) __threadfence_system();
    return is_last;
}

// ---- copies ----
// Warp-cooperative copy of `bytes` bytes: 16-byte vectors when both ends allow it, then 4-byte words, then a byte
// tail. Any row size works; rows of a multiple of 16 bytes at 16-byte-aligned addresses use the vector path only.
__device__ __forceinline__ void warp_copy(uint8_t* dst, const uint8_t* src, size_t bytes, int lane) {
    size_t done = 0;
    const uintptr_t alignment = reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src);
    if ((alignment & 15u) == 0) {
        const size_t n = bytes / 16;
        const int4* s = reinterpret_cast<const int4*>(src);
        int4* d = reinterpret_cast<int4*>(dst);
#pragma unroll 4
        for (size_t i = lane; i < n; i += kWarpSize) d[i] = s[i];
        done = n * 16;
    } else if ((alignment & 3u) == 0) {
        const size_t n = bytes / 4;
        const int32_t* s = reinterpret_cast<const int32_t*>(src);
        int32_t* d = reinterpret_cast<int32_t*>(dst);
        for (size_t i = lane; i < n; i += kWarpSize) d[i] = s[i];
        done = n * 4;
    }
    for (size_t i = done + lane; i < bytes; i += kWarpSize) dst[i] = src[i];
}

// ---- float conversions on the bits (the CPU kernels' rounding, bit for bit) ----
__device__ __forceinline__ float bf16_to_float(uint16_t value) {
    return __uint_as_float(uint32_t(value) << 16);
}

__device__ __forceinline__ uint16_t float_to_bf16(float value) {
    uint32_t bits = __float_as_uint(value);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);  // quiet NaN
    bits += 0x7fffu + ((bits >> 16) & 1u);  // round to nearest even
    return static_cast<uint16_t>(bits >> 16);
}

__device__ __forceinline__ float half_to_float(uint16_t value) {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(value)));
}

__device__ __forceinline__ uint16_t float_to_half(float value) {
    return static_cast<uint16_t>(__half_as_ushort(__float2half_rn(value)));
}

// One element of a row of `kind` at element index i, widened to FP32.
__device__ __forceinline__ float load_element(FloatKind kind, const uint8_t* row, size_t i) {
    if (kind == FloatKind::kFloat32) return reinterpret_cast<const float*>(row)[i];
    const uint16_t bits = reinterpret_cast<const uint16_t*>(row)[i];
    return kind == FloatKind::kBFloat16 ? bf16_to_float(bits) : half_to_float(bits);
}

__device__ __forceinline__ void store_element(FloatKind kind, uint8_t* row, size_t i, float value) {
    if (kind == FloatKind::kFloat32) {
        reinterpret_cast<float*>(row)[i] = value;
    } else {
        reinterpret_cast<uint16_t*>(row)[i] =
            kind == FloatKind::kBFloat16 ? float_to_bf16(value) : float_to_half(value);
    }
}

// float32 -> float8_e4m3fn bits, round to nearest even, as torch's `.to(torch.float8_e4m3fn)`: magnitudes from 480
// up (and inf, NaN) become NaN (0x7f); e4m3fn has no infinity. The same bit algorithm as kernels/cpu/low_latency.cpp.
__device__ __forceinline__ uint8_t float_to_e4m3(float value) {
    const uint32_t bits = __float_as_uint(value);
    const uint32_t sign = (bits >> 24) & 0x80u;
    const uint32_t magnitude = bits & 0x7fffffffu;
    if (magnitude >= 0x43f00000u) return static_cast<uint8_t>(0x7fu | sign);  // 480 and up, inf, NaN
    if (magnitude < 0x3c800000u) {                                            // below 2^-6: subnormal spacing 2^-9
        const uint32_t sub = __float_as_uint(__uint_as_float(magnitude) + 16384.0f) - __float_as_uint(16384.0f);
        return static_cast<uint8_t>(sub | sign);
    }
    const uint32_t normal =
        (magnitude + (static_cast<uint32_t>(7 - 127) << 23) + 0x7ffffu + ((magnitude >> 20) & 1u)) >> 20;
    return static_cast<uint8_t>(normal | sign);
}

// The smallest power of two >= value (positive, normal), exact on the bits.
__device__ __forceinline__ float power_of_two_ceil(float value) {
    const uint32_t bits = __float_as_uint(value);
    const uint32_t exponent = (bits >> 23) & 0xffu;
    return __uint_as_float((exponent + ((bits & 0x7fffffu) == 0 ? 0u : 1u)) << 23);
}

__device__ __forceinline__ float warp_max(float value) {
#pragma unroll
    for (int offset = kWarpSize / 2; offset > 0; offset >>= 1)
        value = fmaxf(value, __shfl_xor_sync(kFullMask, value, offset));
    return value;
}

__device__ __forceinline__ int warp_sum(int value) {
#pragma unroll
    for (int offset = kWarpSize / 2; offset > 0; offset >>= 1) value += __shfl_xor_sync(kFullMask, value, offset);
    return value;
}

// Exclusive prefix sum over the block (blockDim.x <= 1024, a multiple of 32); `total` gets the block's sum.
__device__ __forceinline__ int block_exclusive_scan(int value, int& total) {
    __shared__ int warp_totals[32];
    const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
    int inclusive = value;
#pragma unroll
    for (int offset = 1; offset < kWarpSize; offset <<= 1) {
        const int other = __shfl_up_sync(kFullMask, inclusive, offset);
        if (lane >= offset) inclusive += other;
    }
    if (lane == kWarpSize - 1) warp_totals[warp] = inclusive;
    __syncthreads();
    if (warp == 0) {
        const int num_warps = blockDim.x / kWarpSize;
        int t = lane < num_warps ? warp_totals[lane] : 0;
#pragma unroll
        for (int offset = 1; offset < kWarpSize; offset <<= 1) {
            const int other = __shfl_up_sync(kFullMask, t, offset);
            if (lane >= offset) t += other;
        }
        warp_totals[lane] = t;  // inclusive over warps
    }
    __syncthreads();
    total = warp_totals[blockDim.x / kWarpSize - 1];
    const int before = warp == 0 ? 0 : warp_totals[warp - 1];
    __syncthreads();  // warp_totals is reused by the next call
    return before + inclusive - value;
}

}  // namespace mtdeepep::gpu
