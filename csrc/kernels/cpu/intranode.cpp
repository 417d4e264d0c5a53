#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <vector>

#include "kernels/cpu/api.hpp"

namespace mtdeepep::cpu {

namespace {

// Rows per parallel task: large enough that the pool's dispatch cost vanishes next to the copies.
constexpr int64_t kRowGrain = 64;

inline float load_float(const uint16_t* p, int h, FloatKind kind) {
    if (kind == FloatKind::kBFloat16) {
        uint32_t bits = static_cast<uint32_t>(p[h]) << 16;
        float value;
        std::memcpy(&value, &bits, sizeof(value));
        return value;
    }
    return c10::detail::fp16_ieee_to_fp32_value(p[h]);
}

// Round to nearest even, NaN kept quiet; branch-free so that the store loop vectorises.
inline uint16_t to_bfloat16(float value) {
    uint32_t bits;
    std::memcpy(&bits, &value, sizeof(bits));
    const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    const uint32_t quiet_nan = (bits >> 16) | 0x40u;
    return static_cast<uint16_t>((bits & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

// The reductions are compute-bound (a widen and an add per element), so they are built for AVX-512 and AVX2 as
// well and the best version is picked at load time.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MTDEEPEP_VECTOR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define MTDEEPEP_VECTOR_CLONES
#endif

// acc[0:n) += row[0:n), row in `kind`.
MTDEEPEP_VECTOR_CLONES void add_row(FloatKind kind, const uint8_t* row, int n, float* __restrict__ acc) {
    if (kind == FloatKind::kFloat32) {
        const float* values = reinterpret_cast<const float*>(row);
        for (int h = 0; h < n; ++h) acc[h] += values[h];
    } else if (kind == FloatKind::kBFloat16) {
        const uint16_t* values = reinterpret_cast<const uint16_t*>(row);
        for (int h = 0; h < n; ++h) {
            uint32_t bits = static_cast<uint32_t>(values[h]) << 16;
            float value;
            std::memcpy(&value, &bits, sizeof(value));
            acc[h] += value;
        }
    } else {
        const uint16_t* values = reinterpret_cast<const uint16_t*>(row);
        for (int h = 0; h < n; ++h) acc[h] += load_float(values, h, kind);
    }
}

// acc[0:n) = row[0:n), widened to FP32.
MTDEEPEP_VECTOR_CLONES void load_row(FloatKind kind, const uint8_t* row, int n, float* __restrict__ acc) {
    if (kind == FloatKind::kFloat32) {
        std::memcpy(acc, row, sizeof(float) * n);
    } else if (kind == FloatKind::kBFloat16) {
        const uint16_t* values = reinterpret_cast<const uint16_t*>(row);
        for (int h = 0; h < n; ++h) {
            uint32_t bits = static_cast<uint32_t>(values[h]) << 16;
            std::memcpy(acc + h, &bits, sizeof(float));
        }
    } else {
        const uint16_t* values = reinterpret_cast<const uint16_t*>(row);
        for (int h = 0; h < n; ++h) acc[h] = load_float(values, h, kind);
    }
}

MTDEEPEP_VECTOR_CLONES void store_row(FloatKind kind, const float* __restrict__ acc, int n, uint8_t* out) {
    if (kind == FloatKind::kFloat32) {
        std::memcpy(out, acc, sizeof(float) * n);
    } else if (kind == FloatKind::kBFloat16) {
        uint16_t* values = reinterpret_cast<uint16_t*>(out);
        for (int h = 0; h < n; ++h) values[h] = to_bfloat16(acc[h]);
    } else {
        uint16_t* values = reinterpret_cast<uint16_t*>(out);
        for (int h = 0; h < n; ++h) values[h] = c10::detail::fp16_ieee_from_fp32_value(acc[h]);
    }
}

// Large copies into memory another core reads next: non-temporal stores skip reading the destination lines
// first (a third of a plain copy's memory traffic).
void stream_copy(uint8_t* dst, const uint8_t* src, size_t bytes) {
#if defined(__x86_64__)
    constexpr size_t kMinimum = 64 << 10;
    if (bytes >= kMinimum) {
        const size_t head = (16 - (reinterpret_cast<uintptr_t>(dst) & 15)) & 15;
        std::memcpy(dst, src, head);
        dst += head, src += head, bytes -= head;
        const size_t body = bytes / 64 * 64;
        for (size_t i = 0; i < body; i += 64) {
            const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
            const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
            const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
            const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
            _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
            _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
            _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
            _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
        }
        std::memcpy(dst + body, src + body, bytes - body);
        _mm_sfence();  // order the streamed stores before the barrier that publishes them
        return;
    }
#endif
    std::memcpy(dst, src, bytes);
}

inline void prefetch_head(const uint8_t* row) {
#if defined(__x86_64__)
    for (int line = 0; line < 4; ++line) _mm_prefetch(reinterpret_cast<const char*>(row) + 64 * line, _MM_HINT_T0);
#else
    (void)row;
#endif
}

inline void stream_fence() {
#if defined(__x86_64__)
    _mm_sfence();
#endif
}

#if defined(__x86_64__) && defined(__GNUC__)
// 8 bf16 values widened to FP32 (exact: a bf16 is the upper half of an FP32).
__attribute__((target("avx2"))) inline __m256 widen_bf16(const uint16_t* p) {
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

// 8 FP32 values rounded to bf16 as `to_bfloat16` (nearest even, NaN kept quiet), in the low 16 bits of each lane.
__attribute__((target("avx2"))) inline __m256i round_bf16(__m256 value) {
    const __m256i bits = _mm256_castps_si256(value);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i rounded =
        _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7fff)), lsb), 16);
    const __m256i quiet_nan = _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40));
    const __m256i magnitude = _mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff));
    const __m256i is_nan = _mm256_cmpgt_epi32(magnitude, _mm256_set1_epi32(0x7f800000));
    return _mm256_blendv_epi8(rounded, quiet_nan, is_nan);
}

// out[0:n) = sum of the N rows (in order, in FP32 registers), rounded to bf16: one pass, no accumulator in memory,
// and the output streamed (it is not read again here, and streaming skips reading its lines first). n % 16 == 0.
template <int N>
__attribute__((target("avx2"))) void reduce_bf16_avx2(const uint16_t* const* rows, int n, uint16_t* out, bool stream) {
    const uint16_t* r[N];
    for (int i = 0; i < N; ++i) r[i] = rows[i];
    for (int h = 0; h < n; h += 16) {
        if (h + 512 < n)
            for (int i = 0; i < N; ++i) _mm_prefetch(reinterpret_cast<const char*>(r[i] + h + 512), _MM_HINT_T0);
        __m256 lo = widen_bf16(r[0] + h), hi = widen_bf16(r[0] + h + 8);
        for (int i = 1; i < N; ++i) {
            lo = _mm256_add_ps(lo, widen_bf16(r[i] + h));
            hi = _mm256_add_ps(hi, widen_bf16(r[i] + h + 8));
        }
        // packus works per 128-bit lane: [lo0-3 hi0-3 | lo4-7 hi4-7], put back in order by the 64-bit permute.
        const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(round_bf16(lo), round_bf16(hi)), 0xd8);
        if (stream)
            _mm256_stream_si256(reinterpret_cast<__m256i*>(out + h), packed);
        else
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + h), packed);
    }
}

bool cpu_has_avx2() {
    static const bool has = __builtin_cpu_supports("avx2");
    return has;
}
#endif

// The fused bf16 reduction of `num_rows` rows (1-8) when the CPU and the shape allow it; false: use the general
// path. Summation order and rounding are the general path's.
// `stream`: store the output with non-temporal stores (large outputs, not read back soon by this core).
bool reduce_bf16_rows(const uint8_t* const* rows, int num_rows, int n, uint16_t* out, bool stream) {
#if defined(__x86_64__) && defined(__GNUC__)
    if (!cpu_has_avx2() || n % 16 != 0 || num_rows < 1 || num_rows > 8) return false;
    const auto* r = reinterpret_cast<const uint16_t* const*>(rows);
    stream = stream && (reinterpret_cast<uintptr_t>(out) & 31) == 0;
    switch (num_rows) {
        case 1:
            reduce_bf16_avx2<1>(r, n, out, stream);
            break;
        case 2:
            reduce_bf16_avx2<2>(r, n, out, stream);
            break;
        case 3:
            reduce_bf16_avx2<3>(r, n, out, stream);
            break;
        case 4:
            reduce_bf16_avx2<4>(r, n, out, stream);
            break;
        case 5:
            reduce_bf16_avx2<5>(r, n, out, stream);
            break;
        case 6:
            reduce_bf16_avx2<6>(r, n, out, stream);
            break;
        case 7:
            reduce_bf16_avx2<7>(r, n, out, stream);
            break;
        default:
            reduce_bf16_avx2<8>(r, n, out, stream);
            break;
    }
    return true;
#else
    (void)rows, (void)num_rows, (void)n, (void)out, (void)stream;
    return false;
#endif
}

inline size_t element_bytes(FloatKind kind) {
    return kind == FloatKind::kFloat32 ? 4 : 2;
}

}  // namespace

void write_dispatch_rows(const DispatchSource& src, const int32_t* tokens, size_t begin, size_t end,
                         const RowArrays& dst, size_t first_row, int64_t first_local_expert, int num_local_experts) {
    const size_t scale_row_bytes = src.num_scales * src.scale_element_bytes;
    at::parallel_for(static_cast<int64_t>(begin), static_cast<int64_t>(end), kRowGrain, [&](int64_t lo, int64_t hi) {
        for (int64_t i = lo; i < hi; ++i) {
            const int64_t t = tokens[i];
            const size_t row = first_row + (i - begin);
            std::memcpy(dst.x + row * src.x_row_bytes, src.x + t * src.x_token_stride, src.x_row_bytes);
            if (dst.scales != nullptr) {
                uint8_t* out = dst.scales + row * scale_row_bytes;
                const int64_t element = static_cast<int64_t>(src.scale_element_bytes);
                const uint8_t* first = src.scales + t * src.scale_token_stride * element;
                if (src.scale_column_stride == 1) {
                    std::memcpy(out, first, scale_row_bytes);  // row-major scales: one copy per row
                } else if (element == 4) {                     // column-major (upstream's layout): a strided gather
                    for (int s = 0; s < src.num_scales; ++s)
                        std::memcpy(out + 4 * s, first + s * src.scale_column_stride * 4, 4);
                } else {
                    for (int s = 0; s < src.num_scales; ++s)
                        std::memcpy(out + s * element, first + s * src.scale_column_stride * element, element);
                }
            }
            if (dst.topk_idx != nullptr) {
                for (int k = 0; k < src.num_topk; ++k) {
                    const int64_t expert = src.topk_idx[t * src.num_topk + k];
                    const int64_t local = expert - first_local_expert;
                    const bool is_local = expert >= 0 && local >= 0 && local < num_local_experts;
                    dst.topk_idx[row * src.num_topk + k] = is_local ? local : -1;
                    if (dst.topk_weights != nullptr)
                        dst.topk_weights[row * src.num_topk + k] =
                            is_local ? src.topk_weights[t * src.num_topk + k] : 0.0f;
                }
            }
            if (dst.src_idx != nullptr) dst.src_idx[row] = static_cast<int32_t>(t);
        }
    });
}

void copy_rows(const RowArrays& src, size_t src_row, const RowArrays& dst, size_t dst_row, size_t num_rows,
               size_t x_row_bytes, size_t scale_row_bytes, int num_topk) {
    if (num_rows == 0) return;
    // One contiguous block per field; the x block is split so that several threads share the bandwidth.
    const int64_t x_bytes = static_cast<int64_t>(num_rows * x_row_bytes);
    const int64_t chunk = 1 << 20;
    at::parallel_for(0, (x_bytes + chunk - 1) / chunk, 1, [&](int64_t lo, int64_t hi) {
        const int64_t first = lo * chunk, last = std::min(x_bytes, hi * chunk);
        stream_copy(dst.x + dst_row * x_row_bytes + first, src.x + src_row * x_row_bytes + first, last - first);
    });
    if (dst.scales != nullptr && scale_row_bytes > 0)
        std::memcpy(dst.scales + dst_row * scale_row_bytes, src.scales + src_row * scale_row_bytes,
                    num_rows * scale_row_bytes);
    if (dst.topk_idx != nullptr)
        std::memcpy(dst.topk_idx + dst_row * num_topk, src.topk_idx + src_row * num_topk,
                    num_rows * num_topk * sizeof(int64_t));
    if (dst.topk_weights != nullptr)
        std::memcpy(dst.topk_weights + dst_row * num_topk, src.topk_weights + src_row * num_topk,
                    num_rows * num_topk * sizeof(float));
    if (dst.src_idx != nullptr) std::memcpy(dst.src_idx + dst_row, src.src_idx + src_row, num_rows * sizeof(int32_t));
}

void combine_reduce(FloatKind kind, const CombineSources& sources, int num_tokens, int hidden, int num_topk,
                    const uint8_t* bias0, const uint8_t* bias1, uint8_t* out, float* out_weights) {
    // Columns are reduced in chunks that stay in L1 while every contribution is added (the general path).
    constexpr int kChunk = 512;
    const size_t element = element_bytes(kind);
    const size_t row_bytes = static_cast<size_t>(hidden) * element;
    const int num_ranks = sources.num_ranks;
    // An output larger than the caches is streamed to memory: its lines are not read before being written.
    const bool stream = static_cast<size_t>(num_tokens) * row_bytes >= (size_t(8) << 20);
    at::parallel_for(0, num_tokens, 16, [&](int64_t lo, int64_t hi) {
        alignas(64) float acc[kChunk];
        std::vector<const uint8_t*> rows, next;
        rows.reserve(num_ranks + 2);
        next.reserve(num_ranks + 2);
        auto token_rows = [&](int64_t t, std::vector<const uint8_t*>& into) {
            into.clear();
            const int32_t* head = sources.send_head + t * num_ranks;
            for (int r = 0; r < num_ranks; ++r)
                if (head[r] >= 0) into.push_back(sources.rows[r] + (sources.row_offset[r] + head[r]) * row_bytes);
            if (bias0 != nullptr) into.push_back(bias0 + t * row_bytes);
            if (bias1 != nullptr) into.push_back(bias1 + t * row_bytes);
        };
        if (lo < hi) token_rows(lo, next);
        for (int64_t t = lo; t < hi; ++t) {
            rows.swap(next);
            // The next token's rows lie elsewhere: start fetching their first lines while this one is reduced.
            if (t + 1 < hi) {
                token_rows(t + 1, next);
                for (const uint8_t* row : next) prefetch_head(row);
            }
            uint8_t* out_row = out + t * row_bytes;
            if (kind == FloatKind::kBFloat16 && reduce_bf16_rows(rows.data(), static_cast<int>(rows.size()), hidden,
                                                                 reinterpret_cast<uint16_t*>(out_row), stream)) {
                // fused: done
            } else {
                for (int h0 = 0; h0 < hidden; h0 += kChunk) {
                    const int n = std::min(kChunk, hidden - h0);
                    if (rows.empty()) {
                        std::fill(acc, acc + n, 0.0f);
                    } else {
                        load_row(kind, rows[0] + h0 * element, n, acc);
                        for (size_t i = 1; i < rows.size(); ++i) add_row(kind, rows[i] + h0 * element, n, acc);
                    }
                    store_row(kind, acc, n, out_row + h0 * element);
                }
            }
            if (out_weights == nullptr) continue;
            const int32_t* head = sources.send_head + t * num_ranks;
            float* weights = out_weights + t * num_topk;
            std::fill(weights, weights + num_topk, 0.0f);
            for (int r = 0; r < num_ranks; ++r) {
                if (head[r] < 0) continue;
                const float* row = sources.weight_rows[r] + (sources.row_offset[r] + head[r]) * num_topk;
                for (int k = 0; k < num_topk; ++k) weights[k] += row[k];
            }
        }
        stream_fence();  // the streamed output rows are visible to whichever thread reads them next
    });
}

void accumulate_rows(FloatKind kind, const uint8_t* rows, const float* weight_rows, const int32_t* tokens, size_t n,
                     int hidden, int num_topk, float* acc, float* acc_weights) {
    const size_t row_bytes = static_cast<size_t>(hidden) * element_bytes(kind);
    // A token appears at most once in one sender's list, so rows of one call never race on acc.
    at::parallel_for(0, static_cast<int64_t>(n), kRowGrain, [&](int64_t lo, int64_t hi) {
        for (int64_t k = lo; k < hi; ++k) {
            const int64_t t = tokens[k];
            add_row(kind, rows + k * row_bytes, hidden, acc + t * hidden);
            if (acc_weights == nullptr) continue;
            for (int j = 0; j < num_topk; ++j) acc_weights[t * num_topk + j] += weight_rows[k * num_topk + j];
        }
    });
}

void finish_accumulation(FloatKind kind, const float* acc, int num_tokens, int hidden, const uint8_t* bias0,
                         const uint8_t* bias1, uint8_t* out) {
    const size_t row_bytes = static_cast<size_t>(hidden) * element_bytes(kind);
    at::parallel_for(0, num_tokens, 16, [&](int64_t lo, int64_t hi) {
        std::vector<float> row(hidden);
        for (int64_t t = lo; t < hi; ++t) {
            std::memcpy(row.data(), acc + t * hidden, sizeof(float) * hidden);
            if (bias0 != nullptr) add_row(kind, bias0 + t * row_bytes, hidden, row.data());
            if (bias1 != nullptr) add_row(kind, bias1 + t * row_bytes, hidden, row.data());
            store_row(kind, row.data(), hidden, out + t * row_bytes);
        }
    });
}

}  // namespace mtdeepep::cpu
