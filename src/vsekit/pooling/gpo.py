"""Generalized Pooling Operator (GPO) from VSE∞ (Chen et al., CVPR 2021).

pooled_d = sum_k theta_k * x_(k),d where x_(k),d is the k-th largest value of dimension d and the
weights theta depend only on (rank k, set size N): sin/cos positions -> BiGRU (directions averaged)
-> bias-free linear -> softmax with temperature 0.1, padding masked. Faithful to the reference code
(`lib/modules/aggr/gpo.py`); because theta depends on N alone, one call computes the weights of every
set size 1..L (L = the padded width) as one [L, L] table and gathers each sample's row on the device (same
numbers, far fewer GRU steps). Nothing depends on the values of `lengths` but the gather: no host sync,
no data-dependent shape, so the pooling compiles whole (`fullgraph=True`) and fits in a CUDA graph.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from vsekit.pooling.basic import length_mask, sort_desc_per_dim
from vsekit.pooling.rnn import gru_direction


def positional_encoding_1d(d_model: int, length: int, device: torch.device | None = None) -> torch.Tensor:
    """Transformer sin/cos table [length, d_model]; position 0-based, even dims sin, odd dims cos."""
    if d_model % 2:
        raise ValueError(f"positional encoding needs an even size, got {d_model}")
    position = torch.arange(length, dtype=torch.float32, device=device).unsqueeze(1)
    div_term = torch.exp(
        torch.arange(0, d_model, 2, dtype=torch.float32, device=device) * -(math.log(10000.0) / d_model)
    )
    pe = torch.zeros(length, d_model, device=device)
    pe[:, 0::2] = torch.sin(position * div_term)
    pe[:, 1::2] = torch.cos(position * div_term)
    return pe


class GPO(nn.Module):
    """Learned pooling over per-dimension sorted features; drop-in `pool(features, lengths)`."""

    def __init__(self, d_pe: int = 32, d_hidden: int = 32, temperature: float = 0.1) -> None:
        super().__init__()
        self.d_pe = d_pe
        self.temperature = temperature
        self.gru = nn.GRU(d_pe, d_hidden, num_layers=1, batch_first=True, bidirectional=True)
        self.linear = nn.Linear(d_hidden, 1, bias=False)
        # sin/cos tables by (length, device): constants, built once per width instead of every call
        self._pe_cache: dict[tuple[int, torch.device], torch.Tensor] = {}

    def positions(self, max_len: int, device: torch.device) -> torch.Tensor:
        """The [max_len, d_pe] positional encoding on `device`, cached (computed inline while compiling)."""
        if torch.compiler.is_compiling():
            return positional_encoding_1d(self.d_pe, max_len, device=device)
        key = (max_len, torch.device(device))
        pe = self._pe_cache.get(key)
        if pe is None:
            pe = self._pe_cache[key] = positional_encoding_1d(self.d_pe, max_len, device=device)
        return pe

    def weights_for_lengths(self, lengths: torch.Tensor, max_len: int) -> torch.Tensor:
        """Pooling weights [len(lengths), max_len] for each set size in `lengths` (zeros on padding).

        The same numbers as the reference's packed BiGRU (`weights_packed`) without packing, whose per-time-step
        copies dominate a CUDA step: the forward direction at position k sees positions <= k only, so one
        sequence of max_len serves every size; the backward direction of size N reads positions N-1 .. 0,
        so it runs over each size's reversed prefix, padding last (never read).
        """
        device = self.linear.weight.device
        g = self.gru
        n = lengths.detach().to(device, torch.int64, non_blocking=True).clamp(min=1)
        pe = self.positions(max_len, device)
        h = g.hidden_size
        fw = [g.weight_ih_l0, g.weight_hh_l0, g.bias_ih_l0, g.bias_hh_l0]
        bw = [g.weight_ih_l0_reverse, g.weight_hh_l0_reverse, g.bias_ih_l0_reverse, g.bias_hh_l0_reverse]
        rev = (n[:, None] - 1 - torch.arange(max_len, device=device)[None, :]).clamp(min=0)  # [U, L]
        out_f = gru_direction(pe.unsqueeze(0), fw, h, self.training)
        out_b = gru_direction(pe[rev], bw, h, self.training)
        hidden = (out_f + out_b.gather(1, rev.unsqueeze(-1).expand(-1, -1, h))) / 2
        mask = length_mask(n, max_len)
        scores = self.linear(hidden).squeeze(-1).masked_fill(~mask, -10000.0)
        return torch.softmax(scores / self.temperature, dim=1)

    def weights_packed(self, lengths: torch.Tensor, max_len: int) -> torch.Tensor:
        """`weights_for_lengths` as the reference computes it (masked positions, packed BiGRU)."""
        device = self.linear.weight.device
        lengths_cpu = lengths.detach().to("cpu", torch.int64).clamp(min=1)
        pe = positional_encoding_1d(self.d_pe, max_len, device=device)
        pe = pe.unsqueeze(0).expand(len(lengths_cpu), -1, -1)
        mask = length_mask(lengths_cpu.to(device), max_len)
        pe = pe.masked_fill(~mask.unsqueeze(-1), 0.0)
        packed = pack_padded_sequence(pe, lengths_cpu, batch_first=True, enforce_sorted=False)
        out, _ = self.gru(packed)
        out, _ = pad_packed_sequence(out, batch_first=True, total_length=max_len)
        half = out.shape[-1] // 2
        hidden = (out[..., :half] + out[..., half:]) / 2
        scores = self.linear(hidden).squeeze(-1).masked_fill(~mask, -10000.0)
        return torch.softmax(scores / self.temperature, dim=1)

    def forward(
        self, features: torch.Tensor, lengths: torch.Tensor, return_weights: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Pooled [B, D] (and the weights [B, L], zeros past each set's size, with `return_weights`).

        L is the padded width `features.shape[1]`: a batch padded further gives the same result (the
        padding gets weight 0). The weights of all sizes 1..L are one [L, L] table gathered by `lengths - 1`
        on the device, or, when the batch is smaller than L, computed for the batch's sizes directly (the
        cheaper of the two; both shapes are static).
        """
        b, max_len = features.shape[0], features.shape[1]
        device = self.linear.weight.device
        n = lengths.detach().to(device, torch.int64, non_blocking=True).clamp(1, max(max_len, 1))
        if b < max_len:
            weights = self.weights_for_lengths(n, max_len)
        else:
            table = self.weights_for_lengths(torch.arange(1, max_len + 1, device=device), max_len)  # [L, L]
            # indexing, not index_select: on CUDA its backward sorts the rows and sums each one's repeats in a
            # fixed order (index_select's adds them with atomics, in a varying order: no bit-exact resume)
            weights = table[n - 1]
        weights = weights.to(features.device, features.dtype)
        ordered = sort_desc_per_dim(features, lengths.to(features.device, non_blocking=True))
        pooled = (ordered * weights.unsqueeze(-1)).sum(1)
        return (pooled, weights) if return_weights else pooled
