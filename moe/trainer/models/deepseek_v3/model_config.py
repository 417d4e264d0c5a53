"""`DeepseekV3Config`: transformers' `DeepseekV3Config` field names and defaults, plus our training extensions.

Sources it reads: the `[model]` table of our TOML configs (`from_toml`), a Hugging Face `config.json` (`from_dict`:
transformers' `rope_parameters`, or the official release's legacy `rope_scaling` + `rope_theta`), and the
`"mtdeepep"` key of our checkpoint directories (the extensions). `to_hf_dict` writes transformers' config.json.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROPE_TYPES = ("default", "yarn")
ROPE_KEYS = {
    "default": {"rope_type", "rope_theta"},
    "yarn": {
        "rope_type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
        "mscale_all_dim", "attention_factor", "truncate",
    },
}  # fmt: skip

# Our fields that transformers' DeepseekV3Config does not have: stored under "mtdeepep" in our config.json.
EXTENSION_FIELDS = ("mtp_loss_weight", "seq_aux_loss_coeff", "bias_update_speed")

# config.json keys of transformers / the official release that carry nothing for this model (ignored by from_dict).
_HF_IGNORED_KEYS = {
    "architectures", "model_type", "auto_map", "transformers_version", "torch_dtype", "dtype", "use_cache",
    "bos_token_id", "eos_token_id", "pad_token_id", "pretraining_tp", "attention_dropout", "output_router_logits",
    "quantization_config", "topk_method", "scoring_func", "moe_layer_freq", "ep_size", "aux_loss_alpha", "seq_aux",
    "num_mtp_layers", "hidden_act", "rope_scaling", "rope_theta", "qk_head_dim", "head_dim", "mtdeepep",
    "_name_or_path", "tie_encoder_decoder", "return_dict", "output_hidden_states", "output_attentions",
}  # fmt: skip


@dataclass(kw_only=True)
class DeepseekV3Config:
    """DeepSeek-V3 model settings. Defaults are transformers' (the 671B shapes).

    Field meanings follow transformers: MLA (`q_lora_rank` None = a plain `q_proj`; `kv_lora_rank`; per-head
    `qk_nope_head_dim`, `qk_rope_head_dim`, `v_head_dim`), dense SwiGLU for the first `first_k_dense_replace` layers
    (`intermediate_size`), DeepSeekMoE after (`n_routed_experts` of `moe_intermediate_size`, `n_shared_experts`,
    top-`num_experts_per_tok` of sigmoid scores limited to the best `topk_group` of `n_group` groups, weights
    normalised when `norm_topk_prob` and scaled by `routed_scaling_factor`), `num_nextn_predict_layers` MTP modules.
    `rope_parameters`: `{"rope_type": "default" | "yarn", "rope_theta": ..., and yarn's "factor",
    "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"}`.

    Ours:
        mtp_loss_weight: lambda of the MTP loss (DeepSeek-V3: 0.3, then 0.1); the training loss is
            `lm_loss + mtp_loss_weight * mean over depths of the depth's mean loss`.
        seq_aux_loss_coeff: alpha of DeepSeek's sequence-wise balance loss (MoELayer's 'seq_aux_loss'); 0 = off
            (DeepSeek-V3 used 1e-4).
        bias_update_speed: gamma of aux-loss-free balancing (the expert bias moves by this per update).
    """

    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    num_key_value_heads: int = 128
    n_shared_experts: int = 1
    n_routed_experts: int = 256
    routed_scaling_factor: float = 2.5
    kv_lora_rank: int = 512
    q_lora_rank: int | None = 1536
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    qk_nope_head_dim: int = 128
    n_group: int = 8
    topk_group: int = 4
    num_experts_per_tok: int = 8
    first_k_dense_replace: int = 3
    norm_topk_prob: bool = True
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    rope_parameters: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    rope_interleave: bool = True
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = 1
    initializer_range: float = 0.02

    # Ours.
    mtp_loss_weight: float = 0.3
    seq_aux_loss_coeff: float = 0.0
    bias_update_speed: float = 1e-3

    def __post_init__(self) -> None:
        self.rope_parameters = _standard_rope_parameters(self.rope_parameters, self.max_position_embeddings)
        self._coerce_and_check_types()
        self._validate_shapes()
        self._validate_routing()
        self._validate_rope()
        for name in ("routed_scaling_factor", "rms_norm_eps", "initializer_range"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in EXTENSION_FIELDS:
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    # -- derived sizes ------------------------------------------------------------------------------------------

    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key size: `qk_nope_head_dim + qk_rope_head_dim`."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether decoder layer `layer_idx` is an MoE layer (MTP blocks count from `num_hidden_layers` on, as in
        the released checkpoint, whose MTP block `model.layers.61` is an MoE block)."""
        return layer_idx >= self.first_k_dense_replace

    # -- readers and writers ------------------------------------------------------------------------------------

    @classmethod
    def from_toml(cls, path: str | Path) -> DeepseekV3Config:
        """The `[model]` table of a TOML file (with `[model.rope_parameters]`); unknown keys are an error."""
        try:
            import tomllib
        except ModuleNotFoundError:  # Python < 3.11
            import tomli as tomllib
        with open(path, "rb") as f:
            doc = tomllib.load(f)
        if "model" not in doc or not isinstance(doc["model"], dict):
            raise ValueError(f"{path}: no [model] table")
        return cls.from_dict(doc["model"], strict=True, source=str(path))

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, strict: bool = False, source: str = "config") -> DeepseekV3Config:
        """From our field names or a Hugging Face config.json.

        Accepts transformers' `rope_parameters` or the official release's legacy `rope_scaling` (`"type"` or
        `"rope_type"`) with a top-level `rope_theta`; our extensions may sit at the top level or under `"mtdeepep"`.
        `strict=True` (our TOML tables) rejects keys that are not fields; otherwise known transformers/release keys
        that do not apply are ignored and unknown ones too. `hidden_act` must be 'silu' and `model_type`
        'deepseek_v3' when present (a checkpoint of another model is refused, not read with default fields).
        """
        if not isinstance(d, dict):
            raise ValueError(f"{source}: expected a mapping, got {type(d).__name__}")
        d = copy.deepcopy(d)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names - ({"mtdeepep"} if not strict else set()))
        if strict and unknown:
            raise ValueError(f"{source}: unknown DeepseekV3Config fields {unknown}")
        if d.get("model_type", "deepseek_v3") != "deepseek_v3":
            other = d["model_type"]
            raise ValueError(f"{source}: model_type={other!r} is another model, not DeepSeek-V3 ('deepseek_v3')")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{source}: hidden_act={d['hidden_act']!r} is not supported (DeepSeek-V3 uses 'silu')")
        kwargs = {k: v for k, v in d.items() if k in names}
        extensions = d.get("mtdeepep") or {}
        if not isinstance(extensions, dict):
            raise ValueError(f"{source}: 'mtdeepep' must be a mapping")
        kwargs.update({k: v for k, v in extensions.items() if k in EXTENSION_FIELDS})
        if "num_nextn_predict_layers" not in kwargs and "num_mtp_layers" in d:
            kwargs["num_nextn_predict_layers"] = d["num_mtp_layers"]
        if kwargs.get("rope_parameters") is None:
            legacy = d.get("rope_scaling")
            rope = dict(legacy) if legacy else {"rope_type": "default"}
            if "type" in rope:
                rope.setdefault("rope_type", rope.pop("type"))
            rope.setdefault("rope_theta", d.get("rope_theta", 10000.0))
            kwargs["rope_parameters"] = rope
        try:
            return cls(**kwargs)
        except TypeError as exc:
            raise ValueError(f"{source}: {exc}") from None

    def to_hf_dict(self, dtype: str | None = None) -> dict[str, Any]:
        """transformers' config.json content (model_type 'deepseek_v3', `rope_parameters`), without our
        extensions. `dtype`: the checkpoint's dtype name (e.g. 'bfloat16'), written as `dtype` when given."""
        out: dict[str, Any] = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"}
        for f in dataclasses.fields(self):
            if f.name not in EXTENSION_FIELDS:
                out[f.name] = copy.deepcopy(getattr(self, f.name))
        out["hidden_act"] = "silu"
        if dtype is not None:
            out["dtype"] = dtype
        return out

    def extensions(self) -> dict[str, Any]:
        """Our fields that transformers does not know (written under "mtdeepep" in our config.json)."""
        return {name: getattr(self, name) for name in EXTENSION_FIELDS}

    def to_dict(self) -> dict[str, Any]:
        """Every field, ours included (`from_dict` reads it back)."""
        return dataclasses.asdict(self)

    # -- validation ---------------------------------------------------------------------------------------------

    def _coerce_and_check_types(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
            if kind == "bool":
                if not isinstance(value, bool):
                    raise ValueError(f"{f.name} must be a bool, got {value!r}")
            elif kind == "float":
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                    raise ValueError(f"{f.name} must be a finite number, got {value!r}")
                setattr(self, f.name, float(value))
            elif kind in ("int", "int | None"):
                if value is None and kind == "int | None":
                    continue
                if isinstance(value, bool) or not isinstance(value, int):
                    raise ValueError(f"{f.name} must be an int, got {value!r}")

    def _validate_shapes(self) -> None:
        positive = (
            "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "n_routed_experts", "kv_lora_rank", "qk_rope_head_dim",
            "v_head_dim", "qk_nope_head_dim", "n_group", "topk_group", "num_experts_per_tok",
            "max_position_embeddings",
        )  # fmt: skip
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("n_shared_experts", "first_k_dense_replace", "num_nextn_predict_layers"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise ValueError(f"q_lora_rank must be > 0 or None (a plain q_proj), got {self.q_lora_rank}")
        if self.num_key_value_heads != self.num_attention_heads:
            raise ValueError(
                f"num_key_value_heads={self.num_key_value_heads} must equal num_attention_heads="
                f"{self.num_attention_heads}: MLA expands its latent into one key and value per head"
            )
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even (rotary pairs)")

    def _validate_routing(self) -> None:
        E, G, K, TG = self.n_routed_experts, self.n_group, self.num_experts_per_tok, self.topk_group
        if E % G:
            raise ValueError(f"n_routed_experts={E} is not divisible into n_group={G} groups")
        if TG > G:
            raise ValueError(f"topk_group={TG} exceeds n_group={G}")
        per_group = E // G
        if per_group < 2:
            raise ValueError(
                f"n_routed_experts / n_group = {per_group}: a group needs at least 2 experts (a group's score is the "
                "sum of its top-2 expert scores)"
            )
        if TG * per_group < K:
            raise ValueError(
                f"num_experts_per_tok={K} exceeds the {TG * per_group} experts of the topk_group={TG} groups a token "
                f"may use ({per_group} experts per group)"
            )

    def _validate_rope(self) -> None:
        rope = self.rope_parameters
        kind = rope.get("rope_type")
        if kind not in ROPE_TYPES:
            raise ValueError(f"rope_parameters.rope_type must be one of {ROPE_TYPES}, got {kind!r}")
        extra = sorted(set(rope) - ROPE_KEYS[kind])
        if extra:
            raise ValueError(f"rope_parameters: keys {extra} do not apply to rope_type {kind!r}")
        if not _is_number(rope.get("rope_theta")) or not rope["rope_theta"] > 0:
            raise ValueError(f"rope_parameters.rope_theta must be > 0, got {rope.get('rope_theta')!r}")
        if kind == "yarn":
            for key in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow"):
                if not _is_number(rope.get(key)) or not rope[key] > 0:
                    raise ValueError(f"rope_parameters.{key} must be > 0 for yarn, got {rope.get(key)!r}")
            for key in ("mscale", "mscale_all_dim", "attention_factor"):
                if rope.get(key) is not None and (not _is_number(rope[key]) or rope[key] < 0):
                    raise ValueError(f"rope_parameters.{key} must be >= 0, got {rope[key]!r}")


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _standard_rope_parameters(rope: Any, max_position_embeddings: Any) -> dict[str, Any]:
    """A copy with transformers' defaults filled in: `rope_type` from a legacy `type`, yarn's
    `original_max_position_embeddings` = `max_position_embeddings` and `factor` = their ratio when absent."""
    if not isinstance(rope, dict):
        raise ValueError(f"rope_parameters must be a mapping, got {rope!r}")
    rope = dict(rope)
    if "type" in rope:
        rope.setdefault("rope_type", rope.pop("type"))
    rope.setdefault("rope_type", "default")
    rope.setdefault("rope_theta", 10000.0)
    if rope["rope_type"] == "yarn":
        rope.setdefault("original_max_position_embeddings", max_position_embeddings)
        if rope.get("factor") is None and _is_number(rope["original_max_position_embeddings"]):
            rope["factor"] = max_position_embeddings / rope["original_max_position_embeddings"]
        rope.setdefault("beta_fast", 32.0)
        rope.setdefault("beta_slow", 1.0)
    return rope
