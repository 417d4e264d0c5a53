"""DeepSeek-V3 on `moe.MoELayer`: config, model (MLA, DeepSeekMoE, MTP) and parameter counts."""

from moe.models.deepseek_v3.config import DeepseekV3Config
from moe.models.deepseek_v3.model import DeepseekV3ForCausalLM, DeepseekV3Output
from moe.models.deepseek_v3.params import ParameterCounts, count_parameters, parameter_counts

__all__ = [
    "DeepseekV3Config",
    "DeepseekV3ForCausalLM",
    "DeepseekV3Output",
    "ParameterCounts",
    "count_parameters",
    "parameter_counts",
]
