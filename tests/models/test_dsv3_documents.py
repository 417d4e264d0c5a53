"""Packed documents in the DeepSeek-V3 model (moe/trainer/models/deepseek_v3/documents.py; Megatron's
`--reset-position-ids` and `--reset-attention-mask`).

The decisive reference is independent of the packed code path: each document run alone through the model (the
plain causal forward, positions 0 .. L-1). A packed row with document ids and reset positions must give, at every
position of a document, that document's logits; its loss sums (main head and every MTP depth) must be the sums of
the documents' losses, and its gradients their gradients' sum. Each flag alone is checked against the model with
hand-built rotary tables (patched `rotary_tables`: one table shared by the row's positions, the 1-D path).

Tolerances (float32): the same maths on the same numbers; what differs is the attention kernel's masking path (SDPA
with a boolean mask instead of `is_causal`; the unfused core's extra -inf fill changes nothing it computes), the
batch the GEMMs and the grouped expert GEMMs see (another row count: another blocking, ~1 ulp per dot product),
and the order in which the gradients' token sums add up (one packed row vs per-document sums). Each is a few ulps
(~1e-7 relative) per operation through 3 layers + 2 MTP depths of norms and softmaxes: logits and losses within
1e-5 relative to their largest entry (measured below 1e-6), gradients within 1e-4 of each gradient's largest entry
(measured below 1e-5), as tests/train/test_tensor_parallel.py bounds its summation-order changes.

The sequence-wise balance loss is off here (`seq_aux_loss_coeff` 0, the default): it counts tokens per row, so a
packed row's is not the sum of its documents' (Megatron's is per row as well).
"""

from __future__ import annotations

import pytest
import torch

from moe.layer.loss import loss_share
from moe.layer.parallel import gather_shards
from moe.trainer.models.deepseek_v3 import DeepseekV3ForCausalLM, RecomputeConfig
from moe.trainer.models.deepseek_v3.documents import (
    attention_bias,
    attention_mask,
    document_ids,
    mtp_labels,
    positions_in_documents,
    target_counts,
)
from moe.trainer.models.deepseek_v3.tensor_parallel import parallelize
from moe.trainer.pipeline import PipelineRunner
from moe.trainer.pipeline.split import split_layers
from moe.trainer.train.parallel_state import Layout, ParallelState
from tests.models.dsv3_testlib import tiny_config
from tests.ranks import pool_fixture

EOD = 1
MTP_WEIGHT = 0.3
RTOL = 1e-5  # logits, losses: relative to the largest entry
GRAD_RTOL = 1e-4  # gradients: relative to each gradient's largest entry
# Two rows of 24 tokens: documents of 7, 9 and 8 tokens; of 11, 6 and 4 tokens and a last one of 3 cut short (no
# EOD: a packing that ends mid-document).
ROWS = ((7, 9, 8), (11, 6, 4, 3))
BACKENDS = ("sdpa", "unfused")


def _config(**overrides):
    return tiny_config(num_nextn_predict_layers=2, **overrides)


def _model(config, backend: str, **kwargs) -> DeepseekV3ForCausalLM:
    torch.manual_seed(11)
    model = DeepseekV3ForCausalLM(config, **kwargs).train()
    with torch.no_grad():  # decisive routing: the same experts in every layout (as the TP and EP parity tests)
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(6.0)
    model.set_attention_backend(backend)
    return model


def _packed(config, seed: int = 0):
    """`(input_ids [2, 24], labels, documents)`: `documents[b]` lists row b's `(start, tokens [L])`. Labels are the
    tokens with the first token of every document but the row's first ignored (-100): as a caller sets them, since
    no document predicts its first token from the previous one (Megatron's `--eod-mask-loss` at the EOD)."""
    gen = torch.Generator().manual_seed(seed)
    rows, docs = [], []
    for b, lengths in enumerate(ROWS):
        parts, starts, start = [], [], 0
        for i, length in enumerate(lengths):
            doc = torch.randint(2, config.vocab_size, (length,), generator=gen)  # EOD = 1 only where placed
            if b == 0 or i < len(lengths) - 1:
                doc[-1] = EOD
            parts.append(doc)
            starts.append(start)
            start += length
        rows.append(torch.cat(parts))
        docs.append(list(zip(starts, parts)))
    ids = torch.stack(rows)
    labels = ids.clone()
    for b, row in enumerate(docs):
        for start, _ in row[1:]:
            labels[b, start] = -100
    return ids, labels, docs


def _objective(out) -> torch.Tensor:
    return out.lm_loss_sum + MTP_WEIGHT * sum(out.mtp_loss_sums)


def _grads(model) -> dict[str, torch.Tensor]:
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _close(actual: torch.Tensor, expected: torch.Tensor, rtol: float, what: str) -> float:
    scale = float(expected.detach().abs().max())
    torch.testing.assert_close(actual.detach(), expected.detach(), rtol=rtol, atol=rtol * scale,
                               msg=lambda m: f"{what}: {m}")  # fmt: skip
    return float((actual.detach().double() - expected.detach().double()).abs().max()) / max(scale, 1e-30)


def _with_tables(model, positions_S: torch.Tensor):
    """Patch `model.rotary_tables` to return the shared `[S, Dr/2]` tables of `positions_S` (the 1-D path)."""
    model.rotary_tables = lambda seq_len, device, position_ids=None: model.rotary(positions_S, model.config_dtype)


def _unpatch(model) -> None:
    del model.rotary_tables


# -- the helpers --------------------------------------------------------------------------------------------------


def test_document_ids_and_positions_follow_megatrons_reset_rule():
    ids = torch.tensor([[5, 1, 7, 8, 1, 1, 9], [1, 4, 4, 4, 4, 4, 1], [3, 3, 3, 3, 3, 3, 3]])
    docs = document_ids(ids, EOD)
    # The EOD ends its document; the token after it starts the next (two EODs in a row: a one-token document).
    assert docs.tolist() == [[0, 0, 1, 1, 1, 2, 3], [0, 1, 1, 1, 1, 1, 1], [0] * 7]
    assert docs.dtype == torch.int64
    assert positions_in_documents(docs).tolist() == [[0, 1, 0, 1, 2, 0, 0], [0, 0, 1, 2, 3, 4, 5], list(range(7))]
    # Megatron's loop (gpt_dataset.py): positions after EOD index i drop by i + 1 - the previous reset point.
    for row in ids:
        expected, prev = torch.arange(row.numel()), 0
        for i in (row == EOD).nonzero().flatten().tolist():
            expected[i + 1 :] -= i + 1 - prev
            prev = i + 1
        assert positions_in_documents(document_ids(row[None], EOD))[0].tolist() == expected.tolist()
    mask = attention_mask(docs)
    assert mask.shape == (3, 1, 7, 7) and mask.dtype == torch.bool
    # Row 0: query 3 (document 1 = tokens 2..4) sees 2 and 3 only.
    assert mask[0, 0, 3].tolist() == [False, False, True, True, False, False, False]
    assert torch.equal(mask[2, 0], torch.ones(7, 7, dtype=torch.bool).tril())
    bias = attention_bias(docs, torch.bfloat16)  # what the attention cores get: additive, in the model dtype
    assert bias.dtype == torch.bfloat16 and torch.equal(bias.float(), torch.where(mask, 0.0, float("-inf")))


def test_mtp_labels_ignore_the_positions_whose_input_spans_two_documents():
    docs = torch.tensor([[0, 0, 0, 1, 1, 1, 1]])
    labels = torch.arange(10, 17)[None]
    # Depth 1: position i scores label i + 2; it spans documents when token i + 1 is in another one than token i:
    # i = 2 (tokens 2, 3), so label 4 goes.
    assert mtp_labels(labels, docs, 1).tolist() == [[10, 11, 12, 13, -100, 15, 16]]
    # Depth 2: i = 1 (tokens 1, 3), i = 2 (tokens 2, 4): labels 4 and 5.
    assert mtp_labels(labels, docs, 2).tolist() == [[10, 11, 12, 13, -100, -100, 16]]
    assert torch.equal(mtp_labels(labels, torch.zeros_like(docs), 2), labels)


# -- the model against each document alone ---------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_rows_match_each_document_alone(backend):
    config = _config()
    model = _model(config, backend)
    ids, labels, docs = _packed(config)
    doc_ids = document_ids(ids, EOD)
    out = model(ids, labels, position_ids=positions_in_documents(doc_ids), document_ids=doc_ids)
    _objective(out).backward()
    grads = _grads(model)

    alone = [(b, start, model(doc[None], doc[None])) for b, row in enumerate(docs) for start, doc in row]
    _objective_sum = sum(_objective(o) for _, _, o in alone)
    _objective_sum.backward()
    ref_grads = _grads(model)

    errs = {}
    for b, start, o in alone:
        length = o.logits.size(1)
        errs["logits"] = max(errs.get("logits", 0.0), _close(out.logits[b, start : start + length], o.logits[0],
                                                             RTOL, f"logits row {b} from {start}"))  # fmt: skip
    assert int(out.num_tokens) == sum(int(o.num_tokens) for _, _, o in alone)
    counts = target_counts(labels, doc_ids, 2)  # the trainer's loss normalisers: the model's counts
    assert counts.tolist() == [float(out.num_tokens), *[float(c) for c in out.mtp_num_tokens]]
    errs["lm"] = _close(out.lm_loss_sum, sum(o.lm_loss_sum for _, _, o in alone), RTOL, "lm_loss_sum")
    for d in range(2):
        # Depth d + 1 keeps exactly the targets the documents alone have (documents.mtp_labels + the labels).
        assert int(out.mtp_num_tokens[d]) == sum(int(o.mtp_num_tokens[d]) for _, _, o in alone), d
        expected = sum(o.mtp_loss_sums[d] for _, _, o in alone)
        errs[f"mtp{d + 1}"] = _close(out.mtp_loss_sums[d], expected, RTOL, f"mtp depth {d + 1}")
    assert grads.keys() == ref_grads.keys()
    errs["grad"] = max(_close(grads[n], ref_grads[n], GRAD_RTOL, n) for n in grads)
    print(backend, errs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bfloat16_packed_rows_match_each_document_alone(backend):
    # The bias in the model dtype (SDPA wants the mask in the query's dtype or bool). bf16 rounds each product to
    # 2^-8 relative; through 3 layers and 2 MTP depths the logits move by ~1e-2 of their largest (measured: 1.7e-2
    # with SDPA's masked kernel against its causal one; 0 with the unfused core): 5e-2.
    config = _config()
    model = _model(config, backend, dtype=torch.bfloat16)
    ids, labels, docs = _packed(config)
    doc_ids = document_ids(ids, EOD)
    with torch.no_grad():
        out = model(ids, labels, position_ids=positions_in_documents(doc_ids), document_ids=doc_ids)
        assert out.logits.dtype == torch.bfloat16
        for b, row in enumerate(docs):
            for start, doc in row:
                ref = model(doc[None], doc[None])
                _close(out.logits[b, start : start + doc.numel()].float(), ref.logits[0].float(), 5e-2, f"row {b}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_position_ids_alone_are_the_model_with_shifted_rotary_tables(backend):
    config = _config()
    model = _model(config, backend).eval()
    ids, labels, _ = _packed(config)
    positions = positions_in_documents(document_ids(ids, EOD))
    with torch.no_grad():
        out = model(ids, labels, position_ids=positions)
        for b in range(ids.size(0)):
            _with_tables(model, positions[b])
            ref = model(ids[b : b + 1], labels[b : b + 1])
            _unpatch(model)
            _close(out.logits[b], ref.logits[0], RTOL, f"row {b}")
        # Positions 0 .. S-1 given per row are the default tables, bit for bit (the same products, broadcast).
        plain = model(ids, labels)
        same = model(ids, labels, position_ids=torch.arange(ids.size(1)).expand_as(ids).contiguous())
    assert torch.equal(plain.logits, same.logits) and torch.equal(plain.lm_loss_sum, same.lm_loss_sum)


@pytest.mark.parametrize("backend", BACKENDS)
def test_document_ids_alone_are_each_document_at_its_row_positions(backend):
    config = _config()
    model = _model(config, backend).eval()
    ids, labels, docs = _packed(config)
    with torch.no_grad():
        out = model(ids, labels, document_ids=document_ids(ids, EOD))
        mtp_sums = [torch.zeros(()) for _ in model.mtp]
        for b, row in enumerate(docs):
            for start, doc in row:
                _with_tables(model, torch.arange(start, start + doc.numel()))  # the positions it has in the row
                ref = model(doc[None], doc[None])
                _unpatch(model)
                _close(out.logits[b, start : start + doc.numel()], ref.logits[0], RTOL, f"row {b} from {start}")
                mtp_sums = [s + r for s, r in zip(mtp_sums, ref.mtp_loss_sums)]
        for d, expected in enumerate(mtp_sums):
            _close(out.mtp_loss_sums[d], expected, RTOL, f"mtp depth {d + 1}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_document_per_row_is_the_causal_forward(backend):
    config = _config()
    model = _model(config, backend)
    ids, labels, _ = _packed(config)
    plain = model(ids, labels)
    _objective(plain).backward()
    plain_grads = _grads(model)
    explicit = model(ids, labels, position_ids=None, document_ids=None)
    one = model(ids, labels, document_ids=torch.zeros_like(ids))
    _objective(one).backward()
    one_grads = _grads(model)
    assert torch.equal(explicit.logits, plain.logits)
    if backend == "unfused":  # the mask's -inf fill repeats the causal bias: nothing changes
        assert torch.equal(one.logits, plain.logits) and torch.equal(one.lm_loss_sum, plain.lm_loss_sum)
        assert all(torch.equal(one_grads[n], plain_grads[n]) for n in plain_grads)
    else:  # SDPA's masked kernel against its causal one: the same sums in another order
        _close(one.logits, plain.logits, RTOL, "logits")
        for n in plain_grads:
            _close(one_grads[n], plain_grads[n], GRAD_RTOL, n)


@pytest.mark.parametrize(
    "setting",
    [
        dict(granularity="full", method="uniform", num_layers=1),  # and every MTP depth checkpointed
        dict(granularity="full", method="block", num_layers=2),
        dict(granularity="selective", modules=("layernorm", "mla_up_proj", "core_attn")),
    ],
    ids=["full_uniform", "full_block", "selective_attention"],
)
def test_recompute_keeps_packed_rows_bit_identical(setting):
    config = _config()
    ids, labels, _ = _packed(config)
    doc_ids = document_ids(ids, EOD)
    kwargs = dict(position_ids=positions_in_documents(doc_ids), document_ids=doc_ids)
    results = []
    for recompute in (None, RecomputeConfig(**setting)):
        model = _model(config, "unfused", recompute=recompute)
        out = model(ids, labels, **kwargs)
        _objective(out).backward()
        results.append((out, _grads(model)))
    (out, grads), (out_rc, grads_rc) = results
    assert torch.equal(out_rc.logits, out.logits)
    assert all(torch.equal(a, b) for a, b in zip(out_rc.mtp_loss_sums, out.mtp_loss_sums))
    assert grads_rc.keys() == grads.keys() and all(torch.equal(grads_rc[n], grads[n]) for n in grads)


# -- validation ----------------------------------------------------------------------------------------------------


def _bad_cases(ids):
    B, S = ids.shape
    docs = document_ids(ids, EOD)
    decreasing = docs.clone()
    decreasing[0, -1] = 0
    return {
        "position_ids shape": (dict(position_ids=torch.zeros(B, S - 1, dtype=torch.long)), "position_ids must be"),
        "position_ids dtype": (dict(position_ids=torch.zeros(B, S, dtype=torch.int32)), "position_ids must be"),
        "position_ids float": (dict(position_ids=torch.zeros(B, S)), "position_ids must be"),
        "negative positions": (dict(position_ids=torch.full((B, S), -1)), r"must lie in \[0"),
        "positions too large": (dict(position_ids=torch.full((B, S), 256)), "max_position_embeddings=256"),
        "document_ids shape": (dict(document_ids=docs[:1]), "document_ids must be"),
        "document_ids dtype": (dict(document_ids=docs.int()), "document_ids must be"),
        "decreasing documents": (dict(document_ids=decreasing), "must not decrease"),
    }


@pytest.mark.parametrize("case", list(_bad_cases(torch.zeros(2, 24, dtype=torch.long))))
def test_bad_packed_inputs_are_refused_before_any_compute(case, monkeypatch):
    config = _config()
    model = _model(config, "sdpa")
    ids, labels, _ = _packed(config)
    kwargs, message = _bad_cases(ids)[case]

    def no_compute(*args, **kw):
        raise AssertionError("the forward started before the inputs were checked")

    monkeypatch.setattr(model, "embed", no_compute)
    with pytest.raises(ValueError, match=message):
        model(ids, labels, **kwargs)
    with pytest.raises(ValueError, match="document_ids must be"):
        positions_in_documents(torch.zeros(2, 3))


# -- tensor + sequence parallelism --------------------------------------------------------------------------------

tp_pools = pool_fixture(comm_timeout_s=60, deadline_s=240)


def tp_documents_case(ctx) -> dict:
    state = ParallelState.from_process_group(Layout(world=ctx.world_size, tp=2, ep=1))
    config = _config()
    ref = _model(config, "sdpa")
    model = parallelize(_model(config, "sdpa", ep_group=state.ep_group), state)
    ids, labels, _ = _packed(config)
    doc_ids = document_ids(ids, EOD)
    kwargs = dict(position_ids=positions_in_documents(doc_ids), document_ids=doc_ids)
    ref_out = ref(ids, labels, **kwargs)
    _objective(ref_out).backward()
    out = model(ids, labels, **kwargs)
    _objective(out).backward()
    errs = {"lm": _close(out.lm_loss_sum, ref_out.lm_loss_sum, RTOL, "lm_loss_sum")}
    for d, (a, b) in enumerate(zip(out.mtp_loss_sums, ref_out.mtp_loss_sums)):
        errs[f"mtp{d + 1}"] = _close(a, b, RTOL, f"mtp depth {d + 1}")
    assert out.num_tokens == ref_out.num_tokens and out.mtp_num_tokens == ref_out.mtp_num_tokens
    v0 = model.vocab_start
    errs["logits"] = _close(out.logits, ref_out.logits[..., v0 : v0 + out.logits.size(-1)], RTOL, "logits")
    ref_params = dict(ref.named_parameters())
    grad_err = 0.0
    for name, p in model.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        shard = getattr(p, "tensor_parallel_shard", None)
        if shard is not None:
            g = gather_shards(g, shard, state.tp_group)
        else:  # partial sums over this rank's positions: replicated ones over TP, experts over the expert-DP group
            g = g.clone()
            group = state.tp_group if getattr(p, "sequence_parallel_grad", False) else state.expert_dp_group
            torch.distributed.all_reduce(g, group=group)
        grad_err = max(grad_err, _close(g, ref_params[name].grad, GRAD_RTOL, name))
    errs["grad"] = grad_err
    return errs


@pytest.mark.slow  # slow: a 2-rank pool
def test_tp2_sequence_parallel_packed_rows_match_one_process(tp_pools):
    results = tp_pools[2].run(tp_documents_case)
    print("TP2 packed", results)


# -- pipeline parallelism -----------------------------------------------------------------------------------------


def pp_documents_case(ctx) -> dict:
    """PP2 (1F1B, one row per micro-batch): the packed rows' loss sums and gradients through the pipeline stages
    (labels, positions and documents as the schedule's keyword arguments) against one process."""
    parallel = ParallelState.from_process_group(Layout(world=ctx.world_size, pp=2, pp_schedule="1f1b"))
    config = _config()
    ids, labels, _ = _packed(config)
    doc_ids = document_ids(ids, EOD)
    kwargs = dict(labels=labels, position_ids=positions_in_documents(doc_ids), document_ids=doc_ids)
    counts = target_counts(labels, doc_ids, 2)
    ref = _model(config, "sdpa")
    out = ref(ids, **kwargs)
    loss, ref_sums = loss_share(out, counts, MTP_WEIGHT, 2)
    loss.backward()
    model = _model(config, "sdpa")
    runner = PipelineRunner(model, parallel, schedule="1f1b", split=split_layers(config.num_hidden_layers, 2),
                            micro_batches=2, micro_rows=1, seq_len=ids.size(1), mtp_loss_weight=MTP_WEIGHT,
                            num_mtp=2)  # fmt: skip
    sums, _ = runner.step(ids, counts, step=1, **kwargs)
    errs = {"sums": _close(sums, ref_sums, RTOL, "loss sums")}
    ref_params = dict(ref.named_parameters())
    grads = [(name, p.grad) for name, p in model.named_parameters() if p.grad is not None]
    assert grads
    errs["grad"] = max(_close(g, ref_params[name].grad, GRAD_RTOL, name) for name, g in grads)
    errs["params"] = len(grads)
    # Bad inputs fail on every pipeline rank before the schedule sends anything (no rank waits on another).
    decreasing = doc_ids.flip(1)
    with pytest.raises(ValueError, match="must not decrease"):
        runner.step(ids, counts, step=2, document_ids=decreasing)
    with pytest.raises(ValueError, match="labels must be"):
        runner.step(ids, counts, step=2, labels=labels[:, 1:])
    return errs


def test_pp2_pipeline_stages_carry_packed_rows(tp_pools):
    results = tp_pools[2].run(pp_documents_case)
    assert all(r["params"] > 0 for r in results)
    print("PP2 packed", results)
