"""Models built on the `moe` layer: `moe.models.deepseek_v3`."""
