"""DeepSeek-V3 on `moe.MoELayer`: config, model (MLA, DeepSeekMoE, MTP), parameter counts, checkpoint directories
and Hugging Face import/export."""

from moe.trainer.models.deepseek_v3.model import DeepseekV3ForCausalLM, DeepseekV3Output
from moe.trainer.models.deepseek_v3.model_config import DeepseekV3Config
from moe.trainer.models.deepseek_v3.model_dir import read_model_dir, write_model_dir
from moe.trainer.models.deepseek_v3.model_recompute import RecomputeConfig
from moe.trainer.models.deepseek_v3.params import ParameterCounts, count_parameters, parameter_counts

__all__ = [
    "RecomputeConfig",
    "DeepseekV3Config",
    "DeepseekV3ForCausalLM",
    "DeepseekV3Output",
    "ParameterCounts",
    "count_parameters",
    "parameter_counts",
    "read_model_dir",
    "write_model_dir",
]
