#include "kernels/cpu/low_latency.hpp"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>

// The extension is built for baseline x86-64 (SSE2); the hot loops are also compiled for AVX2 and picked at load
// time (GCC/Clang function multi-versioning). Without FMA, so results are the same bits on every CPU.
// Helpers are force-inlined so that each clone gets its own vectorised copy.
#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__)
#define MTDEEPEP_MULTIVERSION __attribute__((target_clones("avx2", "default")))
#define MTDEEPEP_INLINE inline __attribute__((always_inline))
#else
#define MTDEEPEP_MULTIVERSION
#define MTDEEPEP_INLINE inline
#endif

namespace mtdeepep::cpu::ll {

namespace {

constexpr float kE4M3Max = 448.0f;
constexpr float kAmaxFloor =
    1e-4f;                          // as upstream and refs.per_token_cast_to_fp8: an all-zero block gets a finite scale
constexpr int64_t kTokenGrain = 4;  // tokens per parallel task in the casts
constexpr int64_t kRowGrain = 16;   // rows per parallel task in the copies

MTDEEPEP_INLINE uint32_t float_bits(float value) {
    uint32_t bits;
    std::memcpy(&bits, &value, sizeof(bits));
    return bits;
}

MTDEEPEP_INLINE float bits_float(uint32_t bits) {
    float value;
    std::memcpy(&value, &bits, sizeof(value));
    return value;
}

MTDEEPEP_INLINE float bf16_to_float(uint16_t value) {
    return bits_float(static_cast<uint32_t>(value) << 16);
}

MTDEEPEP_INLINE uint16_t float_to_bf16(float value) {
    uint32_t bits = float_bits(value);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);  // quiet NaN
    bits += 0x7fffu + ((bits >> 16) & 1u);  // round to nearest even
    return static_cast<uint16_t>(bits >> 16);
}

// float32 -> float8_e4m3fn, round to nearest even, as torch's `.to(torch.float8_e4m3fn)`: magnitudes from 480 up
// (and inf, NaN) become NaN (0x7f); e4m3fn has no infinity. Branch-free (masks, no selects) so that loops over it
// vectorise.
MTDEEPEP_INLINE uint8_t float_to_e4m3(float value) {
    const uint32_t bits = float_bits(value);
    const uint32_t sign = (bits >> 24) & 0x80u;
    const uint32_t magnitude = bits & 0x7fffffffu;
    // Normal range (>= 2^-6): rebias the exponent from 127 to 7 and round the mantissa from 23 to 3 bits.
    const uint32_t normal =
        (magnitude + (static_cast<uint32_t>(7 - 127) << 23) + 0x7ffffu + ((magnitude >> 20) & 1u)) >> 20;
    // Subnormal range (spacing 2^-9): adding 2^14, whose float32 ulp is 2^-9, rounds to the nearest multiple.
    const uint32_t subnormal = float_bits(bits_float(magnitude) + 16384.0f) - float_bits(16384.0f);
    const uint32_t is_subnormal = 0u - static_cast<uint32_t>(magnitude < 0x3c800000u);  // below 2^-6
    const uint32_t is_nan = 0u - static_cast<uint32_t>(magnitude >= 0x43f00000u);       // 480 and up
    const uint32_t finite = (subnormal & is_subnormal) | (normal & ~is_subnormal);
    return static_cast<uint8_t>(((0x7fu & is_nan) | (finite & ~is_nan)) | sign);
}

// The smallest power of two >= value (value positive and normal), computed on the bits so it is exact.
MTDEEPEP_INLINE float power_of_two_ceil(float value) {
    const uint32_t bits = float_bits(value);
    const uint32_t exponent = (bits >> 23) & 0xffu;
    const bool exact = (bits & 0x7fffffu) == 0;
    return bits_float((exponent + (exact ? 0u : 1u)) << 23);
}

inline uint8_t ue8m0_of(float power_of_two) {
    return static_cast<uint8_t>((float_bits(power_of_two) >> 23) & 0xffu);
}

// The block's amax as float bits: for non-negative floats the bit patterns order like the values, and an integer
// max reduction vectorises (a float one would need -ffast-math). NaN sorts above infinity, so it propagates.
MTDEEPEP_INLINE uint32_t amax_bits(const uint16_t* x) {
    uint32_t result = 0;
    for (int i = 0; i < kScaleBlock; ++i) result = std::max(result, (static_cast<uint32_t>(x[i]) << 16) & 0x7fffffffu);
    return result;
}

MTDEEPEP_INLINE void cast_block(const uint16_t* x, bool round_scale, uint8_t* e4m3, float* scale_out) {
    const float amax = bits_float(amax_bits(x));
    float scale = (std::isnan(amax) ? amax : std::max(amax, kAmaxFloor)) / kE4M3Max;
    if (round_scale && std::isfinite(scale)) scale = power_of_two_ceil(scale);
    // Divide (not multiply by the inverse) to round exactly as the reference does.
    for (int i = 0; i < kScaleBlock; ++i) e4m3[i] = float_to_e4m3(bf16_to_float(x[i]) / scale);
    *scale_out = scale;
}

MTDEEPEP_MULTIVERSION
void cast_tokens(const uint16_t* x, int64_t x_stride, int64_t begin, int64_t end, int hidden, bool round_scale,
                 uint8_t* e4m3, float* scales) {
    const int num_scales = hidden / kScaleBlock;
    for (int64_t t = begin; t < end; ++t)
        for (int s = 0; s < num_scales; ++s)
            cast_block(x + t * x_stride + s * kScaleBlock, round_scale,
                       e4m3 + t * hidden + static_cast<int64_t>(s) * kScaleBlock, scales + t * num_scales + s);
}

MTDEEPEP_MULTIVERSION
void combine_tokens(const int64_t* topk_idx, const float* weights, int64_t begin, int64_t end, int num_topk, int hidden,
                    const uint16_t* rows, int num_max_tokens, uint16_t* out, float* acc) {
    for (int64_t t = begin; t < end; ++t) {
        std::fill(acc, acc + hidden, 0.0f);
        for (int k = 0; k < num_topk; ++k) {
            const int64_t expert = topk_idx[t * num_topk + k];
            if (expert < 0) continue;
            const float weight = weights[t * num_topk + k];
            const uint16_t* row = rows + (expert * num_max_tokens + t) * hidden;
            for (int h = 0; h < hidden; ++h) acc[h] += weight * bf16_to_float(row[h]);
        }
        uint16_t* dst = out + t * hidden;
        for (int h = 0; h < hidden; ++h) dst[h] = float_to_bf16(acc[h]);
    }
}

}  // namespace

void cast_to_fp8(const uint16_t* x, int64_t x_stride, int num_tokens, int hidden, bool round_scale, uint8_t* e4m3,
                 float* scales) {
    at::parallel_for(0, num_tokens, kTokenGrain, [&](int64_t begin, int64_t end) {
        cast_tokens(x, x_stride, begin, end, hidden, round_scale, e4m3, scales);
    });
}

void write_dispatch_rows(const DispatchPayload& payload, const RowCopy* rows, size_t n, const DispatchSlots& slots) {
    const int64_t rt = slots.rows_per_expert;
    const int num_packed = (payload.num_scales + kScalesPerPack - 1) / kScalesPerPack;
    at::parallel_for(0, static_cast<int64_t>(n), kRowGrain, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
            const RowCopy& row = rows[i];
            const int64_t dst_row = static_cast<int64_t>(row.expert) * rt + row.slot;
            std::memcpy(slots.x + dst_row * payload.row_bytes, payload.x + row.row * payload.x_stride,
                        payload.row_bytes);
            slots.src_info[dst_row] = row.token;
            if (payload.scales == nullptr) continue;
            const float* scales = payload.scales + row.row * payload.scale_stride;
            if (!payload.use_ue8m0) {
                // Column-major per expert: scale s of row r at [s * RT + r].
                float* dst =
                    static_cast<float*>(slots.scales) + static_cast<int64_t>(row.expert) * payload.num_scales * rt;
                for (int s = 0; s < payload.num_scales; ++s) dst[s * rt + row.slot] = scales[s];
                continue;
            }
            // UE8M0: exponent bytes of blocks 4p..4p+3 in int32 p (little endian), unused bytes 0.
            int32_t* dst = static_cast<int32_t*>(slots.scales) + static_cast<int64_t>(row.expert) * num_packed * rt;
            for (int p = 0; p < num_packed; ++p) {
                uint32_t packed = 0;
                for (int j = 0; j < kScalesPerPack; ++j) {
                    const int s = p * kScalesPerPack + j;
                    if (s < payload.num_scales) packed |= static_cast<uint32_t>(ue8m0_of(scales[s])) << (8 * j);
                }
                dst[p * rt + row.slot] = static_cast<int32_t>(packed);
            }
        }
    });
}

namespace {
size_t align_up(size_t value, size_t alignment) {
    return (value + alignment - 1) / alignment * alignment;
}
}  // namespace

size_t dispatch_message_bytes(size_t row_bytes, int num_scales) {
    return align_up(sizeof(MessageHeader) + row_bytes + sizeof(float) * num_scales, 8);
}

size_t combine_message_bytes(int hidden) {
    return align_up(sizeof(MessageHeader) + sizeof(uint16_t) * hidden, 8);
}

void pack_dispatch_messages(const DispatchPayload& payload, const RowCopy* rows, size_t n, uint8_t* out,
                            size_t message_bytes) {
    at::parallel_for(0, static_cast<int64_t>(n), kRowGrain, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
            uint8_t* message = out + i * message_bytes;
            const MessageHeader header{rows[i].token, rows[i].expert};
            std::memcpy(message, &header, sizeof(header));
            std::memcpy(message + sizeof(header), payload.x + rows[i].row * payload.x_stride, payload.row_bytes);
            if (payload.scales != nullptr)
                std::memcpy(message + sizeof(header) + payload.row_bytes,
                            payload.scales + rows[i].row * payload.scale_stride, sizeof(float) * payload.num_scales);
        }
    });
}

void group_by_expert(const int64_t* topk_idx, int num_tokens, int num_topk, int num_experts,
                     std::vector<int32_t>& offsets, std::vector<int32_t>& tokens) {
    offsets.assign(num_experts + 1, 0);
    const int64_t num_slots = static_cast<int64_t>(num_tokens) * num_topk;
    for (int64_t i = 0; i < num_slots; ++i)
        if (topk_idx[i] >= 0) ++offsets[topk_idx[i] + 1];
    for (int e = 0; e < num_experts; ++e) offsets[e + 1] += offsets[e];
    tokens.resize(offsets[num_experts]);
    std::vector<int32_t> cursor(offsets.begin(), offsets.end() - 1);
    for (int64_t i = 0; i < num_slots; ++i)
        if (topk_idx[i] >= 0) tokens[cursor[topk_idx[i]]++] = static_cast<int32_t>(i / num_topk);
}

void copy_rows(const uint8_t* src, int64_t src_stride, const int64_t* src_row, uint8_t* dst, int64_t dst_stride,
               const int64_t* dst_row, size_t n, size_t row_bytes) {
    at::parallel_for(0, static_cast<int64_t>(n), kRowGrain, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
            const int64_t s = src_row != nullptr ? src_row[i] : i;
            const int64_t d = dst_row != nullptr ? dst_row[i] : i;
            std::memcpy(dst + d * dst_stride, src + s * src_stride, row_bytes);
        }
    });
}

void weighted_combine(const int64_t* topk_idx, const float* weights, int num_tokens, int num_topk, int hidden,
                      const uint16_t* rows, int num_max_tokens, uint16_t* out) {
    at::parallel_for(0, num_tokens, kTokenGrain, [&](int64_t begin, int64_t end) {
        std::vector<float> acc(hidden);
        combine_tokens(topk_idx, weights, begin, end, num_topk, hidden, rows, num_max_tokens, out, acc.data());
    });
}

}  // namespace mtdeepep::cpu::ll
