"""torch.compile of DeepSeek-V3's static-shape parts (`[training] compile`, opt-in).

What is compiled: every decoder layer's (and MTP depth's) Multi-head Latent Attention module, with inductor and
static shapes. Its work per micro-batch has one shape for the whole run (the sequence length and micro-batch size
are fixed), so it compiles once, on the first step; inductor fuses its element-wise chains (the RMSNorms, the RoPE
rotations and the q / k concatenation, the mask and softmax of the unfused core) into a few C++ loops around the
GEMMs it leaves to the BLAS library.

What is not: the MoE layers. Their routed experts see a different number of rows per expert every step (a
data-dependent shape: one recompilation per new shape, or dynamic-shape kernels), and their dispatch reads the
counts on the host (`tolist`), which breaks the graph. The loss head and the embedding are single GEMMs or lookups.

Numerics: inductor reorders and fuses float operations (reductions in another order, FMA), so the results are not
bit-identical to eager; `tests/models/test_dsv3_compile.py` bounds the difference.

Recompute: selective recompute of the attention's parts ('mla_up_proj', 'core_attn', 'layernorm') registers
saved-tensor hooks and storage pointers that dynamo does not trace; those calls run eagerly inside the compiled
module (graph breaks), which stays correct.
"""

from __future__ import annotations

from torch import nn

from moe.trainer.models.deepseek_v3.attention import MultiHeadLatentAttention


def compile_model(model: nn.Module, backend: str = "inductor") -> list[str]:
    """Compile (in place, `nn.Module.compile`) every MLA module of `model`; returns their names. The compilation
    itself happens at the first forward of each."""
    names = []
    for name, module in model.named_modules():
        if isinstance(module, MultiHeadLatentAttention):
            module.compile(backend=backend, dynamic=False)
            names.append(name)
    return names
