"""The trainer's tables of a run's TOML config, one per component, each built into the dataclass that component
receives: `[training]` (the loop: steps, batch, precision), `[optimizer]` (AdamW and its schedule), `[zero]` (ZeRO-1),
`[checkpoint]`, `[rewind]` (anomalies), `[straggler]` (slow ranks) and `[data]`.

```toml
[training]
steps = 200
global_batch = 16        # sequences per optimizer step, whatever the layout
micro_batches = 4        # per data-parallel rank (gradient accumulation; pipeline schedules need several)
seq_len = 128
dtype = "float32"        # parameters and activations: float32 or bfloat16 (FP32 master weights and Adam states)
log_every = 10           # steps between console log lines (metrics.jsonl gets every step)
attention_backend = "sdpa"  # MLA's core: sdpa, unfused or auto (moe/trainer/models/deepseek_v3/attention.py)
compile = false          # torch.compile (inductor) of every attention (moe/trainer/models/deepseek_v3/compile.py)

[optimizer]              # AdamW (moe/trainer/train/optim.py); warm-up then cosine (moe/trainer/train/schedule.py)
lr = 3e-3
min_lr = 3e-4            # end of the cosine decay
warmup_steps = 20        # linear warm-up from lr / warmup_steps to lr
betas = [0.9, 0.95]
eps = 1e-8
weight_decay = 0.1
clip_grad = 1.0          # global gradient-norm clip; 0 = off

[zero]                   # ZeRO-1 (moe/trainer/train/zero.py), Megatron's names
use_distributed_optimizer = false
# ddp_bucket_size = 40000000   # gradient bucket, elements (default: Megatron's max(40M, 1M * dp))
overlap_grad_reduce = true

[checkpoint]             # moe/trainer/train/checkpoint/
checkpoint_every = 100   # steps; the last step is always saved; 0 = only the last

[rewind]                 # moe/trainer/train/rewind.py: an anomalous step makes no update, its batch is skipped
check_for_nan_in_loss_and_grad = true
check_for_spiky_loss = false
spiky_loss_zscore = 6.0        # a spike: (loss - mean) / std of the last accepted steps' losses above this
spiky_loss_window = 50         # steps in that window
spiky_loss_min_steps = 10      # accepted steps before spikes are looked for
rewind_snapshot_interval = 1   # steps between in-memory snapshots; 0 = none (an anomaly stops the run)
rewind_max_retries = 3         # anomalous steps in a row that are rewound and skipped; the next one stops the run
iterations_to_skip = []        # steps that make no update (their batches are skipped), e.g. known bad batches

[straggler]              # moe/trainer/train/straggler.py: per-rank, per-phase times every straggler_interval steps
log_straggler = false
straggler_interval = 10
straggler_factor = 1.5         # a rank whose phase time exceeds the median over the ranks by this factor ...
straggler_min_seconds = 0.02   # ... and by this many seconds per step is reported

[data]
corpus = "python-stdlib" # a directory, a file or a glob (.py .txt .md .jsonl .jsonl.gz .parquet)
tokenizer = "bpe"        # BPE trained to the model's vocab_size, "bytes", or a tokenizer.json / tokenizer directory
# text_field = "text"    # the JSONL key / parquet column of the documents
# data_path = [0.7, "/data/web_text_document", 0.3, "/data/code_text_document"]  # Megatron's --data-path
# reset_position_ids = false   # Megatron's: positions restart at every document (after each end-of-text token)
# reset_attention_mask = false # Megatron's: attention never crosses an end-of-text token
# eod_mask_loss = false        # Megatron's: no loss on the target that follows an end-of-text token
```

The keys kept their names when they left `[training]` (before this split one flat table held them all, with
`[training.data]`): `MOVED` maps each to its table. A file in the old layout still reads; every moved key is named
with its new home in one `FutureWarning` (`moved_keys`), and the run's saved RUN_DIR/config.toml is in the new layout.

Megatron's names for the same settings: `train_iters`, `global_batch_size`, `seq_length`, `lr`, `min_lr`,
`lr_warmup_iters`, `adam_beta1/2`, `adam_eps`, `weight_decay`, `clip_grad`, `save_interval`, `log_interval`;
`check_for_nan_in_loss_and_grad`, `check_for_spiky_loss`, `iterations_to_skip` and `log_straggler` are Megatron's
own names (its `--iterations-to-skip` steps likewise make no update and consume their batch; here the learning rate
stays a function of the step number, see moe/trainer/train/rewind.py).

Two data paths (moe/trainer/data/source.py picks one): the built-in corpus (python-stdlib or a directory of `*.py`
files, tokenizer "bpe" or "bytes") keeps its token file and its window hold-out (moe/trainer/data/token_file.py); any
other corpus or tokenizer, and Megatron-prepared data (`data_path`), are indexed datasets read as a seeded blend with
whole documents held out (moe/trainer/data/blend.py, moe/trainer/data/blended_batches.py).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import tomllib

from moe.trainer.data.blend import parse_data_path
from moe.trainer.models.deepseek_v3.attention import ATTENTION_BACKENDS
from moe.trainer.train.config_tree import move_keys, moved_keys_message

DTYPES = ("float32", "bfloat16")
TOKENIZERS = ("bpe", "bytes")


@dataclass(kw_only=True)
class DataConfig:
    """Where the tokens come from.

    corpus: "python-stdlib" (this Python's standard library sources: present on every machine, no download), a
        directory (its corpus files, sorted by relative path), a glob pattern or one file. Formats by name: `.py`,
        `.txt`, `.md` (a document per file), `.jsonl`, `.jsonl.gz` (a document per line), `.parquet` (per row).
    text_field: the JSONL key / parquet column holding a document's text.
    tokenizer: "bpe" (byte-level BPE trained with `tokenizers` to the model's vocab_size), "bytes" (one token per
        byte, needs vocab_size >= 257), or a path: a `tokenizer.json` or a Hugging Face tokenizer directory (its
        ids must be below vocab_size). Saved with the run and every checkpoint.
    data_path: Megatron's `--data-path`: `[w1, "prefix1", w2, "prefix2", ...]` or prefixes alone, indexed datasets
        (`prefix.bin` / `prefix.idx`) blended as Megatron does (moe/trainer/data/blend.py). Then `corpus`, `text_field`
        and
        `max_bytes` are unused (setting them as well is refused), and `tokenizer` names the tokenizer that prepared
        the data (a path, or "bytes"): its end-of-text id ends the documents, and it is saved with the run.
    held_out_documents: for indexed data (data_path, or a corpus tokenized into shards), the documents of every
        dataset kept out of training for validation: a count (int), or a fraction (float in [0, 1), at least one
        document when > 0). Whole documents, spread evenly over each dataset, whatever the seed.
    max_bytes: use the sorted files up to this many bytes (None: all of them).
    val_sequences: the built-in corpus: windows held out of training at the end of the token stream; indexed data:
        at most this many of the held-out documents' windows, spread evenly, for evaluate.py. Written as the run's
        `val_tokens.npy`.
    reset_position_ids, reset_attention_mask, eod_mask_loss: Megatron's flags: position ids restart after every
        end-of-text token; attention stays inside each document; the target after an end-of-text token is not
        trained on (its label is -100).
    cache_dir: where the tokenizer and token files are built once and reused (None: $MTDEEPEP_DATA_CACHE, else
        ~/.cache/mtdeepep/data).
    """

    corpus: str = "python-stdlib"
    text_field: str = "text"
    tokenizer: str = "bpe"
    data_path: list | None = None
    held_out_documents: int | float = 0.01
    max_bytes: int | None = None
    val_sequences: int = 32
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.tokenizer, str) or not self.tokenizer:
            raise ValueError(f"[data] tokenizer must be {TOKENIZERS} or a path, got {self.tokenizer!r}")
        if self.tokenizer not in TOKENIZERS and not Path(self.tokenizer).exists():
            raise ValueError(
                f"[data] tokenizer {self.tokenizer!r}: not one of {TOKENIZERS}, and no such file or directory "
                "(a tokenizer.json or a tokenizer directory)"
            )
        if not isinstance(self.corpus, str) or not self.corpus:
            raise ValueError(f"[data] corpus must be a directory, a file or a glob, got {self.corpus!r}")
        if not isinstance(self.text_field, str) or not self.text_field:
            raise ValueError(f"[data] text_field must be a non-empty string, got {self.text_field!r}")
        if self.max_bytes is not None:
            positive_int("[data]", "max_bytes", self.max_bytes)
        if isinstance(self.val_sequences, bool) or not isinstance(self.val_sequences, int) or self.val_sequences < 0:
            raise ValueError(f"[data] val_sequences must be an int >= 0, got {self.val_sequences!r}")
        held = self.held_out_documents
        if (
            isinstance(held, bool)
            or not isinstance(held, (int, float))
            or held < 0
            or (isinstance(held, float) and held >= 1)
        ):
            raise ValueError(
                "[data] held_out_documents must be a document count (int >= 0) or a fraction (float in "
                f"[0, 1)), got {held!r}"
            )
        for name in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"[data] {name} must be true or false, got {getattr(self, name)!r}")
        if self.data_path is not None:
            self._check_data_path()

    def _check_data_path(self) -> None:
        if isinstance(self.data_path, str):
            self.data_path = [self.data_path]
        if not isinstance(self.data_path, (list, tuple)):
            raise ValueError(f"[data] data_path must be a list [w1, prefix1, ...], got {self.data_path!r}")
        items = list(self.data_path)
        for i, item in enumerate(items):
            if isinstance(item, bool) or not isinstance(item, (str, int, float)):
                raise ValueError(f"[data] data_path entry {i} ({item!r}): a weight (number) or a prefix")
        numbers = [i for i, item in enumerate(items) if not isinstance(item, str) or _is_number(item)]
        if numbers and len(items) % 2:
            raise ValueError(
                f"[data] data_path {items!r}: weights and prefixes come in pairs [w1, prefix1, w2, "
                f"prefix2, ...]; entry {numbers[-1]} ({items[numbers[-1]]!r}) has no prefix after it"
            )
        try:
            entries = parse_data_path(items)
        except ValueError as exc:
            raise ValueError(f"[data] {exc}") from None
        if any(e.weight is not None for e in entries):
            total = sum(e.weight for e in entries)
            if not total > 0:
                raise ValueError(f"[data] data_path weights sum to {total}: the sum must be positive")
        # The normalised spelling (weights as numbers) is what the run saves and compares on resume.
        self.data_path = [x for e in entries for x in ((e.weight, e.prefix) if e.weight is not None else (e.prefix,))]
        defaults = DataConfig()
        given = [n for n in ("corpus", "text_field", "max_bytes") if getattr(self, n) != getattr(defaults, n)]
        if given:
            raise ValueError(
                f"[data] data_path and {', '.join(given)} are both given: data_path trains on Megatron-"
                f"prepared indexed datasets, {given[0]} describes a text corpus to tokenize; give one of them"
            )
        if self.tokenizer == "bpe":
            raise ValueError(
                "[data] data_path needs the tokenizer that prepared the data (its end-of-text id, saved "
                'with the run): tokenizer = a tokenizer.json or tokenizer directory (or "bytes")'
            )

    @property
    def builtin(self) -> bool:
        """True for the built-in path: no data_path, a trained tokenizer ("bpe" / "bytes"), the default text_field
        and a corpus that is python-stdlib or a directory of `*.py` files only (moe/trainer/data/token_file.py,
        bit-identical to the runs before indexed data). Otherwise the data is indexed datasets."""
        return (
            self.data_path is None
            and self.tokenizer in TOKENIZERS
            and self.text_field == "text"
            and (self.corpus == "python-stdlib" or _python_only_directory(self.corpus))
        )


def _is_number(text: str) -> bool:
    """A weight as the command line gives it ("0.3")."""
    try:
        float(text)
    except ValueError:
        return False
    return True


def _python_only_directory(corpus: str) -> bool:
    """A directory (or a missing path, whose error the built-in path reports as before) whose files of the corpus
    formats are all `*.py`."""
    root = Path(corpus)
    if not root.is_dir():
        return not root.exists() and not any(c in corpus for c in "*?[")
    for p in root.rglob("*"):
        corpus_format = p.suffix in (".txt", ".md", ".jsonl", ".parquet") or p.name.endswith(".jsonl.gz")
        if corpus_format and "__pycache__" not in p.parts and p.is_file():
            return False
    return True


@dataclass(kw_only=True)
class TrainingConfig:
    """`[training]`: the loop's steps, batch and precision, and the model's build-time choices of attention backend
    and compile.

    The batch is given in sequences of `seq_len` tokens: `global_batch` per optimizer step, split over the
    data-parallel ranks and then into `micro_batches` per rank, so it must be divisible by `dp * micro_batches`
    (checked against the layout by `moe.trainer.train.parallel_state.Layout.check_batch`).
    """

    steps: int
    global_batch: int
    seq_len: int
    micro_batches: int = 1
    dtype: str = "float32"
    log_every: int = 10
    # MLA's attention core (Megatron's --attention-backend names; moe/trainer/models/deepseek_v3/attention.py): 'sdpa'
    # (default), 'unfused' (explicit GEMMs + softmax over the unpadded values) or 'auto' (unfused where it is the
    # cheaper on CPU: short float32 sequences). Not bit-identical to 'sdpa', so it is opt-in.
    attention_backend: str = "sdpa"
    # torch.compile of the model's static-shape parts (moe/trainer/models/deepseek_v3/compile.py); opt-in: the first
    # step pays the compilation.
    compile: bool = False

    def __post_init__(self) -> None:
        for name in ("steps", "global_batch", "seq_len", "micro_batches", "log_every"):
            positive_int("[training]", name, getattr(self, name))
        if self.seq_len < 2:
            raise ValueError(f"[training] seq_len must be >= 2 (next-token targets), got {self.seq_len}")
        if self.global_batch % self.micro_batches:
            raise ValueError(
                f"[training] global_batch={self.global_batch} is not divisible by micro_batches={self.micro_batches}"
            )
        _check_bools("[training]", self, ("compile",))
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"[training] attention_backend must be one of {ATTENTION_BACKENDS}, got "
                             f"{self.attention_backend!r}")  # fmt: skip
        if self.dtype not in DTYPES:
            raise ValueError(f"[training] dtype must be one of {DTYPES}, got {self.dtype!r}")

    @classmethod
    def from_toml(cls, path: str | Path) -> TrainingConfig:
        """The `[training]` table of the TOML file at `path` (a file in the old layout too: its moved keys are
        left to their tables, without a warning: this reads the loop's settings only)."""
        tables, _ = split_moved(read_toml(path))
        if "training" not in tables:
            raise ValueError(f"{path} has no [training] table")
        return build_table(cls, "training", tables["training"])


@dataclass(kw_only=True)
class OptimizerConfig:
    """`[optimizer]`: AdamW (`lr`, `betas`, `eps`, `weight_decay`; FP32 masters, moe/trainer/train/optim.py), the
    global gradient-norm clip (`clip_grad`, 0 = off) and the learning-rate schedule: linear warm-up over
    `warmup_steps`, then a cosine from `lr` to `min_lr` at the run's last step (moe/trainer/train/schedule.py)."""

    lr: float
    min_lr: float = 0.0
    warmup_steps: int = 0
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    clip_grad: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.lr, bool) or not isinstance(self.lr, (int, float)) or not self.lr > 0:
            raise ValueError(f"[optimizer] lr must be > 0, got {self.lr!r}")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"[optimizer] min_lr must be in [0, lr={self.lr}], got {self.min_lr!r}")
        _non_negative_int("[optimizer]", "warmup_steps", self.warmup_steps)
        betas = tuple(self.betas)
        if len(betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas):
            raise ValueError(f"[optimizer] betas must be two numbers in [0, 1), got {self.betas!r}")
        self.betas = (float(betas[0]), float(betas[1]))
        if not self.eps > 0:
            raise ValueError(f"[optimizer] eps must be > 0, got {self.eps!r}")
        if not self.weight_decay >= 0:
            raise ValueError(f"[optimizer] weight_decay must be >= 0, got {self.weight_decay!r}")
        if not self.clip_grad >= 0:
            raise ValueError(f"[optimizer] clip_grad must be >= 0 (0 = off), got {self.clip_grad!r}")


@dataclass(kw_only=True)
class DistributedOptimizerConfig:
    """`[zero]`, Megatron's names: ZeRO-1 (optimizer states and FP32 masters sharded over the data-parallel ranks),
    its gradient bucket size in elements (None: Megatron's default max(40M, 1M * dp)) and the overlap of the bucket
    reductions with the backward (moe/trainer/train/zero.py)."""

    use_distributed_optimizer: bool = False
    ddp_bucket_size: int | None = None
    overlap_grad_reduce: bool = True

    def __post_init__(self) -> None:
        _check_bools("[zero]", self, ("use_distributed_optimizer", "overlap_grad_reduce"))
        if self.ddp_bucket_size is not None:
            positive_int("[zero]", "ddp_bucket_size", self.ddp_bucket_size)


@dataclass(kw_only=True)
class CheckpointConfig:
    """`[checkpoint]`: a flash checkpoint every `checkpoint_every` steps (0: only the last step's, which is always
    taken; moe/trainer/train/checkpoint/)."""

    checkpoint_every: int = 0

    def __post_init__(self) -> None:
        _non_negative_int("[checkpoint]", "checkpoint_every", self.checkpoint_every)


@dataclass(kw_only=True)
class RewindConfig:
    """`[rewind]`: anomaly detection and rewind (moe/trainer/train/rewind.py has the semantics). Defaults: NaN/Inf
    checked (an anomaly without snapshots stops the run), spikes not, no snapshots."""

    check_for_nan_in_loss_and_grad: bool = True
    check_for_spiky_loss: bool = False
    spiky_loss_zscore: float = 6.0
    spiky_loss_window: int = 50
    spiky_loss_min_steps: int = 10
    rewind_snapshot_interval: int = 0
    rewind_max_retries: int = 3
    iterations_to_skip: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        _check_bools("[rewind]", self, ("check_for_nan_in_loss_and_grad", "check_for_spiky_loss"))
        positive_int("[rewind]", "spiky_loss_window", self.spiky_loss_window)
        for name in ("spiky_loss_min_steps", "rewind_snapshot_interval", "rewind_max_retries"):
            _non_negative_int("[rewind]", name, getattr(self, name))
        if self.spiky_loss_min_steps < 2:
            raise ValueError(f"[rewind] spiky_loss_min_steps must be >= 2 (a spread needs two losses), got "
                             f"{self.spiky_loss_min_steps}")  # fmt: skip
        if self.spiky_loss_min_steps > self.spiky_loss_window:
            raise ValueError(
                f"[rewind] spiky_loss_min_steps={self.spiky_loss_min_steps} exceeds spiky_loss_window="
                f"{self.spiky_loss_window}: the window never holds that many losses"
            )
        _positive_number("[rewind]", "spiky_loss_zscore", self.spiky_loss_zscore)
        skip = self.iterations_to_skip
        if not isinstance(skip, (list, tuple)) or any(isinstance(s, bool) or not isinstance(s, int) or s < 1
                                                      for s in skip):  # fmt: skip
            raise ValueError(f"[rewind] iterations_to_skip must be a list of steps >= 1, got {skip!r}")
        self.iterations_to_skip = tuple(sorted(set(skip)))


@dataclass(kw_only=True)
class StragglerConfig:
    """`[straggler]`: slow-rank detection (moe/trainer/train/straggler.py). With `log_straggler`, every rank times
    its phases and every `straggler_interval` steps a rank whose phase time exceeds the median over the ranks by
    `straggler_factor` and by `straggler_min_seconds` per step is reported."""

    log_straggler: bool = False
    straggler_interval: int = 10
    straggler_factor: float = 1.5
    straggler_min_seconds: float = 0.02

    def __post_init__(self) -> None:
        _check_bools("[straggler]", self, ("log_straggler",))
        positive_int("[straggler]", "straggler_interval", self.straggler_interval)
        _positive_number("[straggler]", "straggler_factor", self.straggler_factor)
        if self.straggler_factor <= 1:
            raise ValueError(
                f"[straggler] straggler_factor must be > 1 (times the median), got {self.straggler_factor}"
            )
        value = self.straggler_min_seconds
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise ValueError(f"[straggler] straggler_min_seconds must be a number >= 0, got {value!r}")


# Each table of the trainer and its dataclass, in the order the resolved config lists them.
SECTIONS: dict[str, type] = {
    "training": TrainingConfig,
    "optimizer": OptimizerConfig,
    "zero": DistributedOptimizerConfig,
    "checkpoint": CheckpointConfig,
    "rewind": RewindConfig,
    "straggler": StragglerConfig,
    "data": DataConfig,
}
REQUIRED = {"training": ("steps", "global_batch", "seq_len"), "optimizer": ("lr",)}

# The keys that left the flat [training] table: (old table, key) -> the new path (same key). `[training.data]` moved
# whole to `[data]`.
MOVED: dict[tuple[str, str], tuple[str, ...]] = {
    ("training", f.name): (section, f.name)
    for section in ("optimizer", "zero", "checkpoint", "rewind", "straggler")
    for f in fields(SECTIONS[section])
}
MOVED[("training", "data")] = ("data",)


@dataclass(kw_only=True)
class TrainerConfig:
    """What `moe.trainer.train.trainer.Trainer` is given: one config per component, each handed on alone (the
    optimizer gets `optimizer`, ZeRO-1 `zero`, the rewind guard `rewind`, ...)."""

    training: TrainingConfig
    optimizer: OptimizerConfig
    zero: DistributedOptimizerConfig = field(default_factory=DistributedOptimizerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    rewind: RewindConfig = field(default_factory=RewindConfig)
    straggler: StragglerConfig = field(default_factory=StragglerConfig)
    data: DataConfig = field(default_factory=DataConfig)

    @classmethod
    def flat(cls, **settings: Any) -> TrainerConfig:
        """From the keys of every component in one flat mapping (each key names its own table: `lr=...` goes to
        `[optimizer]`, `log_straggler=...` to `[straggler]`; `data` is the `[data]` table or a `DataConfig`), as
        tests and benches write a run's few settings."""
        tables: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
        for key, value in settings.items():
            tables[MOVED.get(("training", key), ("training",))[0]][key] = value
        data = tables.pop("data").get("data", {})
        built = {name: build_table(SECTIONS[name], name, table) for name, table in tables.items()}
        return cls(**built, data=data if isinstance(data, DataConfig) else build_table(DataConfig, "data", data))

    @classmethod
    def from_tables(cls, tables: Mapping[str, dict[str, Any]]) -> TrainerConfig:
        """From the trainer's tables (new layout; `split_moved` turns an old file's into them)."""
        return cls(**{name: build_table(SECTIONS[name], name, tables.get(name, {})) for name in SECTIONS})

    @classmethod
    def from_toml(cls, path: str | Path) -> TrainerConfig:
        """From the TOML file at `path`, in either layout (an old file's moved keys are warned about)."""
        tables, moved = split_moved(read_toml(path))
        warn_moved(moved, path)
        return cls.from_tables(tables)

    def to_tables(self) -> dict[str, dict[str, Any]]:
        """The resolved tables as plain TOML / JSON values (lists for tuples), every default filled in."""
        return {name: section_table(getattr(self, name)) for name in SECTIONS}


def section_table(config: Any) -> dict[str, Any]:
    """A component config's table: its fields, tuples as lists (TOML / JSON have no tuples)."""
    return {f.name: list(v) if isinstance(v := getattr(config, f.name), tuple) else v for f in fields(config)}


def build_table(cls: type, name: str, table: Mapping[str, Any]) -> Any:
    """`cls` from the `[name]` table: unknown keys and missing required keys raise ValueError naming the table."""
    _check_keys(f"[{name}]", table, cls)
    missing = [key for key in REQUIRED.get(name, ()) if key not in table]
    if missing:
        raise ValueError(f"[{name}] is missing {missing}")
    return cls(**table)


def split_moved(doc: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """`(the document in the new layout, a note per moved key)`: every key of `MOVED` found in `[training]` goes to
    its table. ValueError for a key given in both places."""
    return move_keys(doc, MOVED)


def warn_moved(notes: list[str], source: str | Path) -> None:
    """One `FutureWarning` naming every moved key and its new table (the old layout keeps working)."""
    if notes:
        warnings.warn(moved_keys_message(notes, source), FutureWarning, stacklevel=3)


def read_toml(path: str | Path) -> dict[str, Any]:
    """A TOML file's tables; ValueError if the file is missing or not TOML."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"config file {path} does not exist")
    with path.open("rb") as f:
        try:
            return tomllib.load(f)
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"{path}: not valid TOML: {exc}") from None


def _check_keys(where: str, table: Mapping[str, Any], cls: type) -> None:
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(table) - known)
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown} (known: {sorted(known)})")


def _check_bools(where: str, config: Any, names: tuple[str, ...]) -> None:
    for name in names:
        if not isinstance(getattr(config, name), bool):
            raise ValueError(f"{where} {name} must be true or false, got {getattr(config, name)!r}")


def positive_int(where: str, name: str, value: object) -> None:
    """ValueError naming `[table] name` (`where`, may be empty) unless `value` is an int > 0 (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{where} {name}".strip() + f" must be a positive int, got {value!r}")


def _non_negative_int(where: str, name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{where} {name} must be an int >= 0, got {value!r}")


def _positive_number(where: str, name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{where} {name} must be a number > 0, got {value!r}")
