"""End to end on indexed data: examples/deepseek_v3/train.py with Megatron's `--data-path` blend and with a JSONL
corpus tokenized by an existing tokenizer, then evaluate.py with the run's tokenizer.

- EP2 x DP2 on 2 processes reproduces the one-process losses step by step (the same samples in every layout).
- --resume from step 4, in the middle of an epoch of the blend's first dataset, continues bit-exactly; a resume
  with other blend weights is refused before any process group.
- reset_position_ids + reset_attention_mask + eod_mask_loss: step 1's losses are the model's with the batch's
  documents; PP2 gives the same losses.
- --eod-mask-loss: step 1's loss is a plain cross-entropy of the initial model over the targets whose input is not
  the end-of-text id, and the trainer counts exactly those targets.
- The loader's time (`data_s`) is under 2% of the step (`step_s`).
- A JSONL corpus with a tokenizer.json: the run saves that tokenizer; evaluate.py --text tokenizes with it and
  agrees with --tokens on the same windows.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from moe.trainer import run
from moe.trainer.data.blend import BlendedWindows
from moe.trainer.data.source import IGNORE_INDEX, eod_masked_labels
from moe.trainer.data.tokenizer import load_tokenizer
from moe.trainer.models.deepseek_v3 import DeepseekV3Config, DeepseekV3ForCausalLM, documents
from moe.trainer.train import checkpoint as ckpt
from moe.trainer.train import evaluate
from moe.trainer.train.metrics import read_metrics
from mtdeepep.utils.testing import run_processes
from tests.train import indexed_cases as ic
from tests.train import train_cases as tc

pytestmark = pytest.mark.slow  # train.py end to end: 10-30 s a run on 2 cores

train_script = run
evaluate_script = evaluate
SEED = 7


def _run(argv, nproc=1):
    return run_processes(tc.torchrun_rank, nproc, (argv,), timeout_s=300)


def _records(run_dir):
    return read_metrics(run_dir / "metrics.jsonl")


@pytest.fixture(scope="module")
def blend(tmp_path_factory):
    return ic.write_blend(tmp_path_factory.mktemp("blend"))


def _config(path, blend, **data):
    data_path, tokenizer = blend
    return tc.make_config(path, path.parent, path.parent / "cache", training={"eps": 1e-6},
                          data={"corpus": "python-stdlib", "data_path": data_path, "tokenizer": str(tokenizer),
                                "held_out_documents": 1, **data})  # fmt: skip


@pytest.fixture(scope="module")
def config(tmp_path_factory, blend):
    return _config(tmp_path_factory.mktemp("cfg") / "blend.toml", blend)


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory, config):
    run_dir = tmp_path_factory.mktemp("run1") / "run"
    _run(["--config", str(config), "--out", str(run_dir), "--seed", str(SEED)])
    return run_dir


def test_run_on_a_blend(one_process_run, blend):
    data_path, tokenizer = blend
    records = _records(one_process_run)
    assert [r["step"] for r in records] == list(range(1, 9))
    assert records[-1]["loss"] < records[0]["loss"] - 0.5
    info = json.loads((one_process_run / "run.json").read_text())["data"]
    assert info["data_path"] == data_path and info["eos_id"] == 0
    assert [d["held_out_documents"] for d in info["datasets"]] == [1, 1]
    assert [d["weight"] for d in info["datasets"]] == pytest.approx([0.7, 0.3])
    # The tokenizer that prepared the data is the run's and every checkpoint's.
    saved = (tokenizer / "tokenizer.json").read_bytes()
    assert (one_process_run / "tokenizer.json").read_bytes() == saved
    assert (one_process_run / "checkpoints" / "step_4" / "tokenizer.json").read_bytes() == saved
    state = ckpt.read_trainer_state(one_process_run / "checkpoints" / "step_4")["data"]
    assert state["next_step"] == 5 and state["weights"] == [0.7, 0.3] and len(state["fingerprint"]) == 64
    # val_tokens.npy: the held-out documents' windows (never trained on).
    val = np.load(one_process_run / "val_tokens.npy")
    assert val.ndim == 2 and val.shape[1] == 32 and val.shape[0] >= 1
    # The loader's share of the step: under 2% (memory maps to a tensor, ~0.3 ms against a ~0.3 s step here).
    share = np.median([r["data_s"] / r["step_s"] for r in records])
    assert share < 0.02, share


def test_data_parallel_layout_matches_one_process(tmp_path, config, one_process_run):
    run_dir = tmp_path / "ep2"
    _run(["--config", str(config), "--out", str(run_dir), "--seed", str(SEED), "--ep", "2"], nproc=2)
    layout = json.loads((run_dir / "run.json").read_text())["layout"]
    assert (layout["world"], layout["dp"], layout["ep"]) == (2, 2, 2)
    ref, got = _records(one_process_run), _records(run_dir)
    assert len(got) == len(ref) == 8
    # FP32; the layouts differ only in the order of reductions (see test_train.py's layout test for the 1e-5).
    for a, b in zip(ref, got):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), (a["step"], a["loss"], b["loss"])
        assert b["mtp_loss"] == pytest.approx(a["mtp_loss"], rel=1e-5)


def test_resume_mid_epoch_is_exact(tmp_path, config, one_process_run, blend):
    data_path, _ = blend
    # Step 4 ends at sample 32: in the blend's order, dataset a is part-way through a later epoch.
    windows = BlendedWindows(data_path, seq_len=32, num_samples=64, seed=SEED, held_out=1)
    taken = int((windows.dataset_index[:32] == 0).sum())
    assert taken > windows.train[0].num_windows and taken % windows.train[0].num_windows != 0
    run_dir = tmp_path / "resumed"
    shutil.copytree(one_process_run, run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "step_8")
    ckpt.set_latest(run_dir, 4)
    _run(["--config", str(config), "--out", str(run_dir), "--seed", str(SEED), "--resume"])
    ref, got = _records(one_process_run), _records(run_dir)
    assert [r["step"] for r in got] == list(range(1, 9))
    for a, b in zip(ref, got):
        assert (a["loss"], a["grad_norm"], a["mtp_loss"]) == (b["loss"], b["grad_norm"], b["mtp_loss"])


def test_resume_on_other_weights_is_refused(tmp_path, capsys, blend, one_process_run):
    data_path, tokenizer = blend
    run_dir = tmp_path / "other"
    shutil.copytree(one_process_run, run_dir)
    other = _config(tmp_path / "other.toml", blend, data_path=[0.5, data_path[1], 0.5, data_path[3]])
    code = train_script.main(["--config", str(other), "--out", str(run_dir), "--seed", str(SEED), "--resume"])
    err = capsys.readouterr().err
    assert code == 2 and "trained on other data" in err and "[0.5, 0.5]" in err, err


def test_eod_mask_loss_is_megatrons(tmp_path, blend):
    config = _config(tmp_path / "eod.toml", blend, eod_mask_loss=True)
    run_dir = tmp_path / "eod"
    _run(["--config", str(config), "--out", str(run_dir), "--seed", str(SEED), "--steps", "1"])
    got = _records(run_dir)[0]
    # The reference: the same initial weights (the seed's), step 1's batch, plain cross-entropy over the targets
    # whose input token is not the end-of-text id.
    data_path, _ = blend
    windows = BlendedWindows(data_path, seq_len=32, num_samples=8, seed=SEED, held_out=1)
    tokens = torch.from_numpy(windows.windows(np.arange(8)))
    eod_inputs = int((tokens[:, :-1] == 0).sum())
    assert eod_inputs >= 4  # documents of 20-90 tokens: several ends in the batch
    model_cfg = DeepseekV3Config.from_dict(json.loads((run_dir / "run.json").read_text())["config"]["model"])
    torch.manual_seed(SEED)
    model = DeepseekV3ForCausalLM(model_cfg)
    with torch.no_grad():
        logits = model(tokens).logits.double()
    labels = eod_masked_labels(tokens, 0)
    targets = labels[:, 1:].reshape(-1)
    assert int((targets != IGNORE_INDEX).sum()) == 8 * 31 - eod_inputs
    expected = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), targets, ignore_index=IGNORE_INDEX)
    # FP32 loss sums over two micro-batches against a float64 reference.
    assert got["loss"] == pytest.approx(float(expected), rel=1e-5)
    unmasked = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))
    assert abs(float(unmasked) - float(expected)) > 1e-3  # the mask matters on this batch


def test_jsonl_corpus_with_a_tokenizer_file_and_evaluate_with_the_runs_tokenizer(tmp_path, capsys):
    texts = ic.documents(400, seed=5)
    corpus = ic.write_jsonl(tmp_path / "corpus" / "docs.jsonl", texts)
    tok = ic.byte_tokenizer()
    tok.save(tmp_path / "tok")
    config = tc.make_config(tmp_path / "jsonl.toml", corpus, tmp_path / "cache",
                            data={"tokenizer": str(tmp_path / "tok" / "tokenizer.json")})  # fmt: skip
    run_dir = tmp_path / "run"
    _run(["--config", str(config), "--out", str(run_dir), "--seed", str(SEED), "--steps", "2"])
    assert len(_records(run_dir)) == 2
    step = run_dir / "checkpoints" / "step_2"
    assert (step / "tokenizer.json").read_bytes() == (tmp_path / "tok" / "tokenizer.json").read_bytes()
    meta = json.loads((run_dir / "run.json").read_text())["data"]
    assert meta["num_documents"] == 400 and meta["text_field"] == "text" and meta["eos_id"] == 0
    # evaluate.py --text: the checkpoint's tokenizer, documents packed with their end-of-text ids, as --tokens.
    held_out = ic.write_jsonl(tmp_path / "held_out.jsonl", ic.documents(30, seed=9))
    assert evaluate_script.main(["--checkpoint", str(step), "--text", str(held_out), "--seq-len", "32"]) == 0
    from_text = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    ids, _ = load_tokenizer(step).encode_documents(ic.documents(30, seed=9), np.int64)
    rows = ids.size // 32
    np.save(tmp_path / "ids.npy", ids[: rows * 32].reshape(rows, 32))
    assert evaluate_script.main(["--checkpoint", str(step), "--tokens", str(tmp_path / "ids.npy")]) == 0
    from_ids = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert from_text["shape"] == [rows, 32] and from_text["loss"] == from_ids["loss"]


def test_reset_flags_pass_the_documents_to_the_model(tmp_path, blend):
    # Megatron's three flags together: step 1's LM and MTP losses are the initial model's with position_ids and
    # document_ids from the batch (each document alone: moe/trainer/models/deepseek_v3/documents.py, tested there), over
    # the targets the model keeps; the pipeline (PP2, 1F1B) carries them to its stages and gives the same losses.
    flags = {"eod_mask_loss": True, "reset_position_ids": True, "reset_attention_mask": True}
    config = _config(tmp_path / "reset.toml", blend, **flags)
    one, pp2 = tmp_path / "one", tmp_path / "pp2"
    _run(["--config", str(config), "--out", str(one), "--seed", str(SEED), "--steps", "2"])
    _run(["--config", str(config), "--out", str(pp2), "--seed", str(SEED), "--steps", "2", "--pp", "2"], nproc=2)
    data_path, _ = blend
    windows = BlendedWindows(data_path, seq_len=32, num_samples=8, seed=SEED, held_out=1)
    tokens = torch.from_numpy(windows.windows(np.arange(8)))
    doc_ids = documents.document_ids(tokens, 0)
    model_cfg = DeepseekV3Config.from_dict(json.loads((one / "run.json").read_text())["config"]["model"])
    torch.manual_seed(SEED)
    model = DeepseekV3ForCausalLM(model_cfg)
    with torch.no_grad():
        out = model(tokens, labels=eod_masked_labels(tokens, 0), position_ids=documents.positions_in_documents(doc_ids),
                    document_ids=doc_ids)  # fmt: skip
    got = _records(one)
    assert got[0]["loss"] == pytest.approx(float(out.lm_loss_sum / out.num_tokens), rel=1e-5)
    assert got[0]["mtp_loss"] == pytest.approx(float(out.mtp_loss_sums[0] / out.mtp_num_tokens[0]), rel=1e-5)
    with torch.no_grad():
        plain = model(tokens, labels=eod_masked_labels(tokens, 0))
    assert abs(float(plain.lm_loss_sum / plain.num_tokens) - got[0]["loss"]) > 1e-4  # the documents matter
    for a, b in zip(got, _records(pp2)):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["mtp_loss"] == pytest.approx(a["mtp_loss"], rel=1e-5)
