// Low-latency CPU kernels: raw pointers and sizes only, no ATen tensors. Threading comes from ATen's intra-op
// pool (at::parallel_for), which follows torch.set_num_threads().
//
// Legend: T tokens, H hidden, S = ceil(H / 128) scale blocks, K top-k slots, E_local experts of one rank,
// RT = num_ranks * num_max_dispatch_tokens_per_rank rows per local expert.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace mtdeepep::cpu::ll {

constexpr int kScaleBlock = 128;   // channels per FP8 scale
constexpr int kScalesPerPack = 4;  // UE8M0 exponents per int32

// ---- FP8 ----
// Per-token, per-128-channel E4M3 cast of bfloat16 rows, the layout of `mtdeepep.utils.refs.per_token_cast_to_fp8`:
// scale = max(amax, 1e-4) / 448 per block (round_scale: the next power of two at or above it), e4m3 = x / scale,
// rounded to nearest even. x: [T, H] with row stride `x_stride` (elements), H % 128 == 0.
// e4m3: [T, H] contiguous; scales: [T, S] float32 contiguous.
void cast_to_fp8(const uint16_t* x, int64_t x_stride, int num_tokens, int hidden, bool round_scale, uint8_t* e4m3,
                 float* scales);

// ---- dispatch ----
// One row to write: payload row `row` goes to row `slot` of local expert `expert` on the receiver, whose src_info
// records `token` (the token index on the source rank; equal to `row` when the payload is the sender's x).
struct RowCopy {
    int32_t row;
    int32_t token;
    int32_t expert;  // local expert on the receiver
    int32_t slot;    // row within that expert's RT rows
};

// The receiver-side arrays of one half (a peer's mapped half, or this rank's own).
struct DispatchSlots {
    uint8_t* x;               // [E_local, RT, row_bytes]
    void* scales;             // float [E_local, S, RT] or int32 [E_local, ceil(S / 4), RT]; null for BF16
    int32_t* src_info;        // [E_local, RT]
    int64_t rows_per_expert;  // RT
};

// Where the sender's rows come from: bfloat16 x rows, or the e4m3 rows and scales `cast_to_fp8` produced (or the
// same inside received messages).
struct DispatchPayload {
    const uint8_t* x;      // row of token t at x + t * x_stride
    int64_t x_stride;      // bytes
    size_t row_bytes;      // 2 H (bfloat16) or H (e4m3)
    const float* scales;   // scale s of token t at scales[t * scale_stride + s]; null for BF16
    int64_t scale_stride;  // floats
    int num_scales;
    bool use_ue8m0;  // write power-of-two scales as packed exponents
};

// Writes rows[0:n) of `payload` into `slots`.
void write_dispatch_rows(const DispatchPayload& payload, const RowCopy* rows, size_t n, const DispatchSlots& slots);

// Message format of the collective transport: a header, then the row, then (FP8) the float32 scales.
struct MessageHeader {
    int32_t token;
    int32_t expert;  // dispatch: local expert on the receiver; combine: global expert
};
size_t dispatch_message_bytes(size_t row_bytes, int num_scales);
size_t combine_message_bytes(int hidden);

// Packs rows[i] of `payload` into message i of `out` (rows[i].slot is ignored).
void pack_dispatch_messages(const DispatchPayload& payload, const RowCopy* rows, size_t n, uint8_t* out,
                            size_t message_bytes);

// Groups the (token, slot k) pairs of topk_idx [T, K] by global expert, tokens ascending within an expert.
// Returns `offsets` [E + 1] into `tokens`.
void group_by_expert(const int64_t* topk_idx, int num_tokens, int num_topk, int num_experts,
                     std::vector<int32_t>& offsets, std::vector<int32_t>& tokens);

// ---- combine ----
// Copies `row_bytes` from src + src_row[i] * src_stride to dst + dst_row[i] * dst_stride, for i in [0, n).
// A null index array means the identity.
void copy_rows(const uint8_t* src, int64_t src_stride, const int64_t* src_row, uint8_t* dst, int64_t dst_stride,
               const int64_t* dst_row, size_t n, size_t row_bytes);

// out[t] = sum over k with topk_idx[t, k] >= 0 of weights[t, k] * rows[topk_idx[t, k], t], accumulated in FP32 in
// slot order and rounded once to bfloat16. rows: [E, T_max, H] bfloat16; out: [T, H] bfloat16 contiguous.
void weighted_combine(const int64_t* topk_idx, const float* weights, int num_tokens, int num_topk, int hidden,
                      const uint16_t* rows, int num_max_tokens, uint16_t* out);

}  // namespace mtdeepep::cpu::ll
