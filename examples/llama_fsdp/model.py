"""What the coordinator and every site rank share: the model and the text.

Both sides must build the *same* model (same class, same parameter names and shapes, in the
same order): the coordinator starts the run from its flattened weights and a site's ranks
upload the rows of those same parameters. The sites' own initial values do not matter: every
rank takes its rows of the coordinator's weights when the site joins. Keep this file identical
on every machine.

The model is a Llama-style decoder from Hugging Face ``transformers`` built from a config with
random initialisation, so nothing is downloaded. Tokens are bytes (a vocabulary of 256), so no
tokenizer is needed either; for your own model, replace ``build_model`` and ``TextBatches``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from geoloco.scenarios.workloads.corpus import held_out_corpus, resolve_root, split_corpus

VOCAB_SIZE = 256
"""Byte-level tokens: every byte of the text is one token."""
EVAL_FRACTION = 0.05
"""Share of the corpus held out for evaluation (whole modules no site trains on)."""


@dataclass(frozen=True)
class ModelSize:
    """The knobs of the decoder; the defaults train in seconds on a laptop CPU."""

    hidden_size: int = 64
    intermediate_size: int = 172
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 256

    def llama_config(self) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=VOCAB_SIZE,
            tie_word_embeddings=False,  # FSDP shards the embedding and the head separately
            **dataclasses.asdict(self),
        )


def build_model(size: ModelSize, seed: int = 0) -> LlamaForCausalLM:
    """The decoder, randomly initialised from ``seed`` (the coordinator's seed sets the run's
    initial weights; a site's are overwritten by them at join)."""
    torch.manual_seed(seed)
    return LlamaForCausalLM(size.llama_config())


class TextBatches:
    """Endless random windows of one site's share of the corpus, as (batch, seq_len) byte ids.

    The corpus is the Python standard library's own source (real text on every machine, no
    download); ``geoloco.scenarios.workloads.corpus`` deals its modules to ``num_sites`` sites so
    every site trains on different code. The ranks of one site read the same share with
    different seeds, as data-parallel ranks do.
    """

    def __init__(self, site_index: int, num_sites: int, *, batch_size: int, seq_len: int, seed: int) -> None:
        split = split_corpus(resolve_root(""), num_sites, EVAL_FRACTION, 0)
        self.text = split.site_data[site_index]
        self.batch_size, self.seq_len = batch_size, seq_len
        self.generator = torch.Generator().manual_seed(seed)

    def __iter__(self) -> Iterator[torch.Tensor]:
        return self

    def __next__(self) -> torch.Tensor:
        starts = torch.randint(0, self.text.numel() - self.seq_len, (self.batch_size,), generator=self.generator)
        return torch.stack([self.text[s : s + self.seq_len] for s in starts.tolist()]).long()


def eval_windows(count: int, seq_len: int) -> torch.Tensor:
    """``count`` fixed windows of the held-out text: the same on the coordinator and every rank."""
    _, text = held_out_corpus(resolve_root(""), EVAL_FRACTION)
    stride = max(1, (text.numel() - seq_len) // count)
    return torch.stack([text[i * stride : i * stride + seq_len] for i in range(count)]).long()


@torch.no_grad()
def eval_loss(model: torch.nn.Module, windows: torch.Tensor) -> float:
    """Mean next-byte cross-entropy (nats) of ``model`` on ``windows``."""
    was_training = model.training
    model.eval()
    loss = model(input_ids=windows, labels=windows).loss
    model.train(was_training)
    return float(loss)
