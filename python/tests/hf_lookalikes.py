"""Look-alikes of Hugging Face transformers 5.x MoE blocks, written for the tests (transformers is not
needed): the same attribute names, parameter shapes, router return values and forward structure as the
real classes, named like them, with small sizes.

- routers: a top-k router returning (logits, weights, indices) (Qwen3-MoE, Qwen2-MoE, Qwen3-Next, OLMoE,
  Mixtral, GPT-OSS), and DeepSeek's router returning fp32 logits with the block's route_tokens_to_experts
  (sigmoid, correction bias for the choice only, group-limited top-k, renormalisation, scaling: V3 and
  GLM-4.5; softmax and group-limited greedy: V2);
- experts: a fused module with gate_up_proj [E, 2I, H] and down_proj [E, H, I] called as
  experts(x, top_k_index, top_k_weights), its eager forward adding each expert's weighted rows into a
  tensor of the input dtype (index_add_), in expert order; GPT-OSS's transposed [E, H, 2I] / [E, I, H]
  with biases and the clamped, interleaved SwiGLU (alpha 1.702, limit 7);
- shared experts: DeepSeek's plain shared_experts, Qwen2-MoE's sigmoid-gated shared_expert;
- Llama 4's block, which weights the expert input, and a transformers 4.x block with one module per
  expert (both refused by quantize_moe);
- models: model.layers.{i}.mlp (causal LMs), block_sparse_moe, feed_forward, and a vision-language
  wrapper whose decoder is model.language_model.layers.
"""

import torch
import torch.nn.functional as F


def _init(module, seed, scale=0.2):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * scale)
    return module


class TopKRouter(torch.nn.Module):
    """Qwen3MoeTopKRouter / MixtralTopKRouter / OlmoeTopKRouter / Qwen2MoeTopKRouter: softmax in fp32,
    top-k, optional renormalisation; returns (logits, weights, indices)."""

    def __init__(self, hidden, experts, top_k, norm_topk_prob=True):
        super().__init__()
        self.top_k, self.num_experts, self.norm_topk_prob, self.hidden_dim = top_k, experts, norm_topk_prob, hidden
        self.weight = torch.nn.Parameter(torch.zeros(experts, hidden))

    def forward(self, hidden_states):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        router_logits = F.linear(hidden_states, self.weight)
        probs = torch.softmax(router_logits, dim=-1, dtype=torch.float)
        top_value, top_index = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_value = top_value / top_value.sum(dim=-1, keepdim=True)
        return router_logits, top_value.to(router_logits.dtype), top_index


class FusedExperts(torch.nn.Module):
    """Qwen3MoeExperts / MixtralExperts / DeepseekV3NaiveMoe: 3-D weights, eager forward."""

    def __init__(self, hidden, intermediate, experts):
        super().__init__()
        self.num_experts = experts
        self.gate_up_proj = torch.nn.Parameter(torch.zeros(experts, 2 * intermediate, hidden))
        self.down_proj = torch.nn.Parameter(torch.zeros(experts, hidden, intermediate))
        self.act_fn = torch.nn.SiLU()

    def expert(self, e, x):
        gate, up = F.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
        return F.linear(self.act_fn(gate) * up, self.down_proj[e])

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return eager_experts(self, hidden_states, top_k_index, top_k_weights)


def eager_experts(experts, hidden_states, top_k_index, top_k_weights):
    """The eager experts forward: each expert hit, on its tokens in (slot, token) order, weighted rows added
    into a tensor of the input dtype (a rounding per add), expert after expert."""
    final = torch.zeros_like(hidden_states)
    with torch.no_grad():
        mask = F.one_hot(top_k_index, num_classes=experts.num_experts).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
    for e in hit:
        e = e[0]
        pos, tok = torch.where(mask[e])
        out = experts.expert(e, hidden_states[tok]) * top_k_weights[tok, pos, None]
        final.index_add_(0, tok, out.to(final.dtype))
    return final


class GptOssExperts(torch.nn.Module):
    """Transposed weights with biases, the clamped interleaved SwiGLU; forward(x, router_indices, routing_weights)."""

    def __init__(self, hidden, intermediate, experts):
        super().__init__()
        self.num_experts = experts
        self.gate_up_proj = torch.nn.Parameter(torch.zeros(experts, hidden, 2 * intermediate))
        self.gate_up_proj_bias = torch.nn.Parameter(torch.zeros(experts, 2 * intermediate))
        self.down_proj = torch.nn.Parameter(torch.zeros(experts, intermediate, hidden))
        self.down_proj_bias = torch.nn.Parameter(torch.zeros(experts, hidden))
        self.alpha, self.limit = 1.702, 7.0

    def _apply_gate(self, gate_up):
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def expert(self, e, x):
        h = x @ self.gate_up_proj[e] + self.gate_up_proj_bias[e]
        return self._apply_gate(h) @ self.down_proj[e] + self.down_proj_bias[e]

    def forward(self, hidden_states, router_indices=None, routing_weights=None):
        return eager_experts(self, hidden_states, router_indices, routing_weights)


class GptOssTopKRouter(torch.nn.Module):
    """Linear with bias, top-k of the logits, softmax over the k values; returns (logits, scores, indices)."""

    def __init__(self, hidden, experts, top_k):
        super().__init__()
        self.top_k, self.num_experts = top_k, experts
        self.weight = torch.nn.Parameter(torch.zeros(experts, hidden))
        self.bias = torch.nn.Parameter(torch.zeros(experts))

    def forward(self, hidden_states):
        logits = F.linear(hidden_states, self.weight, self.bias)
        top_value, top_index = torch.topk(logits, self.top_k, dim=-1)
        return logits, torch.softmax(top_value, dim=1, dtype=top_value.dtype), top_index


class MLP(torch.nn.Module):
    """A dense SwiGLU MLP (the shared experts)."""

    def __init__(self, hidden, intermediate):
        super().__init__()
        self.gate_proj = torch.nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = torch.nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = torch.nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen3MoeSparseMoeBlock(torch.nn.Module):
    """Qwen3-MoE / OLMoE (OlmoeSparseMoeBlock) / Mixtral (MixtralSparseMoeBlock): router + experts."""

    def __init__(self, hidden=32, intermediate=16, experts=8, top_k=3, norm_topk_prob=True):
        super().__init__()
        self.gate = TopKRouter(hidden, experts, top_k, norm_topk_prob)
        self.experts = FusedExperts(hidden, intermediate, experts)

    def forward(self, hidden_states):
        b, s, h = hidden_states.shape
        x = hidden_states.view(-1, h)
        _, weights, idx = self.gate(x)
        return self.experts(x, idx, weights).reshape(b, s, h)


class MixtralSparseMoeBlock(Qwen3MoeSparseMoeBlock):
    pass


class OlmoeSparseMoeBlock(Qwen3MoeSparseMoeBlock):
    pass


class Qwen2MoeSparseMoeBlock(Qwen3MoeSparseMoeBlock):
    """Qwen2-MoE / Qwen3-Next: the shared expert scaled by sigmoid(shared_expert_gate(x)), added last."""

    def __init__(self, hidden=32, intermediate=16, experts=8, top_k=3):
        super().__init__(hidden, intermediate, experts, top_k, norm_topk_prob=False)
        self.shared_expert = MLP(hidden, 24)
        self.shared_expert_gate = torch.nn.Linear(hidden, 1, bias=False)

    def forward(self, hidden_states):
        b, s, h = hidden_states.shape
        x = hidden_states.view(-1, h)
        shared = self.shared_expert(x)
        shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
        _, weights, idx = self.gate(x)
        out = self.experts(x, idx, weights)
        out += shared
        return out.reshape(b, s, h)


class Qwen3NextSparseMoeBlock(Qwen2MoeSparseMoeBlock):
    pass


class DeepseekV3TopkRouter(torch.nn.Module):
    def __init__(self, hidden, experts):
        super().__init__()
        self.hidden = hidden
        self.weight = torch.nn.Parameter(torch.zeros(experts, hidden))
        self.register_buffer("e_score_correction_bias", torch.zeros(experts))

    def forward(self, hidden_states):
        hidden_states = hidden_states.view(-1, self.hidden)
        return F.linear(hidden_states.float(), self.weight.float())


class DeepseekV3MoE(torch.nn.Module):
    """DeepSeek-V3 / GLM-4.5 (Glm4MoeMoE): sigmoid scores, correction bias for the choice, group-limited
    top-k (the two best per group), renormalised, times routed_scaling_factor; shared_experts on the
    block's input added after the experts."""

    def __init__(self, hidden=32, intermediate=16, experts=16, top_k=4, n_group=4, topk_group=2, scaling=2.5):
        super().__init__()
        self.experts = FusedExperts(hidden, intermediate, experts)
        self.gate = DeepseekV3TopkRouter(hidden, experts)
        self.shared_experts = MLP(hidden, 16)
        self.n_routed_experts, self.n_group, self.topk_group = experts, n_group, topk_group
        self.norm_topk_prob, self.routed_scaling_factor, self.top_k = True, scaling, top_k

    def route_tokens_to_experts(self, router_logits):
        scores = router_logits.sigmoid()
        choice = scores + self.gate.e_score_correction_bias
        per_group = self.n_routed_experts // self.n_group
        group_scores = choice.view(-1, self.n_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(-1, self.n_group, per_group).reshape(-1, self.n_routed_experts)
        idx = torch.topk(choice.masked_fill(~score_mask.bool(), 0.0), k=self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, idx)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return idx, weights * self.routed_scaling_factor

    def forward(self, hidden_states):
        residuals, shape = hidden_states, hidden_states.shape
        idx, weights = self.route_tokens_to_experts(self.gate(hidden_states))
        hidden_states = self.experts(hidden_states.view(-1, shape[-1]), idx, weights).view(*shape)
        return hidden_states + self.shared_experts(residuals)


class Glm4MoeMoE(DeepseekV3MoE):
    pass


class DeepseekV2Moe(torch.nn.Module):
    """DeepSeek-V2: softmax scores, group-limited greedy (the best per group), times the scaling factor."""

    def __init__(self, hidden=32, intermediate=16, experts=16, top_k=4, n_group=4, topk_group=2, scaling=1.5):
        super().__init__()
        self.experts = FusedExperts(hidden, intermediate, experts)
        self.gate = torch.nn.Linear(hidden, experts, bias=False)
        self.shared_experts = MLP(hidden, 16)
        self.num_experts, self.num_group, self.topk_group = experts, n_group, topk_group
        self.top_k, self.routed_scaling_factor = top_k, scaling

    def route_tokens_to_experts(self, router_logits):
        b, s, e = router_logits.shape  # [batch, seq, experts], as the block passes them
        scores = router_logits.view(-1, e).softmax(dim=-1, dtype=torch.float32)
        group_scores = scores.view(b * s, self.num_group, -1).max(dim=-1).values
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(b * s, self.num_group, self.num_experts // self.num_group)
        tmp = scores.masked_fill(~score_mask.reshape(b * s, -1).bool(), 0.0)
        weights, idx = torch.topk(tmp, k=self.top_k, dim=-1, sorted=False)
        return idx, weights * self.routed_scaling_factor

    def forward(self, hidden_states):
        residuals, shape = hidden_states, hidden_states.shape
        idx, weights = self.route_tokens_to_experts(F.linear(hidden_states.float(), self.gate.weight.float()))
        out = self.experts(hidden_states.view(-1, shape[-1]), idx, weights).view(*shape)
        return out + self.shared_experts(residuals)


class GptOssMLP(torch.nn.Module):
    """GPT-OSS's block: returns (output, router_scores)."""

    def __init__(self, hidden=32, intermediate=16, experts=8, top_k=2):
        super().__init__()
        self.router = GptOssTopKRouter(hidden, experts, top_k)
        self.experts = GptOssExperts(hidden, intermediate, experts)

    def forward(self, hidden_states):
        b, s, h = hidden_states.shape
        x = hidden_states.reshape(-1, h)
        _, scores, idx = self.router(x)
        return self.experts(x, idx, scores).reshape(b, s, h), scores


class Llama4TextExperts(torch.nn.Module):
    def __init__(self, hidden, intermediate, experts):
        super().__init__()
        self.num_experts = experts
        self.gate_up_proj = torch.nn.Parameter(torch.zeros(experts, hidden, 2 * intermediate))
        self.down_proj = torch.nn.Parameter(torch.zeros(experts, intermediate, hidden))

    def forward(self, hidden_states):
        h = hidden_states.view(self.num_experts, -1, self.gate_up_proj.shape[1])
        gate, up = torch.bmm(h, self.gate_up_proj).chunk(2, dim=-1)
        return torch.bmm(up * F.silu(gate), self.down_proj).view(-1, self.gate_up_proj.shape[1])


class Llama4TextMoe(torch.nn.Module):
    """Llama 4: the router's scores weight the experts' *input*."""

    def __init__(self, hidden=32, intermediate=16, experts=4, top_k=1):
        super().__init__()
        self.top_k, self.num_experts = top_k, experts
        self.experts = Llama4TextExperts(hidden, intermediate, experts)
        self.router = torch.nn.Linear(hidden, experts, bias=False)
        self.shared_expert = MLP(hidden, 16)

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        logits = self.router(x)
        top, idx = torch.topk(logits, self.top_k, dim=1)
        scores = torch.full_like(logits, float("-inf")).scatter_(1, idx, top).transpose(0, 1).sigmoid()
        routed_in = x.repeat(self.num_experts, 1) * scores.reshape(-1, 1)
        out = self.shared_expert(x)
        out.add_(self.experts(routed_in).reshape(self.num_experts, -1, x.shape[-1]).sum(dim=0))
        return out.reshape(hidden_states.shape), logits


class PerExpertMoe(torch.nn.Module):
    """A transformers 4.x block: one MLP module per expert."""

    def __init__(self, hidden=32, experts=4):
        super().__init__()
        self.gate = torch.nn.Linear(hidden, experts, bias=False)
        self.experts = torch.nn.ModuleList(MLP(hidden, 8) for _ in range(experts))

    def forward(self, hidden_states):
        return hidden_states


PerExpertMoe.__name__ = "Qwen3MoeSparseMoeBlock"


FAMILIES = {
    "qwen3_moe": lambda: Qwen3MoeSparseMoeBlock(),
    "mixtral": lambda: MixtralSparseMoeBlock(norm_topk_prob=True),
    "olmoe": lambda: OlmoeSparseMoeBlock(norm_topk_prob=False),
    "qwen2_moe": lambda: Qwen2MoeSparseMoeBlock(),
    "qwen3_next": lambda: Qwen3NextSparseMoeBlock(),
    "deepseek_v3": lambda: DeepseekV3MoE(),
    "glm4_moe": lambda: Glm4MoeMoE(),
    "deepseek_v2": lambda: DeepseekV2Moe(),
    "gpt_oss": lambda: GptOssMLP(),
}


class RMSNorm(torch.nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden))

    def forward(self, h):
        x = h.float()
        return (self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)).to(h.dtype)


class DecoderLayer(torch.nn.Module):
    def __init__(self, hidden, block, attr="mlp"):
        super().__init__()
        self.post_attention_layernorm = RMSNorm(hidden)
        self.attr = attr
        setattr(self, attr, block)

    def forward(self, h):
        out = getattr(self, self.attr)(self.post_attention_layernorm(h))
        if isinstance(out, tuple):
            out = out[0]
        return h + out


class DecoderModel(torch.nn.Module):
    def __init__(self, hidden, blocks, attr="mlp"):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(50, hidden)
        self.layers = torch.nn.ModuleList(DecoderLayer(hidden, b, attr) for b in blocks)

    def forward(self, ids):
        h = self.embed_tokens(ids)
        for layer in self.layers:
            h = layer(h)
        return h


class ForCausalLM(torch.nn.Module):
    """model.layers.{i}.<attr>: the causal-LM layout."""

    def __init__(self, hidden, blocks, attr="mlp", seed=0):
        super().__init__()
        self.model = DecoderModel(hidden, blocks, attr)
        _init(self, seed)
        self.bfloat16()

    def forward(self, ids):
        return self.model(ids)


class ForConditionalGeneration(torch.nn.Module):
    """A vision-language wrapper: model.language_model.layers.{i}.mlp (transformers 5.x)."""

    def __init__(self, hidden, blocks, seed=0):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.visual = torch.nn.Linear(hidden, hidden)
        self.model.language_model = DecoderModel(hidden, blocks)
        _init(self, seed)
        self.bfloat16()

    def forward(self, ids):
        return self.model.language_model(ids)


def tiny_model(family, layers=2, dense_first=True, hidden=32, seed=0):
    """A causal LM with a dense first layer (as DeepSeek's first_k_dense_replace) and MoE layers after."""
    blocks = [MLP(hidden, 24)] if dense_first else []
    blocks += [FAMILIES[family]() for _ in range(layers)]
    return ForCausalLM(hidden, blocks, seed=seed)
