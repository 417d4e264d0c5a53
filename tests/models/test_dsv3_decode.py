"""Cached decoding of DeepSeek-V3 (kv_cache.py, decode.py, generation.py) against the training forward and
transformers' `generate`.

Tolerance of the cached logits: the absorbed attention computes `(q_nope W_UK) . c` and `(sum_t p c) W_UV^T` where
the training forward computes `q_nope . (W_UK c)` and `sum_t p (W_UV c)`: the same products, reassociated, so the
float32 sums run in another order (over C = 32 latent dims instead of Dn = 24 key dims, and the value sum before
the projection). Each such reordering moves a result by a few float32 ulps relative to its terms; over 3 layers the
logits agree to 1e-5 of their scale (max |difference| / max |logit|), the bound the transformers parity test uses
for the same reason (measured here: at most 1.4e-6).
"""

from __future__ import annotations

import pytest
import torch

from moe.trainer.models.deepseek_v3.decode import forward_with_cache, pad_prompts, prefill
from moe.trainer.models.deepseek_v3.generation import generate, sample_next
from moe.trainer.models.deepseek_v3.hf import export_hf, from_hf_state_dict
from moe.trainer.models.deepseek_v3.kv_cache import MLACache
from moe.trainer.models.deepseek_v3.model_dir import write_model_dir

from .dsv3_testlib import HF_CASES, hf_model, our_model, rel_err, tiny_config

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_thread")]

LOGITS_RTOL = 1e-5
PROMPT_LENGTHS = (5, 11, 1, 8)


def _model(case: str):
    """Our model with transformers' randomised weights (O(1) activations, decisive routing: see dsv3_testlib)."""
    config = tiny_config(**HF_CASES[case])
    state = from_hf_state_dict(dict(hf_model(config, seed=1).state_dict()), config, log=lambda m: None)
    return config, our_model(config, state)


def _prompts(config, lengths=PROMPT_LENGTHS, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, config.vocab_size, (n,), generator=gen) for n in lengths]


@pytest.mark.parametrize("case", sorted(HF_CASES))
def test_cached_logits_match_full_forward(case):
    """Prefill (every position of every right-padded prompt) and then each of 12 decode steps: the cached logits of
    every sequence equal the training forward of that whole sequence alone."""
    config, model = _model(case)
    prompts = _prompts(config)
    ids, lengths = pad_prompts(prompts)
    cache = MLACache.empty(config, len(prompts), 32)
    all_logits = forward_with_cache(model, ids, cache, lengths)
    assert all_logits.shape == (len(prompts), ids.size(1), config.vocab_size)
    assert torch.equal(cache.lengths, lengths)
    with torch.no_grad():
        for b, p in enumerate(prompts):
            full = model(p[None]).logits[0]
            assert rel_err(all_logits[b, : p.numel()], full) < LOGITS_RTOL, b
    logits = all_logits[torch.arange(len(prompts)), lengths - 1]
    seqs = list(prompts)
    worst = 0.0
    for _ in range(12):
        nxt = logits.argmax(dim=-1)
        seqs = [torch.cat((s, nxt[b : b + 1])) for b, s in enumerate(seqs)]
        logits = forward_with_cache(model, nxt[:, None], cache, last_only=True)
        assert logits.shape == (len(prompts), config.vocab_size) and logits.dtype == torch.float32
        with torch.no_grad():
            for b, s in enumerate(seqs):
                worst = max(worst, rel_err(logits[b], model(s[None]).logits[0, -1]))
    assert torch.equal(cache.lengths, lengths + 12)
    assert worst < LOGITS_RTOL, worst


def test_cache_holds_latents_not_heads():
    """The cache is per layer `[B, T, C]` + `[B, T, Dr]`, and the latent is the normed `kv_a_proj_with_mqa`
    output of the token at its position."""
    config, model = _model("qlora_yarn_norm_groups")
    prompt = _prompts(config, (6,))[0]
    cache, _ = prefill(model, [prompt], 10)
    assert len(cache.latents) == config.num_hidden_layers
    assert cache.latents[0].shape == (1, 10, config.kv_lora_rank)
    assert cache.rope_keys[0].shape == (1, 10, config.qk_rope_head_dim)
    attn = model.layers[0].self_attn
    with torch.no_grad():
        x = model.layers[0].input_layernorm(model.embed_tokens(prompt[None]))
        q_dim = attn.q_in_dim
        latent = attn.kv_a_layernorm(attn.qkv_a_proj(x)[..., q_dim : q_dim + config.kv_lora_rank])
    torch.testing.assert_close(cache.latents[0][:, :6], latent, rtol=0, atol=0)
    assert not cache.latents[0][:, 6:].any()


@pytest.mark.parametrize("case", sorted(HF_CASES))
def test_batch_of_lengths_gives_each_prompts_tokens(case):
    """Greedy tokens of a batch of prompts of different lengths are those of each prompt alone; with an eos id
    each sequence stops right after its first eos."""
    config, model = _model(case)
    prompts = _prompts(config, seed=1)
    batch = generate(model, prompts, 16)
    alone = [generate(model, [p], 16)[0] for p in prompts]
    for b in range(len(prompts)):
        assert torch.equal(batch[b], alone[b]), b
    eos = int(batch[0][5])
    stopped = generate(model, prompts, 16, eos_token_id=eos)
    for b, full in enumerate(batch):
        hits = (full == eos).nonzero()
        expected = full[: int(hits[0]) + 1] if hits.numel() else full
        assert torch.equal(stopped[b], expected), b
    assert stopped[0].numel() <= 6 and int(stopped[0][-1]) == eos


@pytest.mark.parametrize("case", sorted(HF_CASES))
def test_greedy_matches_transformers_generate(case, tmp_path):
    """Our weights exported with hf.py's `export_hf`: our batched greedy tokens equal transformers'
    `generate(do_sample=False)` of each prompt (24 new tokens, float32)."""
    transformers = pytest.importorskip("transformers")
    config, model = _model(case)
    write_model_dir(tmp_path / "ckpt", model.full_state_dict(), config)
    export_hf(tmp_path / "ckpt", tmp_path / "hf")
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "hf").eval()
    prompts = _prompts(config, seed=2)
    ours = generate(model, prompts, 24)
    for b, p in enumerate(prompts):
        with torch.no_grad():
            theirs = hf.generate(
                p[None],
                attention_mask=torch.ones(1, p.numel(), dtype=torch.int64),
                max_new_tokens=24,
                min_new_tokens=24,
                do_sample=False,
                pad_token_id=0,
            )[0, p.numel() :]
        assert torch.equal(ours[b], theirs), (b, ours[b].tolist(), theirs.tolist())


def test_sampling_is_seeded_and_has_greedy_limits():
    config, model = _model("qlora_yarn_norm_groups")
    prompts = _prompts(config, seed=3)

    def sampled(seed: int, **kw):
        return generate(model, prompts, 16, generator=torch.Generator().manual_seed(seed), **kw)

    first, again, other = sampled(7, temperature=1.0), sampled(7, temperature=1.0), sampled(8, temperature=1.0)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert any(not torch.equal(a, b) for a, b in zip(first, other, strict=True))
    greedy = generate(model, prompts, 16)
    assert any(not torch.equal(a, b) for a, b in zip(first, greedy, strict=True))  # temperature 1 really samples
    for limit in (sampled(9, temperature=1.0, top_p=1e-6), sampled(9, temperature=1e-4)):
        assert all(torch.equal(a, b) for a, b in zip(limit, greedy, strict=True))


def test_top_p_keeps_the_nucleus_only():
    """Probabilities 0.4, 0.3, 0.2, 0.1: top_p = 0.6 keeps the first two (0.4 < 0.6 <= 0.7), in their ratio."""
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log().repeat(4000, 1)
    draws = sample_next(logits, 1.0, 0.6, torch.Generator().manual_seed(0))
    counts = torch.bincount(draws, minlength=4)
    assert counts[2:].sum() == 0
    assert abs(float(counts[0]) / 4000 - 4 / 7) < 0.03  # binomial sd ~0.008
    assert torch.equal(sample_next(logits[:2], 0.0, 1.0), torch.zeros(2, dtype=torch.int64))


def test_bad_input_raises_before_compute():
    config, model = _model("qlora_yarn_norm_groups")
    calls = []
    model.embed_tokens.register_forward_pre_hook(lambda m, args: calls.append(1))
    too_long = torch.zeros(config.max_position_embeddings + 1, dtype=torch.int64)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        generate(model, [torch.tensor([1, 2]), too_long], 4)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        generate(model, [torch.zeros(config.max_position_embeddings - 2, dtype=torch.int64)], 4)
    with pytest.raises(ValueError, match="vocab_size"):
        generate(model, [torch.tensor([1, config.vocab_size])], 4)
    with pytest.raises(ValueError, match="top_p"):
        generate(model, [torch.tensor([1])], 4, temperature=1.0, top_p=0.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, [torch.tensor([1])], 0)
    with pytest.raises(ValueError, match="non-empty"):
        generate(model, [torch.tensor([], dtype=torch.int64)], 4)
    with pytest.raises(ValueError, match="capacity"):
        forward_with_cache(model, torch.zeros(2, 5, dtype=torch.int64), MLACache.empty(config, 2, 4))
    with pytest.raises(ValueError, match="capacity"):
        MLACache.empty(config, 1, config.max_position_embeddings + 1)
    with pytest.raises(ValueError, match="eval"):
        generate(model.train(), [torch.tensor([1])], 4)
    assert not calls


@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_chunked_prefill_matches_one_forward(chunk):
    """Prefill in chunks of 1, 3 and 64 positions (64: one chunk) gives the one-forward prefill's last-token logits
    and cache (the same sums: each chunk's queries attend to the positions the earlier chunks cached), and the
    decode steps after it the same logits."""
    config, model = _model("qlora_yarn_norm_groups")
    prompts = _prompts(config)
    cache, logits = prefill(model, prompts, 24)
    cache_c, logits_c = prefill(model, prompts, 24, chunk_size=chunk)
    assert rel_err(logits_c, logits) < LOGITS_RTOL
    assert torch.equal(cache_c.lengths, cache.lengths)
    for layer in range(config.num_hidden_layers):
        for b, n in enumerate(cache.lengths.tolist()):  # the real positions (padding may differ)
            assert rel_err(cache_c.latents[layer][b, :n], cache.latents[layer][b, :n]) < LOGITS_RTOL
    nxt = logits.argmax(-1)
    step, step_c = (forward_with_cache(model, nxt[:, None], c, last_only=True) for c in (cache, cache_c))
    assert rel_err(step_c, step) < LOGITS_RTOL


def test_chunked_prefill_bad_sizes():
    config, model = _model("qlora_yarn_norm_groups")
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        prefill(model, _prompts(config), 24, chunk_size=0)
    with pytest.raises(ValueError, match="below this rank's 4 chunks"):
        prefill(model, _prompts(config), 24, chunk_size=3, num_chunks=2)
