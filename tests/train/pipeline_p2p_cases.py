"""Rank cases of test_pipeline_p2p.py: PP2 on tiny's model, one step of each schedule with torch.distributed's P2P and
one with the deepep transport (`pp_send` / `pp_recv` of an `mtdeepep.ElasticBuffer` over the pipeline group), from
the same weights and tokens."""

from __future__ import annotations

from pathlib import Path

import torch

from moe.trainer.models.deepseek_v3 import DeepseekV3Config, DeepseekV3ForCausalLM
from moe.trainer.pipeline import PipelineRunner, pipeline_moe_options
from moe.trainer.pipeline.split import split_layers, stages_per_rank
from moe.trainer.train.parallel_state import Layout, ParallelState
from moe.trainer.train.trainer import target_counts

REPO = Path(__file__).resolve().parents[2]
MICRO_BATCHES, ROWS, SEQ_LEN = 4, 1, 16


def _step(parallel: ParallelState, schedule: str, vpp: int, transport: str, tokens_BS, counts):
    cfg = DeepseekV3Config.from_toml(REPO / "examples" / "deepseek_v3" / "configs" / "tiny.toml")
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(cfg, moe_options=pipeline_moe_options(schedule))
    num_stages = parallel.layout.pp * stages_per_rank(schedule, vpp)
    runner = PipelineRunner(model, parallel, schedule=schedule, split=split_layers(cfg.num_hidden_layers, num_stages),
                            micro_batches=MICRO_BATCHES, micro_rows=ROWS, seq_len=SEQ_LEN,
                            mtp_loss_weight=cfg.mtp_loss_weight, num_mtp=cfg.num_nextn_predict_layers,
                            virtual_stages=vpp, p2p_transport=transport)  # fmt: skip
    try:
        assert runner.p2p_transport == transport
        sums, _ = runner.step(tokens_BS, counts, step=1)
        if transport == "deepep":  # every activation and gradient went through the buffer
            assert runner.transport.wait_s > 0
            runner.transport.check_drained("after the step")
    finally:
        runner.close()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return sums, grads


def transports_agree_case(ctx, schedules: list[tuple[str, int]]) -> list[str]:
    """Per schedule `(name, virtual stages)`: the loss sums and this rank's gradients of the deepep transport's step
    equal the torch transport's, bit for bit (the same bytes move; nothing else differs). Returns the schedules
    checked."""
    del ctx
    checked = []
    cfg = DeepseekV3Config.from_toml(REPO / "examples" / "deepseek_v3" / "configs" / "tiny.toml")
    generator = torch.Generator().manual_seed(1)
    tokens_BS = torch.randint(0, cfg.vocab_size, (MICRO_BATCHES * ROWS, SEQ_LEN), generator=generator)
    counts = target_counts(tokens_BS, cfg.num_nextn_predict_layers)
    for schedule, vpp in schedules:
        parallel = ParallelState.from_process_group(Layout(world=2, pp=2, pp_schedule=schedule, vpp=vpp))
        ref_sums, ref_grads = _step(parallel, schedule, vpp, "torch", tokens_BS, counts)
        sums, grads = _step(parallel, schedule, vpp, "deepep", tokens_BS, counts)
        where = f"{schedule} v{vpp}, pp rank {parallel.pp_rank}"
        assert torch.equal(sums, ref_sums), (where, sums, ref_sums)
        assert grads.keys() == ref_grads.keys() and grads, where
        assert all(torch.equal(grads[k], ref_grads[k]) for k in grads), where
        checked.append(f"{schedule}-v{vpp}")
    return checked
