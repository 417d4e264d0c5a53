"""The trainer's indexed data without training: the `[data]` keys and their errors, `BlendedBatches`
(rows per rank, order independent of the run's length, vocabulary check, validation windows), the
`DataPosition` refusing other data, Megatron's eod_mask_loss labels and target counts, and the path choice."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from moe.trainer.data.blend import BlendedWindows
from moe.trainer.data.blended_batches import BlendedBatches
from moe.trainer.data.run_data import prepare_run_data
from moe.trainer.data.source import IGNORE_INDEX, eod_masked_labels
from moe.trainer.train.checkpoint.train_state import DataPosition, TrainProgress
from moe.trainer.train.job_config import add_tree_options, parse
from moe.trainer.train.trainer import target_counts
from moe.trainer.train.training_config import DataConfig, TrainerConfig
from tests.train import indexed_cases as ic


@pytest.fixture(scope="module")
def blend(tmp_path_factory):
    return ic.write_blend(tmp_path_factory.mktemp("blend"))


def _training(**data) -> TrainerConfig:
    return TrainerConfig.flat(steps=8, global_batch=8, seq_len=32, lr=1e-3, data=DataConfig(**data))


def _batches(data_path, steps=8, **kw) -> BlendedBatches:
    windows = BlendedWindows(data_path, seq_len=32, num_samples=steps * 8, seed=3, held_out=1)
    return BlendedBatches(windows, global_batch=8, val_sequences=kw.pop("val_sequences", 4), eod_id=0, **kw)


def test_rows_per_rank_and_order_independent_of_run_length(blend):
    data_path, _ = blend
    short, long = _batches(data_path, steps=4), _batches(data_path, steps=40)
    for step in range(1, 5):
        whole = short.global_batch_tokens(step)
        assert whole.shape == (8, 32) and whole.dtype == torch.int64
        assert torch.equal(whole, long.global_batch_tokens(step))  # sample i does not depend on the run's length
        for dp in (2, 4):  # the data-parallel ranks' rows, stacked, are the global batch
            assert torch.equal(torch.cat([short.local_batch(step, r, dp) for r in range(dp)]), whole)
    # 4 steps take 32 samples: more than dataset a's windows, so the order crosses its epoch boundary.
    taken = np.bincount(short.blend.dataset_index[:32], minlength=2)
    assert taken[0] > short.blend.train[0].num_windows
    with pytest.raises(ValueError, match="built for 32"):
        short.global_batch_tokens(5)


def test_validation_is_whole_held_out_documents(blend):
    data_path, _ = blend
    batches = _batches(data_path, val_sequences=100)
    held = [ds.document(int(d)) for ds, docs in zip(batches.blend.datasets, batches.blend.held_out_documents)
            for d in docs]  # fmt: skip
    val = batches.val_tokens()
    assert val.shape[0] == batches.blend.num_validation_windows > 0
    stream = np.concatenate(held).astype(np.int64)  # the held-out documents back to back, EOD-terminated
    assert torch.equal(val[0], torch.from_numpy(stream[:32]))
    # No training window holds a held-out document's tokens in place: training streams skip them.
    assert all(s.num_tokens < ds.document_offsets[-1] for s, ds in zip(batches.blend.train, batches.blend.datasets))
    assert _batches(data_path, val_sequences=1).val_tokens().shape == (1, 32)


def test_ids_outside_the_vocabulary_name_the_dataset(blend):
    data_path, _ = blend
    batches = _batches(data_path, vocab_size=100)  # the byte tokenizer's ids reach 256
    with pytest.raises(ValueError, match="a_text_document|b_text_document"):
        batches.global_batch_tokens(1)


def test_eod_mask_loss_labels_and_counts():
    eod = 0
    tokens = torch.tensor([[5, 0, 7, 8, 0, 9], [0, 3, 4, 5, 6, 0]])
    labels = eod_masked_labels(tokens, eod)
    # labels[t + 1] is ignored where tokens[t] is the end-of-text id: the next document's first token.
    assert labels.tolist() == [[5, 0, IGNORE_INDEX, 8, 0, IGNORE_INDEX], [0, IGNORE_INDEX, 4, 5, 6, 0]]
    counts = target_counts(labels, num_mtp=1)
    inputs_eod = int((tokens[:, :-1] == eod).sum())  # positions whose input is EOD: no target
    assert counts[0] == 2 * 5 - inputs_eod == 7
    # MTP depth 1 reads labels[t + 2]: ignored where tokens[t + 1] is EOD (Megatron's rolled loss mask).
    assert counts[1] == 2 * 4 - int((tokens[:, 1:-1] == eod).sum()) == 6
    assert torch.equal(target_counts(tokens, 1), torch.tensor([10.0, 8.0], dtype=torch.float64))


def test_data_position_refuses_other_data(tmp_path, blend):
    data_path, _ = blend
    cfg = SimpleNamespace(global_batch=8, seq_len=32)
    progress = TrainProgress.__new__(TrainProgress)
    progress.step = 4
    saved = DataPosition(cfg, _batches(data_path), progress).state_dict().trainer
    assert saved["data"]["weights"] == [0.7, 0.3] and len(saved["data"]["fingerprint"]) == 64
    source = SimpleNamespace(trainer_state=saved, path=tmp_path / "step_4")
    DataPosition(cfg, _batches(data_path), progress).load_state_dict(source)  # the same data: accepted
    other = [0.5, data_path[1], 0.5, data_path[3]]
    with pytest.raises(ValueError, match=r"trained on other data .*weights.*0\.7, 0\.3.*0\.5, 0\.5"):
        DataPosition(cfg, _batches(other), progress).load_state_dict(source)


@pytest.mark.parametrize(
    "data, message",
    [
        ({"data_path": [0.5, "a", 0.5]}, r"come in pairs .* entry 2 \(0\.5\) has no prefix"),
        ({"data_path": [0.5, "a", "b", "c"]}, r"data_path entry 2 \('b'\): expected a weight"),
        ({"data_path": ["0.5", "a", "0.5"]}, r"come in pairs .* entry 2 \('0\.5'\) has no prefix"),
        ({"data_path": [0, "a", 0, "b"], "tokenizer": "bytes"}, "weights sum to 0"),
        ({"data_path": [-1, "a", 2, "b"], "tokenizer": "bytes"}, "must be finite and >= 0"),
        ({"data_path": ["a"], "corpus": "docs.jsonl", "tokenizer": "bytes"}, "data_path and corpus are both given"),
        ({"data_path": ["a"]}, "data_path needs the tokenizer that prepared the data"),
        ({"held_out_documents": 1.5}, "held_out_documents must be"),
        ({"eod_mask_loss": "yes"}, "eod_mask_loss must be true or false"),
        ({"tokenizer": "wordpiece"}, "tokenizer 'wordpiece': not one of .* no such file or directory"),
    ],
)
def test_bad_data_keys(data, message):
    with pytest.raises(ValueError, match=message):
        DataConfig(**data)


def test_missing_prefix_is_named_before_training(tmp_path, blend):
    data_path, tokenizer = blend
    cfg = _training(data_path=[0.5, data_path[1], 0.5, str(tmp_path / "missing")], tokenizer=str(tokenizer),
                    cache_dir=str(tmp_path / "cache"))  # fmt: skip
    with pytest.raises(ValueError, match=r"data_path entry 3 .*missing\.idx does not exist"):
        prepare_run_data(cfg.data, cfg.training, 512, seed=0, build=True)
    cfg = _training(data_path=data_path, tokenizer=str(tokenizer), cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="has ids up to 256 but the model's vocab_size is 200"):
        prepare_run_data(cfg.data, cfg.training, 200, seed=0, build=True)


def test_command_line_keys_and_normalised_data_path(tmp_path):
    import argparse

    parser = argparse.ArgumentParser()
    add_tree_options(parser)
    _, overrides = parse(parser, ["--data-path", "0.3", "x/a", "0.7", "x/b", "--tokenizer", "tok.json",
                                  "--eod-mask-loss"])  # fmt: skip
    given = {o.path: o.value for o in overrides}
    assert given[("data", "data_path")] == ["0.3", "x/a", "0.7", "x/b"]
    assert given[("data", "tokenizer")] == "tok.json"
    assert given[("data", "eod_mask_loss")] is True
    cfg = DataConfig(data_path=given[("data", "data_path")], tokenizer="bytes")
    assert cfg.data_path == [0.3, "x/a", 0.7, "x/b"]  # weights as numbers: the saved config.toml reads back


def test_builtin_path_is_kept_for_python_directories(tmp_path):
    (tmp_path / "py").mkdir()
    (tmp_path / "py" / "m.py").write_text("x = 1\n")
    assert DataConfig().builtin and DataConfig(corpus=str(tmp_path / "py")).builtin
    assert DataConfig(corpus=str(tmp_path / "py"), tokenizer="bytes").builtin
    ic.byte_tokenizer().save(tmp_path)
    assert not DataConfig(corpus=str(tmp_path / "py"), tokenizer=str(tmp_path / "tokenizer.json")).builtin
    (tmp_path / "py" / "notes.md").write_text("# notes\n")
    assert not DataConfig(corpus=str(tmp_path / "py")).builtin  # other formats: the corpus path reads them all
    assert not DataConfig(corpus=str(tmp_path / "*.jsonl")).builtin
    assert not DataConfig(data_path=["a"], tokenizer="bytes").builtin


def test_a_truncated_shard_is_an_error_naming_it(tmp_path, blend):
    data_path, tokenizer = blend
    bad = tmp_path / "cut"
    for suffix in (".bin", ".idx"):
        shutil.copyfile(data_path[3] + suffix, tmp_path / f"cut{suffix}")
    with open(tmp_path / "cut.bin", "r+b") as f:
        f.truncate((tmp_path / "cut.bin").stat().st_size - 2)  # one uint16 token short
    cfg = _training(data_path=[0.5, data_path[1], 0.5, str(bad)], tokenizer=str(tokenizer),
                    cache_dir=str(tmp_path / "cache"))  # fmt: skip
    with pytest.raises(ValueError, match=r"cut\.(bin|idx)"):
        prepare_run_data(cfg.data, cfg.training, 512, seed=0, build=True)


def test_a_bad_jsonl_record_names_its_file_and_line_before_training(tmp_path):
    corpus = ic.write_jsonl(tmp_path / "docs.jsonl", ic.documents(5, seed=0))
    with corpus.open("a") as f:
        f.write('{"text": "fine"}\n{"txt": "the wrong key"}\n')
    ic.byte_tokenizer().save(tmp_path / "tok")
    cfg = _training(corpus=str(corpus), tokenizer=str(tmp_path / "tok"), cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ValueError, match=r"docs\.jsonl:7: no field 'text'"):
        prepare_run_data(cfg.data, cfg.training, 512, seed=0, build=True)
    assert not any((tmp_path / "cache").glob("indexed-*"))  # nothing half-built is left to be reused
    cfg = _training(corpus=str(corpus), text_field="txt", tokenizer=str(tmp_path / "tok"),
                    cache_dir=str(tmp_path / "cache"))  # fmt: skip
    with pytest.raises(ValueError, match=r"docs\.jsonl:1: no field 'txt'"):
        prepare_run_data(cfg.data, cfg.training, 512, seed=0, build=True)


def test_an_out_of_vocabulary_id_is_named_before_training(tmp_path, blend):
    """Issue 38, item 1 (before: the run trained step 1, committed it and died at step 2 with a traceback): the
    check phase (`prepare_run_data`, before any process group) scans every id of the blend, names the file, the
    document and the position, and caches a clean verdict."""
    import torch as _torch

    from tests.clients.clients_env import import_megatron

    data_path, tokenizer = blend
    builder_module = import_megatron("megatron.core.datasets.indexed_dataset")
    oov = str(tmp_path / "oov_text_document")
    builder = builder_module.IndexedDatasetBuilder(f"{oov}.bin", dtype=np.int32)
    rng = np.random.default_rng(0)
    for d in range(4):
        doc = rng.integers(1, 256, size=40)
        if d == 1:
            doc[7] = 700  # the case: one token of the second document, a 512-id model
        builder.add_document(_torch.tensor(doc), [doc.size])
    builder.finalize(f"{oov}.idx")
    cfg = _training(data_path=[0.7, data_path[1], 0.3, oov], tokenizer=str(tokenizer), cache_dir=str(tmp_path / "c"))
    with pytest.raises(ValueError, match=r"oov_text_document\.bin: document 1, position 7 .* holds id 700, outside "
                                         r"the model's vocabulary \[0, 512\)"):  # fmt: skip
        prepare_run_data(cfg.data, cfg.training, 512, seed=0, build=True)
    clean = _training(data_path=data_path, tokenizer=str(tokenizer), cache_dir=str(tmp_path / "c"))
    prepare_run_data(clean.data, clean.training, 512, seed=0, build=True)
    from moe.trainer.data import vocab_check

    scanned = []
    real = vocab_check.IndexedDataset
    vocab_check.IndexedDataset = lambda prefix: scanned.append(prefix) or real(prefix)
    try:
        prepare_run_data(
            clean.data, clean.training, 512, seed=0, build=True
        )  # a second run: the cached verdict, no rescan
    finally:
        vocab_check.IndexedDataset = real
    assert scanned == []
