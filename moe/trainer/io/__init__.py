"""File formats and atomic writes shared by the models and the trainer (no training logic: `moe.trainer.models` reads
checkpoints through this package without importing `moe.trainer.train`).

- `atomic`: the one atomic publish of files and directories (`write_bytes`, `write_json`, `publish_directory`,
  `atomic_directory`).
- `boxes`: a rank's part of a layout-independent global tensor as boxes (experts, TP shards, ZeRO-1 ranges).
- `shard_files`: the files of a sharded checkpoint: streamed safetensors with sha256, the manifest, the resharding
  reader (`CheckpointReader`, `read_full_section`).
"""
