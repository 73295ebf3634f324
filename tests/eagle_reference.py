"""An EAGLE-3 head in torch, written from the speculators format's description: the independent
reference the tests check tinydraft_mlx/engine/eagle.py against, and the module the fixture
trains and saves (tests/fixtures.py `write_eagle3`). Used by tests only."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class Eagle3Reference(torch.nn.Module):
    """fc([h_low, h_mid, h_high]) -> one layer whose attention reads [norm(embed), norm(g)],
    residual g -> norm -> lm_head over `kept` target ids (scattered into the target's width,
    -inf elsewhere). Plain torch: explicit RoPE (rotate-half), causal GQA attention, SwiGLU."""

    def __init__(self, config: dict, embed: torch.Tensor, kept: list[int]) -> None:
        super().__init__()
        c = config["transformer_layer_config"]
        self.size, self.heads, self.kv = c["hidden_size"], c["num_attention_heads"], \
            c["num_key_value_heads"]
        self.head_dim = c.get("head_dim") or self.size // self.heads
        self.theta, self.eps, self.width = c["rope_theta"], c["rms_norm_eps"], c["vocab_size"]
        d, t = self.size, config.get("target_hidden_size") or self.size
        self.fc = torch.nn.Linear(3 * t, d, bias=False)
        self.w_in = torch.nn.Parameter(torch.ones(d))
        self.w_hidden = torch.nn.Parameter(torch.ones(d))
        self.w_post = torch.nn.Parameter(torch.ones(d))
        self.w_norm = torch.nn.Parameter(torch.ones(d))
        self.q = torch.nn.Linear(2 * d, self.heads * self.head_dim, bias=False)
        self.k = torch.nn.Linear(2 * d, self.kv * self.head_dim, bias=False)
        self.v = torch.nn.Linear(2 * d, self.kv * self.head_dim, bias=False)
        self.o = torch.nn.Linear(self.heads * self.head_dim, d, bias=False)
        ffn = c["intermediate_size"]
        self.gate = torch.nn.Linear(d, ffn, bias=False)
        self.up = torch.nn.Linear(d, ffn, bias=False)
        self.down = torch.nn.Linear(ffn, d, bias=False)
        self.lm_head = torch.nn.Linear(d, len(kept), bias=False)
        self.register_buffer("embed", embed.detach().clone())
        self.register_buffer("kept", torch.tensor(kept, dtype=torch.long))

    def rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * w

    def rope(self, x: torch.Tensor) -> torch.Tensor:
        """Rotate-half RoPE at positions 0..L-1 over (B, heads, L, head_dim)."""
        half = self.head_dim // 2
        freq = self.theta ** (-torch.arange(0, half, dtype=torch.float64) * 2 / self.head_dim)
        angle = torch.arange(x.shape[2], dtype=torch.float64)[:, None] * freq[None]
        cos, sin = angle.cos().float(), angle.sin().float()
        a, b = x[..., :half], x[..., half:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)

    def forward(self, tokens: torch.Tensor, states: torch.Tensor):
        """(B, L) next tokens, (B, L, 3 D) target states -> ((B, L, V) logits, (B, L, D) the
        layer's output, (B, kv, L, head_dim) its keys after RoPE)."""
        (full, h), (k, _) = self.steps(tokens, states, 1)[0]
        return full, h, k

    def steps(self, tokens: torch.Tensor, states: torch.Tensor, count: int) -> list:
        """`count` draft steps over a teacher-forced sequence, as a chain runs them: step 1 at
        position i reads the fused target states at i; step s > 1 at position i reads step
        s - 1's output at i - 1 instead, and attends to step 1's keys up to i - s + 1 (entries
        made from target states) and to step r's key at i - s + r for r = 2..s (the chain's own
        entries). Every step at i predicts x_{i+2}. Returns [((logits, out), (keys, values))]
        per step; step s is meaningful from position s - 1 on."""
        e = self.rms(self.embed[tokens], self.w_in)
        b, n, _ = e.shape
        rep, out, cache = self.heads // self.kv, [], []
        g = self.fc(states)
        for s in range(1, count + 1):
            if s > 1:  # its own previous output, one position back
                g = torch.cat([torch.zeros_like(g[:, :1]), out[-1][0][1][:, :-1]], dim=1)
            x = torch.cat([e, self.rms(g, self.w_hidden)], dim=-1)
            q = self.rope(self.q(x).view(b, n, self.heads, -1).transpose(1, 2))
            k = self.rope(self.k(x).view(b, n, self.kv, -1).transpose(1, 2))
            v = self.v(x).view(b, n, self.kv, -1).transpose(1, 2)
            cache.append((k, v))
            i = torch.arange(n)[:, None]
            j = torch.arange(n)[None, :]
            keys = torch.cat([c[0] for c in cache], dim=2).repeat_interleave(rep, 1)
            values = torch.cat([c[1] for c in cache], dim=2).repeat_interleave(rep, 1)
            allowed = [j <= i - s + 1] + [j == i - s + r for r in range(2, s + 1)]
            mask = torch.cat(allowed, dim=1)
            scores = q @ keys.transpose(-1, -2) / self.head_dim ** 0.5
            scores = scores.masked_fill(~mask, float("-inf"))  # its own key is always there
            attn = scores.softmax(-1) @ values
            h = g + self.o(attn.transpose(1, 2).reshape(b, n, -1))
            m = self.rms(h, self.w_post)
            h = h + self.down(F.silu(self.gate(m)) * self.up(m))
            small = self.lm_head(self.rms(h, self.w_norm))
            full = small.new_full((b, n, self.width), float("-inf"))
            full[..., self.kept] = small
            out.append(((full, h), (k, v)))
        return out

    def weights(self) -> dict[str, torch.nn.Parameter]:
        """Its parameters (live) under the speculators format's names."""
        layer = "layers.0."
        out = {"fc.weight": self.fc.weight, "norm.weight": self.w_norm,
               "lm_head.weight": self.lm_head.weight,
               layer + "input_layernorm.weight": self.w_in,
               layer + "hidden_norm.weight": self.w_hidden,
               layer + "post_attention_layernorm.weight": self.w_post}
        for name, lin in (("q_proj", self.q), ("k_proj", self.k), ("v_proj", self.v),
                          ("o_proj", self.o)):
            out[f"{layer}self_attn.{name}.weight"] = lin.weight
        for name, lin in (("gate_proj", self.gate), ("up_proj", self.up),
                          ("down_proj", self.down)):
            out[f"{layer}mlp.{name}.weight"] = lin.weight
        return out

    def tensors(self) -> dict[str, torch.Tensor]:
        """Its tensors under the speculators format's names, with the vocabulary maps."""
        out = {k: v.detach().float().contiguous() for k, v in self.weights().items()}
        out["d2t"] = (self.kept - torch.arange(len(self.kept))).long()
        t2d = torch.zeros(self.width, dtype=torch.bool)
        t2d[self.kept] = True
        out["t2d"] = t2d
        return out
