"""A bidirectional GRU over a padded batch without `pack_padded_sequence`: fixed shapes, no host sync.

`pack_padded_sequence` needs the lengths on the CPU (a device-to-host copy, i.e. a sync, when they live on
the GPU) and gives the GRU data-dependent batch sizes per time step, so a step using it can be neither
captured in a CUDA graph nor compiled whole. Instead, with each layer run one direction at a time through
`torch.gru` with the module's own weights (state-dict keys unchanged):

- forward direction over the padded batch as is: its output at a valid position t < n depends on the
  inputs 0..t only, so trailing padding changes nothing there;
- backward direction over each sequence's reversed valid prefix (gather with index `(n-1-t).clamp(min=0)`,
  so the padding comes last and is never read by a valid output), gathered back the same way.

Positions t >= n come out as zeros, as `pad_packed_sequence` fills them. Equal to the packed module up to
float rounding (the same recurrences on the same numbers; only the GEMM batch shapes differ). Used by
GPO's weights (`vsekit.pooling.gpo`) and the BiGRU caption encoder (`vsekit.models.text`).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

# Devices whose autocast runs cuDNN's RNN (`_cudnn_rnn`, what `torch.gru` calls there) in float16 whatever the
# autocast dtype, bf16 included (PyTorch's aten/src/ATen/cudnn/AutocastRNN.cpp): float16 gradients would need the
# loss scaling a bf16 run does not do, so the GRUs run in float32 there. Elsewhere (the CPU) autocast runs the
# GRU's matrix products in the autocast dtype, as the user asked.
FLOAT16_RNN_AUTOCAST = ("cuda",)


def gru_direction(
    x: torch.Tensor, params: list[torch.Tensor], hidden: int, train: bool = False
) -> torch.Tensor:
    """One layer, one direction of a GRU over batch-first `x` [B, T, I] from a zero state -> [B, T, hidden].

    `params` = [w_ih, w_hh(, b_ih, b_hh)] as `nn.GRU` names them for a layer/direction.

    Under CUDA autocast it runs in its weights' dtype (float32) with autocast off (`FLOAT16_RNN_AUTOCAST`).
    """
    if x.device.type in FLOAT16_RNN_AUTOCAST and torch.is_autocast_enabled(x.device.type):
        with torch.autocast(x.device.type, enabled=False):
            return gru_direction(x.to(params[0].dtype), params, hidden, train)
    h0 = x.new_zeros(1, x.shape[0], hidden)
    has_biases = len(params) == 4
    if torch.compiler.is_compiling():  # dynamo traces no warnings filter; a compiled graph warns nothing
        return torch.gru(x, h0, params, has_biases, 1, 0.0, train, False, True)[0]
    with warnings.catch_warnings():  # cuDNN notes that weights passed one by one are not one flat buffer
        warnings.simplefilter("ignore", UserWarning)
        return torch.gru(x, h0, params, has_biases, 1, 0.0, train, False, True)[0]


def _layer_params(gru: nn.GRU, layer: int, suffix: str) -> list[torch.Tensor]:
    names = [f"weight_ih_l{layer}{suffix}", f"weight_hh_l{layer}{suffix}"]
    if gru.bias:
        names += [f"bias_ih_l{layer}{suffix}", f"bias_hh_l{layer}{suffix}"]
    return [getattr(gru, name) for name in names]


def bigru_unpacked(gru: nn.GRU, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """`gru` (bidirectional, batch_first) on padded `x` [B, T, I] with `lengths` [B] (clamped to [1, T]) ->
    [B, T, 2*hidden], forward and backward halves as `nn.GRU` concatenates them, zeros past each length:
    what `pad_packed_sequence(gru(pack_padded_sequence(x, lengths)), total_length=T)` returns, unpacked."""
    if not (gru.bidirectional and gru.batch_first) or gru.proj_size:
        raise ValueError("bigru_unpacked needs a bidirectional, batch_first nn.GRU without projection")
    b, t = x.shape[:2]
    h = gru.hidden_size
    n = lengths.to(x.device, torch.int64, non_blocking=True).clamp(1, max(t, 1))
    steps = torch.arange(t, device=x.device)
    valid = (steps[None, :] < n[:, None]).unsqueeze(-1)  # [B, T, 1]
    rev = (n[:, None] - 1 - steps[None, :]).clamp(min=0).unsqueeze(-1)  # [B, T, 1]: t -> n-1-t
    out = x
    for layer in range(gru.num_layers):
        if layer and gru.dropout and gru.training:  # nn.GRU's dropout between layers
            out = nn.functional.dropout(out, gru.dropout, True)
        fw = gru_direction(out, _layer_params(gru, layer, ""), h, gru.training)
        reversed_in = out.gather(1, rev.expand(-1, -1, out.shape[-1]))
        bw = gru_direction(reversed_in, _layer_params(gru, layer, "_reverse"), h, gru.training)
        out = torch.cat([fw, bw.gather(1, rev.expand(-1, -1, h))], dim=-1)
    return out.masked_fill(~valid, 0.0)
