"""Training data on disk in Megatron's formats (no training logic: the trainer, `moe.train`, builds on it).

- `indexed`: Megatron's `.bin` / `.idx` indexed dataset: the streaming, atomic `IndexedDatasetWriter`, the checked
  memory-mapped `IndexedDataset`, and `best_dtype(vocab_size)`.
- `blend`: Megatron's `--data-path` blend of weighted prefixes as deterministic windows of `seq_len` tokens.
"""
