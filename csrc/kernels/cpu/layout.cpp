#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

#include "kernels/cpu/api.hpp"

namespace mtdeepep::cpu {

void get_dispatch_layout(const int64_t* topk_idx, int num_tokens, int num_topk, int num_ranks, int num_experts,
                         int32_t* num_tokens_per_rank, int32_t* num_tokens_per_expert, bool* is_token_in_rank) {
    const int experts_per_rank = num_experts / num_ranks;
    const int num_threads = std::max(1, at::get_num_threads());
    // One row of counters per worker thread, summed at the end: no atomics in the token loop.
    std::vector<int32_t> rank_counts(static_cast<size_t>(num_threads) * num_ranks, 0);
    std::vector<int32_t> expert_counts(static_cast<size_t>(num_threads) * num_experts, 0);
    at::parallel_for(0, num_tokens, 512, [&](int64_t begin, int64_t end) {
        const int thread = at::get_thread_num();
        int32_t* my_ranks = rank_counts.data() + static_cast<size_t>(thread) * num_ranks;
        int32_t* my_experts = expert_counts.data() + static_cast<size_t>(thread) * num_experts;
        for (int64_t t = begin; t < end; ++t) {
            bool* in_rank = is_token_in_rank + t * num_ranks;
            std::memset(in_rank, 0, num_ranks);
            for (int k = 0; k < num_topk; ++k) {
                const int64_t expert = topk_idx[t * num_topk + k];
                if (expert < 0) continue;
                ++my_experts[expert];
                in_rank[expert / experts_per_rank] = true;
            }
            for (int r = 0; r < num_ranks; ++r) my_ranks[r] += in_rank[r];
        }
    });
    std::fill(num_tokens_per_rank, num_tokens_per_rank + num_ranks, 0);
    std::fill(num_tokens_per_expert, num_tokens_per_expert + num_experts, 0);
    for (int thread = 0; thread < num_threads; ++thread) {
        for (int r = 0; r < num_ranks; ++r) num_tokens_per_rank[r] += rank_counts[thread * num_ranks + r];
        for (int e = 0; e < num_experts; ++e)
            num_tokens_per_expert[e] += expert_counts[static_cast<size_t>(thread) * num_experts + e];
    }
}

namespace {

// Channel c covers tokens [c * per_channel, (c + 1) * per_channel), as upstream splits tokens over SMs.
int channel_of(int token, int num_tokens, int num_channels) {
    const int per_channel = std::max(1, (num_tokens + num_channels - 1) / num_channels);
    return std::min(token / per_channel, num_channels - 1);
}

}  // namespace

SendPlan make_send_plan(const bool* is_token_in_rank, int num_tokens, int num_ranks, int num_channels,
                        int32_t* send_head) {
    SendPlan plan;
    plan.tokens_per_rank.resize(num_ranks);
    plan.channel_counts.assign(static_cast<size_t>(num_ranks) * num_channels, 0);
    for (int t = 0; t < num_tokens; ++t) {
        const int channel = channel_of(t, num_tokens, num_channels);
        for (int r = 0; r < num_ranks; ++r) {
            int32_t position = -1;
            if (is_token_in_rank[static_cast<int64_t>(t) * num_ranks + r]) {
                position = static_cast<int32_t>(plan.tokens_per_rank[r].size());
                plan.tokens_per_rank[r].push_back(t);
                ++plan.channel_counts[r * num_channels + channel];
            }
            send_head[static_cast<int64_t>(t) * num_ranks + r] = position;
        }
    }
    return plan;
}

SendPlan send_plan_from_head(const int32_t* send_head, int num_tokens, int num_ranks, int num_channels) {
    SendPlan plan;
    plan.tokens_per_rank.resize(num_ranks);
    plan.channel_counts.assign(static_cast<size_t>(num_ranks) * num_channels, 0);
    for (int t = 0; t < num_tokens; ++t) {
        for (int r = 0; r < num_ranks; ++r) {
            const int32_t position = send_head[static_cast<int64_t>(t) * num_ranks + r];
            if (position < 0) continue;
            auto& tokens = plan.tokens_per_rank[r];
            if (static_cast<size_t>(position) >= tokens.size()) tokens.resize(position + 1, -1);
            tokens[position] = t;
            ++plan.channel_counts[r * num_channels + channel_of(t, num_tokens, num_channels)];
        }
    }
    return plan;
}

}  // namespace mtdeepep::cpu
