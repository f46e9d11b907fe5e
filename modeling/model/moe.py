"""The sparse MLP of a mixture-of-experts layer (qwen3_moe, qwen2_moe, Qwen3.5-MoE): a router, E
routed experts (SwiGLU MLPs of ``moe_intermediate_size`` I) and, in qwen2_moe and Qwen3.5-MoE, a
shared expert (of ``shared_expert_intermediate_size`` Is) behind a sigmoid gate.

    logits = linear(h, router_weight)                 [N, E] (+ the shared expert's gate: [N, E + 1])
    weights, ids = moe_topk_softmax(logits[:, :E], k, config.norm_topk_prob)
    shared = linear(silu_mul(linear(h, shared_gate_up)), shared_down)
    y = fused_moe(h, experts_gate_up, experts_down, weights, ids, shared, logits[:, E:],
                  experts_gate_up_scale_inv, experts_down_scale_inv)
      = sum_j weights[:, j] * expert_{ids[:, j]}(h) + sigmoid(logits[:, E]) * shared

Parameters: ``router_weight`` [E (+1), H] (the router, then the shared expert's gate: one GEMM
gives both), ``experts_gate_up`` [E, 2I, H] (each expert's [gate; up]), ``experts_down`` [E, H, I],
``shared_gate_up`` [2Is, H], ``shared_down`` [H, Is]; FP8: the experts (``EXPERT_WEIGHTS``) and the
shared expert (``LINEAR_WEIGHTS``), the router stays in the model's dtype. ``plan`` reads the
experts one by one or fused (docs/modeling.md, "Mixture of experts").
"""

import torch
from torch import Tensor, nn

import qwen_ops  # noqa: F401  (registers torch.ops.qwen)

from . import fp8
from .config import QwenConfig

ops = torch.ops.qwen

FUSED_EXPERTS = "mlp.experts.gate_up_proj"
"""The name (under a layer's prefix) that marks a checkpoint whose experts are fused."""


class SparseMoeBlock(nn.Module):
    """The routed experts and the gated shared expert of one layer (see the module doc)."""

    EXPERT_WEIGHTS = ("experts_gate_up", "experts_down")
    """The experts' weights [E, N, K], FP8 with ``<name>_scale_inv`` where the loader keeps them so."""
    LINEAR_WEIGHTS = ("shared_gate_up", "shared_down")
    """The shared expert's weights: FP8 as a dense layer's (``modeling.model.fp8.linear``)."""

    def __init__(self, config: QwenConfig):
        super().__init__()
        c = self.config = config
        e, hidden, inter, shared = (c.num_experts, c.hidden_size, c.moe_intermediate_size,
                                    c.shared_expert_intermediate_size)
        self.router_weight = nn.Parameter(torch.empty(e + (1 if shared else 0), hidden))
        self.experts_gate_up = nn.Parameter(torch.empty(e, 2 * inter, hidden))
        self.experts_down = nn.Parameter(torch.empty(e, hidden, inter))
        self.shared_gate_up = nn.Parameter(torch.empty(2 * shared, hidden)) if shared else None
        self.shared_down = nn.Parameter(torch.empty(hidden, shared)) if shared else None
        fp8.register_parts(self, self.LINEAR_WEIGHTS if shared else (), self.EXPERT_WEIGHTS)

    @staticmethod
    def plan(config: QwenConfig, hf: str, fused_experts: bool):
        """The block's parameters (named ``mlp.*``) from the checkpoint tensors under ``hf`` (a
        layer's prefix), the experts fused or one by one. Per expert, the loader stacks the rows
        [E * 2I, H] / [E * H, I], which the model views as [E, 2I, H] / [E, H, I]."""
        c, mlp = config, hf + "mlp."
        e, hidden, inter, shared = (c.num_experts, c.hidden_size, c.moe_intermediate_size,
                                    c.shared_expert_intermediate_size)
        router = [(mlp + "gate.weight", (e, hidden))]
        if fused_experts:
            gate_up = [(mlp + "experts.gate_up_proj", (e, 2 * inter, hidden))]
            down = [(mlp + "experts.down_proj", (e, hidden, inter))]
        else:
            gate_up = [(f"{mlp}experts.{i}.{p}_proj.weight", (inter, hidden)) for i in range(e) for p in ("gate", "up")]
            down = [(f"{mlp}experts.{i}.down_proj.weight", (hidden, inter)) for i in range(e)]
        plan = {"mlp.router_weight": router, "mlp.experts_gate_up": gate_up, "mlp.experts_down": down}
        if shared:
            router.append((mlp + "shared_expert_gate.weight", (1, hidden)))
            plan["mlp.shared_gate_up"] = [(mlp + "shared_expert.gate_proj.weight", (shared, hidden)),
                                          (mlp + "shared_expert.up_proj.weight", (shared, hidden))]
            plan["mlp.shared_down"] = [(mlp + "shared_expert.down_proj.weight", (hidden, shared))]
        return plan

    def forward(self, h: Tensor) -> Tensor:
        """h [..., H] (the normed stream) -> the block's output [..., H]."""
        c = self.config
        e = c.num_experts
        h2 = h.reshape(-1, h.shape[-1])
        logits = ops.linear(h2, self.router_weight)
        weights, ids = ops.moe_topk_softmax(logits[:, :e], c.num_experts_per_tok, c.norm_topk_prob)
        shared = gate = None
        if self.shared_gate_up is not None:
            gate_up = fp8.module_linear(self, h2, "shared_gate_up")
            shared = fp8.module_linear(self, ops.silu_mul(gate_up), "shared_down")
            gate = logits[:, e:]
        y = ops.fused_moe(h2, self.experts_gate_up, self.experts_down, weights, ids, shared, gate,
                          self.experts_gate_up_scale_inv, self.experts_down_scale_inv)
        return y.view(h.shape)
