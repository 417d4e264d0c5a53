"""All of the trainer's data: the formats on disk (Megatron's), the corpora and tokenizers, and the batches.

- `indexed`: Megatron's `.bin` / `.idx` indexed dataset: the streaming, atomic `IndexedDatasetWriter`, the checked
  memory-mapped `IndexedDataset`, and `best_dtype(vocab_size)`.
- `blend`: Megatron's `--data-path` blend of weighted prefixes as deterministic windows of `seq_len` tokens.
- `corpus`: the user's text corpora (`.txt` / `.md` / `.py` files, `.jsonl(.gz)` records, `.parquet` rows; a
  directory, a file or a glob), read as a stream of documents, with errors naming `path:line`.
- `tokenizer`: the tokenizer of a run: trained byte-level BPE / bytes, or a `tokenizer.json` / Hugging Face
  directory, with its end-of-text token and the `vocab_size` check.
- `tokenize`: the corpus tokenized by worker processes into indexed shards, streamed, in input order, published
  atomically.
- `token_file`: the built-in corpus, its trained tokenizer, the cached token file and `TokenBatches`.
- `source`: `DataSource`, the seam the trainer reads batches through; `blended_batches`: `BlendedBatches`.
- `run_data`: which of them a run's `[data]` table takes, checked before any process group.
"""
