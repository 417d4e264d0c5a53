"""Models built on the `moe` layer: `moe.trainer.models.deepseek_v3`."""
