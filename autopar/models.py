"""The model zoo: small models the project plans, runs and tests.

Shapes: B batch, S sequence, H hidden, V vocab, F feed-forward width.

- ``MLP``: a stack of Linear + GELU blocks with a regression head.
- ``GPT``: a GPT-style decoder (token + position embedding, pre-norm blocks with
  causal self-attention and a GELU MLP, an LM head, tied to the token embedding with
  ``GPTConfig(tied=True)``: example ``gpt-tied``).
- ``hf_gpt2`` / ``hf_llama``: Hugging Face models built from small configs with random
  weights (nothing is downloaded).

``EXAMPLES`` maps the names the CLI accepts to factories returning
``(model, example_inputs, loss_fn, example_targets)``.

At scale, for planning only (built on the meta device, no weights): ``llama3_8b`` (Llama-3-8B:
32 layers, hidden 4096, ffn 14336, 32 heads, 8 kv heads, vocab 128256) and ``gpt3`` (a
GPT-3-175B-like decoder: 96 layers, hidden 12288, 96 heads, ffn 49152); both at sequence
2048, batch 8 (examples ``llama3-8b`` and ``gpt3``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "MLP",
    "GPT",
    "GPTConfig",
    "EXAMPLES",
    "cross_entropy_loss",
    "mse_loss",
    "hf_gpt2",
    "hf_llama",
    "lm_batch",
    "llama3_8b",
    "gpt3",
]


class MLP(nn.Module):
    def __init__(self, d_in: int = 16, d_hidden: int = 64, d_out: int = 8, n_layers: int = 2):
        super().__init__()
        dims = [d_in] + [d_hidden] * n_layers
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))
        self.head = nn.Linear(d_hidden, d_out)

    def forward(self, x_BD: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x_BD = F.gelu(layer(x_BD))
        return self.head(x_BD)


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 128
    seq: int = 32
    hidden: int = 64
    heads: int = 4
    layers: int = 2
    ffn: int = 256
    tied: bool = False
    """The LM head shares the token embedding's weight."""


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.heads = cfg.heads
        self.q = nn.Linear(cfg.hidden, cfg.hidden)
        self.k = nn.Linear(cfg.hidden, cfg.hidden)
        self.v = nn.Linear(cfg.hidden, cfg.hidden)
        self.o = nn.Linear(cfg.hidden, cfg.hidden)

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        B, S, H = x_BSH.shape
        D = H // self.heads

        def split(t):
            return t.view(B, S, self.heads, D).transpose(1, 2)

        q, k, v = split(self.q(x_BSH)), split(self.k(x_BSH)), split(self.v(x_BSH))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(D)
        mask = torch.ones(S, S, dtype=torch.bool, device=x_BSH.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
        y = scores.softmax(dim=-1) @ v
        return self.o(y.transpose(1, 2).reshape(B, S, H))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.hidden)
        self.fc1 = nn.Linear(cfg.hidden, cfg.ffn)
        self.fc2 = nn.Linear(cfg.ffn, cfg.hidden)

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        x_BSH = x_BSH + self.attn(self.ln1(x_BSH))
        return x_BSH + self.fc2(F.gelu(self.fc1(self.ln2(x_BSH))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig = GPTConfig()):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.hidden)
        self.pos = nn.Embedding(cfg.seq, cfg.hidden)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        if cfg.tied:
            self.head.weight = self.tok.weight

    def forward(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        S = tokens_BS.shape[1]
        pos_S = torch.arange(S, device=tokens_BS.device)
        x_BSH = self.tok(tokens_BS) + self.pos(pos_S)
        for block in self.blocks:
            x_BSH = block(x_BSH)
        return self.head(self.ln_f(x_BSH))


def cross_entropy_loss(logits_BSV: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over every position of the batch."""
    return F.cross_entropy(logits_BSV.flatten(0, 1), targets_BS.flatten())


def hf_logits_loss(out, targets_BS: torch.Tensor) -> torch.Tensor:
    """Cross entropy on a Hugging Face model's output (its ``logits`` field)."""
    logits = out.logits if hasattr(out, "logits") else out[0]
    return cross_entropy_loss(logits, targets_BS)


def mse_loss(y: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(y, target)


def lm_batch(vocab: int, batch: int, seq: int, *, seed: int = 0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, seq), generator=g)
    targets = torch.randint(0, vocab, (batch, seq), generator=g)
    return tokens.to(device), targets.to(device)


def hf_gpt2(layers: int = 2, hidden: int = 64, heads: int = 4, vocab: int = 128, seq: int = 32):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=vocab,
        n_positions=seq,
        n_embd=hidden,
        n_layer=layers,
        n_head=heads,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
    )
    return GPT2LMHeadModel(cfg)


def hf_llama(
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    ffn: int = 128,
    vocab: int = 128,
    seq: int = 32,
):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=seq,
        use_cache=False,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg)


def _mlp_example(batch: int = 8):
    model = MLP()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 16, generator=g)
    y = torch.randn(batch, 8, generator=g)
    return model, (x,), mse_loss, (y,)


def _gpt_example(batch: int = 8):
    cfg = GPTConfig()
    tokens, targets = lm_batch(cfg.vocab, batch, cfg.seq)
    return GPT(cfg), (tokens,), cross_entropy_loss, (targets,)


def _gpt_tied_example(batch: int = 8):
    cfg = GPTConfig(tied=True)
    tokens, targets = lm_batch(cfg.vocab, batch, cfg.seq)
    return GPT(cfg), (tokens,), cross_entropy_loss, (targets,)


def _hf_gpt2_example(batch: int = 8):
    tokens, targets = lm_batch(128, batch, 32)
    return hf_gpt2(), (tokens,), hf_logits_loss, (targets,)


def _hf_llama_example(batch: int = 8):
    tokens, targets = lm_batch(128, batch, 32)
    return hf_llama(), (tokens,), hf_logits_loss, (targets,)


def llama3_8b(layers: int = 32, seq: int = 2048) -> nn.Module:
    """Llama-3-8B's shapes (Hugging Face Llama) on the meta device."""
    with torch.device("meta"):
        return hf_llama(
            layers=layers, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256, seq=seq
        )


def gpt3(layers: int = 96, seq: int = 2048) -> nn.Module:
    """A GPT-3-175B-like decoder (vocab padded to 50304) on the meta device."""
    cfg = GPTConfig(vocab=50304, seq=seq, hidden=12288, heads=96, layers=layers, ffn=49152)
    with torch.device("meta"):
        return GPT(cfg)


def _llama3_8b_example(batch: int = 8):
    tokens, targets = lm_batch(128256, batch, 2048, device="meta")
    return llama3_8b(), (tokens,), hf_logits_loss, (targets,)


def _gpt3_example(batch: int = 8):
    tokens, targets = lm_batch(50304, batch, 2048, device="meta")
    return gpt3(), (tokens,), cross_entropy_loss, (targets,)


EXAMPLES = {
    "mlp": _mlp_example,
    "gpt": _gpt_example,
    "gpt-tied": _gpt_tied_example,
    "hf-gpt2": _hf_gpt2_example,
    "hf-llama": _hf_llama_example,
    "llama3-8b": _llama3_8b_example,
    "gpt3": _gpt3_example,
}
