"""Training data on disk in Megatron's formats (no training logic: the trainer, `moe.trainer.train`, builds on it).

- `indexed`: Megatron's `.bin` / `.idx` indexed dataset: the streaming, atomic `IndexedDatasetWriter`, the checked
  memory-mapped `IndexedDataset`, and `best_dtype(vocab_size)`.
- `blend`: Megatron's `--data-path` blend of weighted prefixes as deterministic windows of `seq_len` tokens.
- `corpus`: the user's text corpora (`.txt` / `.md` / `.py` files, `.jsonl(.gz)` records, `.parquet` rows; a
  directory, a file or a glob), read as a stream of documents, with errors naming `path:line`.
- `tokenizer`: the tokenizer of a run: trained byte-level BPE / bytes, or a `tokenizer.json` / Hugging Face
  directory, with its end-of-text token and the `vocab_size` check.
- `tokenize`: the corpus tokenized by worker processes into indexed shards, streamed, in input order, published
  atomically.
"""
