"""A tiny causal language model for the moefq compare tests, written around the transformers 5.x MoE
block look-alikes of hf_lookalikes.py (transformers is not needed): token embedding, per decoder layer a
causal token mixer (each position sees a decayed running mean of the earlier ones, so context matters)
and an MoE block on the normed residual stream, a final RMSNorm and an lm_head returning logits
[1, T, V]. `fragile` names a layer whose MoE output is scaled up until it dominates the residual
stream: its quantization error reaches the logits undamped, so that layer ranks first."""

import torch

import hf_lookalikes as hl


class CausalMixer(torch.nn.Module):
    """y[t] = W (sum_{s <= t} 0.5^(t - s) x[s]) / (sum of the weights): causal, no attention masks."""

    def __init__(self, hidden):
        super().__init__()
        self.proj = torch.nn.Linear(hidden, hidden, bias=False)

    def forward(self, h):
        T = h.shape[1]
        t = torch.arange(T, dtype=torch.float32)
        w = torch.tril(0.5 ** (t[:, None] - t[None, :]).clamp(min=0))
        w = w * (t[:, None] >= t[None, :])
        w = w / w.sum(dim=1, keepdim=True)
        return self.proj(torch.einsum("ts,bsh->bth", w, h.float()).to(h.dtype))


class Layer(torch.nn.Module):
    def __init__(self, hidden, block):
        super().__init__()
        self.input_layernorm = hl.RMSNorm(hidden)
        self.mixer = CausalMixer(hidden)
        self.post_attention_layernorm = hl.RMSNorm(hidden)
        self.mlp = block

    def forward(self, h):
        h = h + self.mixer(self.input_layernorm(h))
        out = self.mlp(self.post_attention_layernorm(h))
        if isinstance(out, tuple):
            out = out[0]
        return h + out


class Decoder(torch.nn.Module):
    def __init__(self, vocab, hidden, blocks):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(vocab, hidden)
        self.layers = torch.nn.ModuleList(Layer(hidden, b) for b in blocks)
        self.norm = hl.RMSNorm(hidden)

    def forward(self, ids):
        h = self.embed_tokens(ids)
        for layer in self.layers:
            h = layer(h)
        return self.norm(h)


class Output:
    def __init__(self, logits):
        self.logits = logits


class TinyCausalLM(torch.nn.Module):
    def __init__(self, family="qwen3_moe", layers=3, vocab=64, hidden=32, seed=0, fragile=None, dense_first=False,
                 gain=0.25, fragile_gain=40.0):
        super().__init__()
        blocks = [hl.MLP(hidden, 24)] if dense_first else []
        blocks += [hl.FAMILIES[family]() for _ in range(layers)]
        self.model = Decoder(vocab, hidden, blocks)
        self.lm_head = torch.nn.Linear(hidden, vocab, bias=False)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name.startswith("lm_head"):
                    p.copy_(torch.randn(p.shape, generator=g) * 0.5)
                elif name.startswith("model.embed_tokens"):
                    p.copy_(torch.randn(p.shape, generator=g))
                else:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.2)
            for i, layer in enumerate(self.model.layers):
                experts = getattr(layer.mlp, "experts", None)
                if experts is not None:
                    experts.down_proj.mul_(fragile_gain if i == fragile else gain)
        self.bfloat16()

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, ids):
        return Output(self.lm_head(self.model(ids)).float())
