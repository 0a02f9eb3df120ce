"""A byte-level GPT trained on the Python standard library's source code.

The model is nanoGPT's (Karpathy) in miniature: token + position embeddings, ``n_layer`` pre-LayerNorm
blocks of causal self-attention and an MLP, a final LayerNorm, and an output layer that shares its
weights with the token embedding (weight tying, Press & Wolf 2017). The vocabulary is the 256
byte values, so there is no tokenizer to ship or version.

The tied output layer is computed as ``F.linear(x, wte.weight)`` rather than by a second
``nn.Linear`` that aliases the embedding, so ``state_dict()`` holds every tensor exactly once:
checkpoints (safetensors refuses aliased tensors) and pseudo-gradients computed over the state
dict need no special case.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from geoloco.algorithms.params import derive_seed
from geoloco.scenarios.workloads._seeding import seeded_cpu_rng
from geoloco.scenarios.workloads.corpus import (
    CorpusSplit,
    held_out_corpus,
    resolve_root,
    split_corpus,
)

VOCAB_SIZE = 256
"""One token per byte value."""

TensorPair = tuple[torch.Tensor, torch.Tensor]
"""A batch: ``(inputs, targets)``."""


@dataclass(kw_only=True, slots=True)
class GPTConfig:
    """Shape of the GPT model."""

    vocab_size: int = VOCAB_SIZE
    """Number of distinct tokens; 256 for byte-level text."""
    n_layer: int = 4
    """Number of transformer blocks."""
    n_head: int = 4
    """Attention heads per block; must divide ``n_embd``."""
    n_embd: int = 96
    """Width of the residual stream (embedding dimension)."""
    block_size: int = 128
    """Longest sequence the model accepts (size of the learned position embedding)."""
    dropout: float = 0.0
    """Dropout probability on residual branches and attention weights (0 disables it)."""
    bias: bool = True
    """Whether Linear and LayerNorm layers carry a bias."""

    def __post_init__(self) -> None:
        for field in ("vocab_size", "n_layer", "n_head", "n_embd", "block_size"):
            if getattr(self, field) < 1:
                raise ValueError(f"GPTConfig.{field} must be >= 1, got {getattr(self, field)}")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"GPTConfig.n_embd={self.n_embd} must be divisible by n_head={self.n_head}; "
                f"choose n_head among {[h for h in range(1, self.n_embd + 1) if self.n_embd % h == 0]}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")


GPT_PRESETS: dict[str, GPTConfig] = {
    # Fast enough for unit tests and many-site CPU simulations.
    "tiny": GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=64),
    # The default: ~0.48M parameters, a train step of 16x128 bytes in tens of ms on two CPU cores.
    "small": GPTConfig(n_layer=4, n_head=4, n_embd=96, block_size=128),
    # nanoGPT's shakespeare-char shape (~10.8M parameters): meant for a GPU.
    "base": GPTConfig(n_layer=6, n_head=6, n_embd=384, block_size=256),
}
"""Named model sizes; a workload's ``size`` option picks one."""


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        # One projection for query, key and value: a single matmul instead of three.
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, channels = x.shape
        q, k, v = self.c_attn(x).split(channels, dim=2)
        # (B, T, C) -> (B, heads, T, head_dim)
        q, k, v = (t.view(batch, time, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(batch, time, channels)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LN residual block: normalising before each branch keeps deep stacks trainable."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only transformer over bytes; ``forward`` returns next-token logits."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        # GPT-2 initialisation: N(0, 0.02) everywhere, and the projections that write into the
        # residual stream scaled by 1/sqrt(2 * n_layer) so its variance does not grow with depth.
        self.apply(self._init_weights)
        for name, parameter in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(parameter, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits ``(batch, time, vocab_size)`` for integer tokens ``idx`` of ``(batch, time)``."""
        _, time = idx.shape
        if time > self.config.block_size:
            raise ValueError(
                f"sequence length {time} exceeds the model's block_size {self.config.block_size}; "
                f"shorten the input or build the model with a larger block_size"
            )
        positions = torch.arange(time, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(positions))
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln_f(x), self.wte.weight)  # tied output layer


AUTOCAST_DTYPES: dict[str, torch.dtype | None] = {
    "none": None,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
"""Values of ``GPTWorkloadConfig.autocast_dtype``."""


@dataclass(kw_only=True, slots=True)
class GPTWorkloadConfig:
    """Model size, batch shape and data split of the GPT workload (one field per TOML option)."""

    size: str = "small"
    """Model preset: one of ``GPT_PRESETS`` ("tiny", "small", "base")."""
    n_layer: int | None = None
    """Overrides the preset's number of transformer blocks."""
    n_head: int | None = None
    """Overrides the preset's attention heads per block."""
    n_embd: int | None = None
    """Overrides the preset's embedding width."""
    block_size: int | None = None
    """Overrides the preset's longest accepted sequence (position embedding size)."""
    dropout: float = 0.0
    """Dropout probability; 0 keeps training deterministic for a seed."""
    seq_len: int | None = None
    """Bytes per training window (the model sees ``seq_len`` inputs and predicts the next byte of
    each); defaults to the model's ``block_size`` and may not exceed it."""
    batch_size: int = 16
    """Windows per training batch (and per evaluation batch)."""
    eval_batches: int = 8
    """Evaluation batches; ``eval_batches * batch_size`` fixed windows of held-out text are scored."""
    eval_fraction: float = 0.05
    """Share of the corpus bytes held out for evaluation (whole modules, never given to a site)."""
    split_seed: int = 0
    """Seed of the module-to-site assignment. Kept separate from the run seed passed to
    ``site_batches`` so that all sites of a run agree on the split whatever seeds callers use."""
    data_root: str = ""
    """Folder whose ``*.py`` files form the corpus; empty means the running interpreter's standard
    library. The fallback for distributions that ship no stdlib sources."""
    autocast_dtype: str = "none"
    """Mixed precision for forward passes in ``loss`` and ``eval_loss``: "none", "bfloat16" or
    "float16" (autocast on the model's device type). Callers that manage precision themselves
    leave it at "none"; "bfloat16" is the sensible choice on recent GPUs."""

    def __post_init__(self) -> None:
        if self.size not in GPT_PRESETS:
            raise ValueError(f"unknown GPT size {self.size!r}; valid sizes: {sorted(GPT_PRESETS)}")
        model = self.model_config()  # validates the resulting shape
        if self.seq_len is not None and not 1 <= self.seq_len <= model.block_size:
            raise ValueError(
                f"seq_len={self.seq_len} must be between 1 and the model's block_size "
                f"{model.block_size}; lower seq_len or raise block_size"
            )
        for field in ("batch_size", "eval_batches"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be >= 1, got {getattr(self, field)}")
        if not 0.0 < self.eval_fraction < 0.5:
            raise ValueError(f"eval_fraction must be in (0, 0.5), got {self.eval_fraction}")
        if self.autocast_dtype not in AUTOCAST_DTYPES:
            raise ValueError(
                f"unknown autocast_dtype {self.autocast_dtype!r}; valid: {sorted(AUTOCAST_DTYPES)}"
            )

    def model_config(self) -> GPTConfig:
        """The preset named by ``size`` with any explicit overrides applied."""
        preset = GPT_PRESETS[self.size]
        return GPTConfig(
            n_layer=self.n_layer if self.n_layer is not None else preset.n_layer,
            n_head=self.n_head if self.n_head is not None else preset.n_head,
            n_embd=self.n_embd if self.n_embd is not None else preset.n_embd,
            block_size=self.block_size if self.block_size is not None else preset.block_size,
            dropout=self.dropout,
            bias=preset.bias,
        )

    @property
    def window(self) -> int:
        """Training window length in bytes: ``seq_len`` or the model's ``block_size``."""
        return self.seq_len if self.seq_len is not None else self.model_config().block_size


class GPTWorkload:
    """Byte-level GPT on the Python standard library, split across sites by top-level module.

    Batches are ``(inputs, targets)`` int64 tensors of shape ``(batch_size, seq_len)`` on the CPU,
    ``targets`` being ``inputs`` shifted by one byte; ``loss`` moves them to the model's device.
    The corpus rules (what is excluded, how modules are dealt to sites, which are held out) are in
    ``geoloco.scenarios.workloads.corpus``.
    """

    name: str = "gpt"
    config_class: ClassVar[type[GPTWorkloadConfig]] = GPTWorkloadConfig

    def __init__(self, config: GPTWorkloadConfig | None = None) -> None:
        self.config = config if config is not None else GPTWorkloadConfig()
        self.model_config = self.config.model_config()
        self.seq_len = self.config.window
        self._root = resolve_root(self.config.data_root)
        self._eval_windows: torch.Tensor | None = None

    def split(self, num_sites: int) -> CorpusSplit:
        """Which modules (and bytes) each of ``num_sites`` sites trains on, and the held-out set."""
        return split_corpus(self._root, num_sites, self.config.eval_fraction, self.config.split_seed)

    def build_model(self, seed: int) -> GPT:
        with seeded_cpu_rng(derive_seed("gpt-init", seed)):
            return GPT(self.model_config)

    def site_batches(self, site: int, num_sites: int, seed: int) -> Iterator[TensorPair]:
        if not 0 <= site < num_sites:
            raise ValueError(f"site must be in [0, {num_sites}), got {site}")
        data = self.split(num_sites).site_data[site]
        window = self.seq_len + 1
        if data.numel() < window:
            raise ValueError(
                f"site {site} of {num_sites} has only {data.numel()} bytes, fewer than one window "
                f"of {window}; use fewer sites, a shorter seq_len or a larger corpus"
            )
        return self._sample_windows(data, derive_seed("gpt-batches", seed, site))

    def _sample_windows(self, data: torch.Tensor, seed: int) -> Iterator[TensorPair]:
        generator = torch.Generator().manual_seed(seed)
        window = self.seq_len + 1
        span = torch.arange(window)
        high = data.numel() - window + 1
        while True:
            starts = torch.randint(0, high, (self.config.batch_size,), generator=generator)
            tokens = data[starts[:, None] + span].long()
            yield tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def _autocast(self, device: torch.device) -> contextlib.AbstractContextManager[object]:
        dtype = AUTOCAST_DTYPES[self.config.autocast_dtype]
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=dtype)

    def loss(self, model: nn.Module, batch: TensorPair) -> torch.Tensor:
        device = next(model.parameters()).device
        inputs, targets = (t.to(device, non_blocking=True) for t in batch)
        with self._autocast(device):
            logits = model(inputs)
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))

    def eval_windows(self) -> torch.Tensor:
        """The fixed evaluation windows, ``(eval_batches * batch_size, seq_len + 1)`` int64.

        Evenly spaced over the held-out text, which depends on neither the site count nor any
        seed, so every run with the same workload options is scored on the same bytes.
        """
        if self._eval_windows is None:
            _, data = held_out_corpus(self._root, self.config.eval_fraction)
            window = self.seq_len + 1
            count = self.config.eval_batches * self.config.batch_size
            if data.numel() < window:
                raise ValueError(
                    f"held-out text has {data.numel()} bytes, fewer than one window of {window}; "
                    f"raise eval_fraction or use a larger corpus"
                )
            starts = torch.linspace(0, data.numel() - window, count, dtype=torch.float64).round().long()
            self._eval_windows = data[starts[:, None] + torch.arange(window)].long()
        return self._eval_windows

    def eval_loss(self, model: nn.Module) -> float:
        windows = self.eval_windows()
        was_training = model.training
        model.eval()
        total = 0.0
        try:
            with torch.no_grad():
                for chunk in windows.split(self.config.batch_size):
                    total += float(self.loss(model, (chunk[:, :-1], chunk[:, 1:])))
        finally:
            model.train(was_training)
        return total / self.config.eval_batches
