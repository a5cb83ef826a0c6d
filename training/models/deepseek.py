"""A small DeepSeek-style decoder: multi-head latent attention (MLA), DeepSeekMoE (shared +
routed experts, top-k routing), RMSNorm, RoPE. Byte-level vocabulary.

The runtime works with any nn.Module; this is the default workload. Shapes in comments:
B batch, T tokens, D model width, H heads, E routed experts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from training.errors import SpecError


@dataclass(frozen=True)
class ModelConfig:
    vocab: int = 256
    """Byte-level tokens."""
    dim: int = 128
    """Model width D."""
    layers: int = 4
    """Decoder blocks."""
    heads: int = 4
    """Attention heads H."""
    kv_rank: int = 32
    """MLA: width of the compressed KV latent (what a KV cache would hold)."""
    nope_dim: int = 32
    """MLA: per-head query/key width without position."""
    rope_dim: int = 16
    """MLA: per-head decoupled RoPE width (one shared rope key for all heads)."""
    v_dim: int = 32
    """MLA: per-head value width."""
    dense_layers: int = 1
    """First blocks use a dense MLP instead of MoE (as DeepSeek does)."""
    experts: int = 6
    """Routed experts E."""
    shared_experts: int = 1
    """Always-on experts."""
    top_k: int = 2
    """Routed experts per token."""
    expert_dim: int = 256
    """Hidden width of one expert."""
    max_seq: int = 512
    """Longest sequence (RoPE table)."""


PRESETS = {
    "deepseek-tiny": ModelConfig(),
    "deepseek-small": ModelConfig(
        dim=256,
        layers=6,
        heads=8,
        kv_rank=64,
        nope_dim=32,
        rope_dim=16,
        v_dim=32,
        experts=8,
        top_k=2,
        expert_dim=512,
    ),
    "deepseek-base": ModelConfig(
        dim=1024,
        layers=16,
        heads=16,
        kv_rank=256,
        nope_dim=64,
        rope_dim=32,
        v_dim=64,
        experts=32,
        top_k=4,
        expert_dim=1408,
        max_seq=4096,
    ),
}


def preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise SpecError(f"unknown model preset '{name}'; use one of {', '.join(PRESETS)}") from None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_table(dim: int, max_seq: int, base: float = 10000.0) -> torch.Tensor:
    inv = 1.0 / base ** (torch.arange(0, dim, 2).float() / dim)  # (dim/2,)
    ang = torch.outer(torch.arange(max_seq).float(), inv)  # (max_seq, dim/2)
    return torch.polar(torch.ones_like(ang), ang)  # complex (max_seq, dim/2)


def apply_rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """x (B, T, H, d) rotated by position; freqs (T, d/2)."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    out = torch.view_as_real(xc * freqs[None, :, None, :]).flatten(-2)
    return out.type_as(x)


class MLA(nn.Module):
    """Multi-head latent attention: K and V come from one low-rank latent c_kv (B, T, R);
    position lives in a separate RoPE part of q and a single shared RoPE key."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.c = c
        self.wq = nn.Linear(c.dim, c.heads * (c.nope_dim + c.rope_dim), bias=False)
        self.wkv_a = nn.Linear(c.dim, c.kv_rank + c.rope_dim, bias=False)
        self.kv_norm = RMSNorm(c.kv_rank)
        self.wkv_b = nn.Linear(c.kv_rank, c.heads * (c.nope_dim + c.v_dim), bias=False)
        self.wo = nn.Linear(c.heads * c.v_dim, c.dim, bias=False)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        c = self.c
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, c.heads, c.nope_dim + c.rope_dim)
        q_nope, q_rope = q.split([c.nope_dim, c.rope_dim], dim=-1)
        q_rope = apply_rope(q_rope, freqs)
        kv, k_rope = self.wkv_a(x).split([c.kv_rank, c.rope_dim], dim=-1)  # (B,T,R), (B,T,r)
        k_rope = apply_rope(k_rope.unsqueeze(2), freqs)  # (B, T, 1, r): shared by all heads
        kv = self.wkv_b(self.kv_norm(kv)).view(B, T, c.heads, c.nope_dim + c.v_dim)
        k_nope, v = kv.split([c.nope_dim, c.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, -1, c.heads, -1)], dim=-1)  # (B,T,H,dq)
        qh = torch.cat([q_nope, q_rope], dim=-1)
        out = F.scaled_dot_product_attention(
            qh.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )  # (B,H,T,dv)
        return self.wo(out.transpose(1, 2).reshape(B, T, c.heads * c.v_dim))


class Expert(nn.Module):
    """SwiGLU MLP."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    """DeepSeekMoE: shared experts see every token; each token also goes to its top-k
    routed experts, weighted by normalised router scores."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.top_k = c.top_k
        self.router = nn.Linear(c.dim, c.experts, bias=False)
        self.experts = nn.ModuleList(Expert(c.dim, c.expert_dim) for _ in range(c.experts))
        self.shared = Expert(c.dim, c.expert_dim * c.shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # (N, D), N = B * T
        scores = self.router(flat).softmax(dim=-1)  # (N, E)
        weight, idx = scores.topk(self.top_k, dim=-1)  # (N, k)
        weight = weight / weight.sum(dim=-1, keepdim=True)
        out = self.shared(flat)
        for e, expert in enumerate(self.experts):
            token, slot = (idx == e).nonzero(as_tuple=True)
            if token.numel():
                out = out.index_add(0, token, expert(flat[token]) * weight[token, slot, None])
        return out.view(shape)


class Block(nn.Module):
    def __init__(self, c: ModelConfig, layer: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(c.dim)
        self.attn = MLA(c)
        self.ffn_norm = RMSNorm(c.dim)
        self.ffn: nn.Module = Expert(c.dim, c.expert_dim) if layer < c.dense_layers else MoE(c)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), freqs)
        return x + self.ffn(self.ffn_norm(x))


class DeepSeekLM(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.c = c
        self.embed = nn.Embedding(c.vocab, c.dim)
        self.blocks: list[Block] = nn.ModuleList(Block(c, i) for i in range(c.layers))  # type: ignore[assignment]
        self.norm = RMSNorm(c.dim)
        self.head = nn.Linear(c.dim, c.vocab, bias=False)
        self.freqs: torch.Tensor
        self.register_buffer("freqs", rope_table(c.rope_dim, c.max_seq), persistent=False)
        for m in self.modules():
            if isinstance(m, nn.Linear | nn.Embedding):
                nn.init.normal_(m.weight, std=0.02)
        for b in self.blocks:  # scaled residual projections (GPT-2 style)
            nn.init.normal_(b.attn.wo.weight, std=0.02 / math.sqrt(2 * c.layers))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, T) int64 -> logits (B, T, vocab)."""
        T = tokens.shape[1]
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x, self.freqs[:T])
        return self.head(self.norm(x))

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        """Next-byte cross entropy on (B, T+1) windows."""
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def build_model(name: str) -> DeepSeekLM:
    return DeepSeekLM(preset(name))


def sync_bucket_count(name: str, bucket_mb: float) -> int:
    """How many sync buckets (training.sync.buckets.buckets) the preset's parameters make at
    `bucket_mb`: counted on the meta device, without memory for the weights."""
    from training.sync.buckets import buckets

    with torch.device("meta"):
        model = build_model(name)
    return len(buckets(list(model.parameters()), bucket_mb))
