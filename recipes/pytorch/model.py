"""A small GPT-style byte-level language model and the corpus it trains on.

Small enough to train on a CPU in seconds (defaults: 2 layers, d_model 64, 64-token context),
shaped like the real thing: token and position embeddings, pre-norm blocks of causal
self-attention (fused qkv, output proj) and an MLP, a final LayerNorm and a tied LM head.
"""

from __future__ import annotations

import dataclasses
import pathlib

import torch
from torch import nn
from torch.nn import functional as F

DATA_DIR = pathlib.Path(__file__).resolve().parent / "data"
CORPUS = DATA_DIR / "corpus.txt"


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256          # byte-level: every byte is a token
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 64
    seq_len: int = 64
    dropout: float = 0.0           # 0 keeps a resumed run bit-exact with an uninterrupted one

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_layer", "n_head", "d_model", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.n_head:
            raise ValueError(f"GPTConfig.d_model ({self.d_model}) must be divisible by n_head ({self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig | None = None) -> None:
        super().__init__()
        self.config = cfg = config or GPTConfig()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head.weight = self.tok.weight   # tied, as in GPT-2
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """idx: (batch, time) token ids, time <= seq_len. Returns logits (batch, time, vocab_size)."""
        t = idx.shape[1]
        if t > self.config.seq_len:
            raise ValueError(f"sequence of {t} tokens is longer than GPTConfig.seq_len={self.config.seq_len}")
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self(idx)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def load_corpus(path: str | pathlib.Path | None = None) -> torch.LongTensor:
    """The shipped corpus as byte-level token ids (values 0..255)."""
    p = pathlib.Path(path) if path is not None else CORPUS
    if not p.is_file():
        raise FileNotFoundError(f"corpus not found at {p}; rebuild it with `python {DATA_DIR / 'make_corpus.py'}`")
    data = p.read_bytes()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.long)


class CorpusWindows(torch.utils.data.Dataset):
    """Non-overlapping (input, target) windows of seq_len tokens over the corpus: a map-style
    dataset, so a ResumableSampler can index it and resume at the exact sample."""

    def __init__(self, tokens: torch.Tensor, seq_len: int) -> None:
        if tokens.numel() < seq_len + 1:
            raise ValueError(f"corpus of {tokens.numel()} tokens is shorter than seq_len+1={seq_len + 1}")
        self.tokens = tokens
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (self.tokens.numel() - 1) // self.seq_len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = i * self.seq_len
        chunk = self.tokens[s: s + self.seq_len + 1]
        return chunk[:-1], chunk[1:]
