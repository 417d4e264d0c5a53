"""The pipeline's P2P transports (moe/trainer/pipeline/p2p.py): with `p2p_transport='deepep'` the activations and
gradients move through `pp_send` / `pp_recv` of an `mtdeepep.ElasticBuffer` over the pipeline group, and one step of
DualPipeV gives the loss sums and gradients of torch.distributed's P2P bit for bit (PP2; 1F1B's:
test_bench_pipeline.py). The trainer's runs with the option against the one-process run (1F1B, ZB-H1, interleaved 1F1B,
DualPipeV): test_train.py's layouts. A bad name is refused before anything is built."""

from __future__ import annotations

import pytest

from moe.trainer.pipeline import PipelineRunner
from moe.trainer.pipeline.split import split_layers
from moe.trainer.train.parallel_state import ParallelState
from tests.ranks import pool_fixture
from tests.train import pipeline_p2p_cases as cases

rank_pools = pool_fixture(comm_timeout_s=60, deadline_s=240)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_deepep_transport_is_bit_identical_to_torch_p2p(rank_pools):
    # DualPipeV runs torch's action runtime (which interleaved 1F1B and ZB-H1 share), with two stages of a rank passing
    # activations without P2P at the V's bottom; Schedule1F1B's mixed send + receive batches: test_bench_pipeline.py.
    results = rank_pools[2].run(cases.transports_agree_case, [("dualpipev", 1)])
    assert results == [["dualpipev-v1"]] * 2


def test_unknown_transport_is_refused_before_anything_is_built():
    parallel = ParallelState.single()
    with pytest.raises(ValueError, match="p2p_transport must be one of"):
        PipelineRunner(None, parallel, schedule="1f1b", split=split_layers(4, 1), micro_batches=1, micro_rows=1,
                       seq_len=8, mtp_loss_weight=0.0, num_mtp=0, p2p_transport="nccl")  # fmt: skip
