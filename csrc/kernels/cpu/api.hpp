// CPU kernels: raw pointers and sizes only, no ATen tensors, so another executor or a unit test can call them.
// Threading comes from ATen's intra-op pool (at::parallel_for), which follows torch.set_num_threads().
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace mtdeepep::cpu {

// ---- layout ----
// topk_idx [T, K] (-1 = unused slot) -> per-rank token counts [R], per-expert counts [E], is_token_in_rank [T, R].
void get_dispatch_layout(const int64_t* topk_idx, int num_tokens, int num_topk, int num_ranks, int num_experts,
                         int32_t* num_tokens_per_rank, int32_t* num_tokens_per_expert, bool* is_token_in_rank);

// Tokens sent to each rank, in token order, and send_head [T, R]: a token's position in that list or -1.
struct SendPlan {
    std::vector<std::vector<int32_t>> tokens_per_rank;
    std::vector<int32_t> channel_counts;  // [R, num_channels]: tokens sent to each rank from each channel
};
SendPlan make_send_plan(const bool* is_token_in_rank, int num_tokens, int num_ranks, int num_channels,
                        int32_t* send_head);
// Inverse of send_head for the ranks a token reaches (cached dispatch / combine derive everything from it).
SendPlan send_plan_from_head(const int32_t* send_head, int num_tokens, int num_ranks, int num_channels);

// ---- dispatch ----
// Where dispatched rows come from: token t's payload is x[t], scales[t, :], topk_idx[t, :], topk_weights[t, :].
struct DispatchSource {
    const uint8_t* x;
    int64_t x_token_stride;  // bytes
    size_t x_row_bytes;
    const uint8_t* scales;                            // may be null
    int64_t scale_token_stride, scale_column_stride;  // elements, any layout (column-major scales included)
    int num_scales;
    size_t scale_element_bytes;
    const int64_t* topk_idx;    // may be null (cached dispatch)
    const float* topk_weights;  // may be null
    int num_topk;
};

// Contiguous row arrays: a receive region or the output tensors. Null members are not written.
struct RowArrays {
    uint8_t* x;
    uint8_t* scales;
    int64_t* topk_idx;
    float* topk_weights;
    int32_t* src_idx;
};

// Copies tokens[begin:end) of `src` into rows [first_row, ...) of `dst`, turning expert ids into the receiver's
// local ids (-1 and weight 0 where the expert lives elsewhere).
void write_dispatch_rows(const DispatchSource& src, const int32_t* tokens, size_t begin, size_t end,
                         const RowArrays& dst, size_t first_row, int64_t first_local_expert, int num_local_experts);

// Copies rows [src_row, src_row + n) of `src` into rows [dst_row, ...) of `dst` (contiguous blocks).
void copy_rows(const RowArrays& src, size_t src_row, const RowArrays& dst, size_t dst_row, size_t num_rows,
               size_t x_row_bytes, size_t scale_row_bytes, int num_topk);

// ---- combine ----
enum class FloatKind { kBFloat16, kFloat16, kFloat32 };

// Where token t's contributions are: for every rank j with send_head[t, j] >= 0, row
// row_offset[j] + send_head[t, j] of rows[j] (the caller's own expert output or a peer's rows in the region).
struct CombineSources {
    const int32_t* send_head;  // [T, R]
    int num_ranks;
    std::vector<const uint8_t*> rows;       // per rank j: base of its rows
    std::vector<int64_t> row_offset;        // per rank j
    std::vector<const float*> weight_rows;  // per rank j (only with topk weights)
};

// out[t] = sum of token t's contributions (+ bias0[t] + bias1[t]), accumulated in FP32.
void combine_reduce(FloatKind kind, const CombineSources& sources, int num_tokens, int hidden, int num_topk,
                    const uint8_t* bias0, const uint8_t* bias1, uint8_t* out, float* out_weights);

// acc[tokens[k]] += rows[k] for k in [0, n), in FP32 (multi-round combine).
void accumulate_rows(FloatKind kind, const uint8_t* rows, const float* weight_rows, const int32_t* tokens, size_t n,
                     int hidden, int num_topk, float* acc, float* acc_weights);

// out = acc (+ biases), cast to the output type.
void finish_accumulation(FloatKind kind, const float* acc, int num_tokens, int hidden, const uint8_t* bias0,
                         const uint8_t* bias1, uint8_t* out);

}  // namespace mtdeepep::cpu
