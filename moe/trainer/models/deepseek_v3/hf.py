"""Hugging Face interoperability: our full state dict <-> the official DeepSeek-V3 / transformers checkpoint layout.

Official keys (what transformers' `save_pretrained` writes and the released checkpoint uses), per layer `i`:
    model.embed_tokens.weight, model.norm.weight, lm_head.weight (absent when tied)
    model.layers.{i}.input_layernorm.weight, .post_attention_layernorm.weight
    model.layers.{i}.self_attn.{q_a_proj, q_a_layernorm, q_b_proj | q_proj, kv_a_proj_with_mqa, kv_a_layernorm,
        kv_b_proj, o_proj}.weight (and .bias with attention_bias)
    dense:  model.layers.{i}.mlp.{gate,up,down}_proj.weight
    MoE:    model.layers.{i}.mlp.gate.weight, mlp.gate.e_score_correction_bias (float32),
            mlp.experts.{e}.{gate,up,down}_proj.weight, mlp.shared_experts.{gate,up,down}_proj.weight
    MTP k:  model.layers.{num_hidden_layers + k}.{enorm, hnorm, eh_proj, shared_head.norm, shared_head.head,
            embed_tokens} + the decoder layer's keys
Ours (model.py / block.py / mtp.py): `qkv_a_proj` = rows of `q_a_proj` (or `q_proj`) then `kv_a_proj_with_mqa`;
SwiGLU weights transposed and fused: `w13 [H, 2F] = [gate^T | up^T]`, `w2 [F, H] = down^T`; routed experts stacked
(`experts.w13 [E, H, 2F]`, `experts.w2 [E, F, H]`); `router.weight` / `router.expert_bias.bias` for `gate.weight` /
`gate.e_score_correction_bias`; MTP modules under `mtp.{k}.`.

Import also reads transformers' in-memory fused expert layout (`mlp.experts.gate_up_proj [E, 2F, H]`,
`mlp.experts.down_proj [E, H, F]`), sharded checkpoints (`model.safetensors.index.json`), the release's legacy
`rope_scaling`, and its FP8 weights (float8_e4m3fn with `weight_scale_inv` per 128x128 block, partial edge blocks
included), which are dequantised (`weight * scale_inv` per block).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moe.trainer.io.atomic import atomic_directory, write_bytes, write_json
from moe.trainer.models.deepseek_v3.full_state import TRANSIENT_SUFFIXES, full_state_dict_shapes
from moe.trainer.models.deepseek_v3.init import init_weights
from moe.trainer.models.deepseek_v3.model import DeepseekV3ForCausalLM
from moe.trainer.models.deepseek_v3.model_config import DeepseekV3Config
from moe.trainer.models.deepseek_v3.model_dir import main_dtype, read_model_dir, write_model_dir
from moe.trainer.models.deepseek_v3.model_tokens import TOKENIZER_FILE, config_eos_token_id, eos_token_id
from moe.trainer.models.deepseek_v3.moe_block import moe_config
from moe.trainer.models.deepseek_v3.mtp import MTPModule
from mtdeepep.utils.fp8 import dequantize_blocks

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3
FP8_DTYPES = (torch.float8_e4m3fn,)
SCALE_SUFFIX = "_scale_inv"
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")

Log = Callable[[str], None]


# ---------------------------------------------------------------------------------------------------------------
# Key layout
# ---------------------------------------------------------------------------------------------------------------


def _hf_prefix(key: str, config: DeepseekV3Config) -> tuple[str, str]:
    """Our key -> (official prefix, the rest of the key)."""
    if key in ("embed_tokens.weight", "norm.weight"):
        return "model.", key
    if key == "lm_head.weight":
        return "", key
    head, _, rest = key.partition(".")
    index, _, rest = rest.partition(".")
    if head == "layers" and index.isdigit():
        return f"model.layers.{index}.", rest
    if head == "mtp" and index.isdigit():
        return f"model.layers.{config.num_hidden_layers + int(index)}.", rest
    raise ValueError(f"unknown key {key!r}")


def _q_in_name(config: DeepseekV3Config) -> str:
    return "self_attn.q_a_proj" if config.q_lora_rank is not None else "self_attn.q_proj"


def _q_in_rows(config: DeepseekV3Config) -> int:
    return config.q_lora_rank if config.q_lora_rank is not None else config.num_attention_heads * config.qk_head_dim


def _split_swiglu(w13: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`[..., H, 2F]` -> (gate `[..., F, H]`, up `[..., F, H]`) in nn.Linear layout."""
    gate, up = w13.chunk(2, dim=-1)
    return gate.transpose(-1, -2).contiguous(), up.transpose(-1, -2).contiguous()


def to_hf_state_dict(state_dict: dict[str, torch.Tensor], config: DeepseekV3Config) -> dict[str, torch.Tensor]:
    """Our full state dict -> the official keys (tensors keep their dtype; the expert bias is float32). The MTP
    modules also get the release's copies of the embedding and the output head (cloned)."""
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state_dict.items():
        if key.endswith(TRANSIENT_SUFFIXES):
            continue
        prefix, rest = _hf_prefix(key, config)
        for name, value in _layer_to_hf(rest, tensor, config).items():
            out[prefix + name] = value.contiguous()
    head = state_dict["embed_tokens.weight"] if config.tie_word_embeddings else state_dict["lm_head.weight"]
    for k in range(config.num_nextn_predict_layers):
        prefix = f"model.layers.{config.num_hidden_layers + k}."
        # Copies, not views: safetensors refuses to store tensors that share memory.
        out[prefix + "embed_tokens.weight"] = state_dict["embed_tokens.weight"].clone()
        out[prefix + "shared_head.head.weight"] = head.clone()
    return out


def _layer_to_hf(rest: str, t: torch.Tensor, config: DeepseekV3Config) -> dict[str, torch.Tensor]:
    if rest.startswith("self_attn.qkv_a_proj."):
        param = rest.rsplit(".", 1)[1]
        q, kv = t.split([_q_in_rows(config), t.size(0) - _q_in_rows(config)])
        return {f"{_q_in_name(config)}.{param}": q, f"self_attn.kv_a_proj_with_mqa.{param}": kv}
    if rest in ("mlp.w13", "mlp.shared_experts.w13"):
        gate, up = _split_swiglu(t)
        base = rest[: -len("w13")]
        return {base + "gate_proj.weight": gate, base + "up_proj.weight": up}
    if rest in ("mlp.w2", "mlp.shared_experts.w2"):
        return {rest[: -len("w2")] + "down_proj.weight": t.t()}
    if rest == "mlp.router.weight":
        return {"mlp.gate.weight": t}
    if rest == "mlp.router.expert_bias.bias":
        return {"mlp.gate.e_score_correction_bias": t.float()}
    if rest == "mlp.experts.w13":
        gate, up = _split_swiglu(t)
        out = {}
        for e in range(t.size(0)):
            out[f"mlp.experts.{e}.gate_proj.weight"] = gate[e]
            out[f"mlp.experts.{e}.up_proj.weight"] = up[e]
        return out
    if rest == "mlp.experts.w2":
        down = t.transpose(1, 2)
        return {f"mlp.experts.{e}.down_proj.weight": down[e] for e in range(t.size(0))}
    return {rest: t}


class _Source:
    """The official tensors, consumed as they are mapped (what is left over is reported)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def pop(self, key: str) -> torch.Tensor:
        if key not in self.tensors:
            raise ValueError(f"the checkpoint has no tensor {key!r}")
        return self.tensors.pop(key)

    def has(self, key: str) -> bool:
        return key in self.tensors


def _swiglu_from_hf(src: _Source, base: str) -> torch.Tensor:
    gate, up = _common_dtype(src.pop(base + "gate_proj.weight"), src.pop(base + "up_proj.weight"))
    return torch.cat((gate.t(), up.t()), dim=1)


def _common_dtype(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Tensors fused into one weight in their widest dtype (an exact upcast; never a downcast)."""
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return [t.to(dtype) for t in tensors]


def _layer_from_hf(rest: str, p: str, src: _Source, config: DeepseekV3Config, num_experts: int) -> torch.Tensor:
    """Our tensor `rest` of the layer whose official prefix is `p`."""
    if rest.startswith("self_attn.qkv_a_proj."):
        param = rest.rsplit(".", 1)[1]
        q, kv = _common_dtype(
            src.pop(f"{p}{_q_in_name(config)}.{param}"), src.pop(f"{p}self_attn.kv_a_proj_with_mqa.{param}")
        )
        return torch.cat((q, kv))
    if rest in ("mlp.w13", "mlp.shared_experts.w13"):
        return _swiglu_from_hf(src, p + rest[: -len("w13")])
    if rest in ("mlp.w2", "mlp.shared_experts.w2"):
        return src.pop(p + rest[: -len("w2")] + "down_proj.weight").t().contiguous()
    if rest == "mlp.router.weight":
        return src.pop(p + "mlp.gate.weight")
    if rest == "mlp.router.expert_bias.bias":
        return src.pop(p + "mlp.gate.e_score_correction_bias").float()
    if rest == "mlp.experts.w13":
        if src.has(p + "mlp.experts.gate_up_proj"):  # transformers' fused in-memory layout [E, 2F, H]
            return src.pop(p + "mlp.experts.gate_up_proj").transpose(1, 2).contiguous()
        return torch.stack([_swiglu_from_hf(src, f"{p}mlp.experts.{e}.") for e in range(num_experts)])
    if rest == "mlp.experts.w2":
        if src.has(p + "mlp.experts.down_proj"):  # [E, H, F]
            return src.pop(p + "mlp.experts.down_proj").transpose(1, 2).contiguous()
        return torch.stack([src.pop(f"{p}mlp.experts.{e}.down_proj.weight").t() for e in range(num_experts)])
    return src.pop(p + rest)


def expected_keys(config: DeepseekV3Config) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Our full state dict's keys -> (shape, float32-model dtype), from a meta-device model."""
    return full_state_dict_shapes(DeepseekV3ForCausalLM(config, device="meta"))


def from_hf_state_dict(
    hf: dict[str, torch.Tensor],
    config: DeepseekV3Config,
    *,
    seed: int = 0,
    log: Log = print,
) -> dict[str, torch.Tensor]:
    """Official keys -> our full state dict (dtypes kept; FP8 must be dequantised first, see `dequantize_fp8`).

    MTP depths whose weights are missing (transformers does not save MTP layers) are freshly initialised from
    `seed` in the checkpoint's dtype, with a message through `log`. Tensors the model has no place for raise a
    ValueError, except the MTP modules' copies of the embedding and output head (checked against the main ones)
    and MTP layers beyond `num_nextn_predict_layers` (ignored, with a message).
    """
    src = _Source(dict(hf))
    N, D = config.num_hidden_layers, config.num_nextn_predict_layers
    present_layers = {int(m.group(1)) for k in hf for m in [_LAYER_RE.match(k)] if m}
    missing_depths = [k for k in range(D) if N + k not in present_layers]
    shapes = expected_keys(config)
    out: dict[str, torch.Tensor] = {}
    for key, (shape, _) in shapes.items():
        prefix, rest = _hf_prefix(key, config)
        if key.startswith("mtp.") and int(key.split(".")[1]) in missing_depths:
            continue
        value = _layer_from_hf(rest, prefix, src, config, config.n_routed_experts)
        if value.shape != shape:
            raise ValueError(f"{key} (from {prefix}{rest}): shape {tuple(value.shape)}, expected {tuple(shape)}")
        out[key] = value.contiguous()
    _check_leftovers(src, out, config, log)
    if missing_depths:
        dtype = main_dtype(out)
        out.update(fresh_mtp_state(config, missing_depths, dtype, seed))
        log(
            f"the checkpoint has no weights for MTP depth(s) {[k + 1 for k in missing_depths]} "
            f"(model.layers.{N + missing_depths[0]}.* and on): initialised freshly from seed {seed} in {dtype}"
        )
    return out


def _check_leftovers(src: _Source, out: dict[str, torch.Tensor], config: DeepseekV3Config, log: Log) -> None:
    N, D = config.num_hidden_layers, config.num_nextn_predict_layers
    head = out.get("embed_tokens.weight") if config.tie_word_embeddings else out.get("lm_head.weight")
    copies = {"embed_tokens.weight": out.get("embed_tokens.weight"), "shared_head.head.weight": head}
    ignored_depths, unknown = set(), []
    for key in sorted(src.tensors):
        m = _LAYER_RE.match(key)
        layer = int(m.group(1)) if m else None
        rest = key[m.end() :] if m else key
        if layer is not None and layer >= N + D:
            ignored_depths.add(layer)
        elif layer is not None and layer >= N and rest in copies:
            main = copies[rest]
            if main is not None and not torch.equal(src.tensors[key].to(main.dtype), main):
                log(f"{key} differs from the main model's; the model shares the main one (as DeepSeek-V3 does)")
        elif key == "lm_head.weight" and config.tie_word_embeddings:
            if not torch.equal(src.tensors[key].to(head.dtype), head):
                raise ValueError("tie_word_embeddings is set but lm_head.weight differs from model.embed_tokens.weight")
        elif rest.endswith("rotary_emb.inv_freq"):
            continue  # computed from the config
        else:
            unknown.append(key)
    if unknown:
        raise ValueError(f"the checkpoint holds tensors this model has no place for: {unknown[:20]}")
    if ignored_depths:
        log(f"ignored the checkpoint's layers {sorted(ignored_depths)}: MTP depths beyond num_nextn_predict_layers={D}")


def fresh_mtp_state(
    config: DeepseekV3Config, depths: list[int], dtype: torch.dtype, seed: int
) -> dict[str, torch.Tensor]:
    """Freshly initialised weights of MTP modules `depths` (0-based), named `mtp.{k}.*`, as a whole model built
    with base seed `seed` would hold them (init.py)."""
    out = {}
    for k in depths:
        moe_kwargs = dict(config=moe_config(config)) if config.is_moe_layer(config.num_hidden_layers + k) else None
        module = MTPModule(config, k, moe_layer_kwargs=moe_kwargs, dtype=dtype)
        init_weights(module, seed, config.initializer_range, prefix=f"mtp.{k}.")
        for name, tensor in module.state_dict().items():
            if not name.endswith(TRANSIENT_SUFFIXES):
                out[f"mtp.{k}.{name}"] = tensor.detach()
    return out


# ---------------------------------------------------------------------------------------------------------------
# FP8 (the official release)
# ---------------------------------------------------------------------------------------------------------------


def dequantize_fp8(
    hf: dict[str, torch.Tensor], dtype: torch.dtype, block: tuple[int, int] = (128, 128)
) -> tuple[dict[str, torch.Tensor], int]:
    """Replace every float8_e4m3fn `W` with `W * scale_inv` per `block` (`{key}_scale_inv`, float32
    `[ceil(M/128), ceil(N/128)]`, ragged edge blocks allowed), cast to `dtype`. Returns the new dict and how many
    weights were dequantised; a FP8 weight without its scale, or a scale of the wrong shape, is a ValueError."""
    out, count = {}, 0
    for key, tensor in hf.items():
        if key.endswith(SCALE_SUFFIX):
            if key[: -len(SCALE_SUFFIX)] not in hf:
                raise ValueError(f"{key} scales no tensor of the checkpoint")
            continue
        if tensor.dtype not in FP8_DTYPES:
            out[key] = tensor
            continue
        scale = hf.get(key + SCALE_SUFFIX)
        if scale is None:
            raise ValueError(f"{key} is {tensor.dtype} but the checkpoint has no {key + SCALE_SUFFIX}")
        if tensor.dim() != 2:
            raise ValueError(f"{key}: block-scaled FP8 weights must be 2-D, got {tuple(tensor.shape)}")
        rows, cols = tensor.shape
        expected = (-(-rows // block[0]), -(-cols // block[1]))
        if tuple(scale.shape) != expected:
            raise ValueError(f"{key}{SCALE_SUFFIX}: shape {tuple(scale.shape)}, expected {expected} for {block} blocks")
        out[key] = dequantize_blocks(tensor, scale, block).to(dtype)
        count += 1
    return out, count


# ---------------------------------------------------------------------------------------------------------------
# Directories
# ---------------------------------------------------------------------------------------------------------------


def read_hf_dir(path: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """`(tensors, config.json dict)` of a Hugging Face directory (one safetensors file or an index of shards)."""
    path = Path(path)
    config_path = path / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{path} has no config.json")
    with open(config_path) as f:
        config = json.load(f)
    if (path / SAFE_INDEX).is_file():
        with open(path / SAFE_INDEX) as f:
            weight_map = json.load(f)["weight_map"]
        files = sorted(set(weight_map.values()))
    elif (path / SAFE_WEIGHTS).is_file():
        weight_map, files = None, [SAFE_WEIGHTS]
    else:
        raise FileNotFoundError(f"{path} has neither {SAFE_WEIGHTS} nor {SAFE_INDEX} (only safetensors are read)")
    tensors = {}
    for name in files:
        with safe_open(str(path / name), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if key in tensors:
                    raise ValueError(f"{key} appears in more than one shard")
                tensors[key] = f.get_tensor(key)
    if weight_map is not None:
        missing = sorted(set(weight_map) - set(tensors))
        if missing:
            raise ValueError(f"{SAFE_INDEX} lists tensors its shards do not hold: {missing[:20]}")
    return tensors, config


def import_hf(
    hf_dir: str | Path,
    out_dir: str | Path,
    *,
    fp8_dtype: torch.dtype | None = None,
    seed: int = 0,
    overwrite: bool = False,
    log: Log = print,
) -> DeepseekV3Config:
    """Hugging Face directory -> our model directory (model_dir.py). Tensors keep their dtype; FP8 weights are
    dequantised to `fp8_dtype` (None: the checkpoint's main dtype, that of the embedding, as DeepSeek's own
    conversion does), with a message. config.json's `eos_token_id` is kept and `tokenizer.json` copied when
    present (generation needs both). Returns the config."""
    hf, config_dict = read_hf_dir(hf_dir)
    source = str(Path(hf_dir) / "config.json")
    config = DeepseekV3Config.from_dict(config_dict, source=source)
    eos = config_eos_token_id(config_dict, source)
    if any(t.dtype in FP8_DTYPES for t in hf.values()):
        quant = config_dict.get("quantization_config") or {}
        block = tuple(quant.get("weight_block_size", (128, 128)))
        embed = hf.get("model.embed_tokens.weight")
        target = fp8_dtype or (embed.dtype if embed is not None and embed.dtype not in FP8_DTYPES else torch.bfloat16)
        hf, count = dequantize_fp8(hf, target, block)
        log(f"dequantised {count} FP8 weights ({block[0]}x{block[1]} block scales) to {target}")
    state = from_hf_state_dict(hf, config, seed=seed, log=log)
    tokenizer = Path(hf_dir) / TOKENIZER_FILE
    write_model_dir(
        out_dir,
        state,
        config,
        overwrite=overwrite,
        eos_token_id=eos,
        write_extra=(lambda tmp: copy_file(tokenizer, tmp)) if tokenizer.is_file() else None,
    )
    return config


def copy_file(path: Path, directory: Path) -> None:
    """Copy `path` into `directory` under its name (fsynced, as the directory's other files)."""
    write_bytes(directory / path.name, path.read_bytes())


def _natural_key(key: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", key)]


def write_hf_dir(
    path: str | Path,
    tensors: dict[str, torch.Tensor],
    config_dict: dict,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
    extra_files: tuple[Path, ...] = (),
) -> Path:
    """Write `config.json` and the tensors as `model.safetensors`, or as shards `model-0000i-of-0000n.safetensors`
    with `model.safetensors.index.json` when they exceed `max_shard_bytes`, and copy `extra_files` in (atomically,
    see model_dir.py)."""
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be > 0, got {max_shard_bytes}")
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = total = 0
    seen: set[tuple[int, int]] = set()
    for key in sorted(tensors, key=_natural_key):
        t = tensors[key].detach().to("cpu").contiguous()
        if (t.data_ptr(), t.numel()) in seen:  # the release's MTP copies of the embedding/head: stored twice
            t = t.clone()
        seen.add((t.data_ptr(), t.numel()))
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = t
        size += nbytes
        total += nbytes

    def fill(tmp: Path) -> None:
        write_json(tmp / "config.json", config_dict, indent=2)
        for path in extra_files:
            copy_file(Path(path), tmp)
        if len(shards) == 1:
            save_file(shards[0], str(tmp / SAFE_WEIGHTS), metadata={"format": "pt"})
            return
        weight_map = {}
        for i, shard in enumerate(shards, start=1):
            name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(tmp / name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, name))
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        write_bytes(tmp / SAFE_INDEX, (json.dumps(index, indent=2) + "\n").encode())

    return atomic_directory(path, fill, overwrite=overwrite)


def export_hf(
    checkpoint_dir: str | Path,
    out_dir: str | Path,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
) -> Path:
    """Our model directory -> a Hugging Face directory that transformers' `DeepseekV3ForCausalLM.from_pretrained`
    loads (config.json with model_type 'deepseek_v3' and `rope_parameters`; official keys, MTP layers included;
    tensors in their trained dtype). config.json's `eos_token_id` is the checkpoint's (tokenizer.py's
    `eos_token_id`: its config.json, else its tokenizer's end-of-text token), null when it has none, so that
    transformers does not fall back to its own default id; the checkpoint's `tokenizer.json` is copied along."""
    state, config = read_model_dir(checkpoint_dir)
    hf = to_hf_state_dict(state, config)
    config_dict = config.to_hf_dict(dtype=str(main_dtype(state)).removeprefix("torch."))
    config_dict["eos_token_id"] = eos_token_id(checkpoint_dir)
    tokenizer = Path(checkpoint_dir) / TOKENIZER_FILE
    return write_hf_dir(
        out_dir,
        hf,
        config_dict,
        max_shard_bytes=max_shard_bytes,
        overwrite=overwrite,
        extra_files=(tokenizer,) if tokenizer.is_file() else (),
    )
