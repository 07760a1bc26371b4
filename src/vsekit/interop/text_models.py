"""Transformer configurations for imported checkpoints: shapes from the weights, the rest from a config JSON.

The released code always loads `bert-base-uncased` / a named ViT from the hub and never stores their
configurations. Widths, layer counts, vocabulary and position table sizes are read from the weights; the
number of attention heads cannot be, so it comes from `--text-config` / `--vision-config` (a transformers
config JSON) or the base models' 12. A config that disagrees with the weights is an error naming the field.
The tokenizer is bert-base-uncased's 30,522-token uncased WordPiece vocabulary, which the offline
all-MiniLM-L6-v2 package ships (tests/test_import.py checks its anchors).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from vsekit.interop.checkpoint_reader import ReleasedCheckpointError

BERT_BASE_UNCASED = {
    "model_type": "bert",
    "architectures": ["BertModel"],
    "vocab_size": 30522,
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "intermediate_size": 3072,
    "hidden_act": "gelu",
    "hidden_dropout_prob": 0.1,
    "attention_probs_dropout_prob": 0.1,
    "max_position_embeddings": 512,
    "type_vocab_size": 2,
    "initializer_range": 0.02,
    "layer_norm_eps": 1e-12,
    "pad_token_id": 0,
    "position_embedding_type": "absolute",
}
VIT_BASE_PATCH16_224_IN21K = {
    "model_type": "vit",
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "intermediate_size": 3072,
    "hidden_act": "gelu",
    "hidden_dropout_prob": 0.0,
    "attention_probs_dropout_prob": 0.0,
    "initializer_range": 0.02,
    "layer_norm_eps": 1e-12,
    "image_size": 224,
    "patch_size": 16,
    "num_channels": 3,
    "qkv_bias": True,
}
BERT_UNCASED_VOCAB_SIZE = 30522


def read_config_json(path: str | None, what: str) -> dict[str, Any]:
    if not path:
        return {}
    p = Path(path)
    if not p.is_file():
        raise ReleasedCheckpointError(f"{p}: {what} config file does not exist")
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ReleasedCheckpointError(f"{p}: not a JSON {what} config ({e})") from None
    if not isinstance(data, dict):
        raise ReleasedCheckpointError(f"{p}: a {what} config must be a JSON object")
    return data


def merge_shapes(
    base: dict[str, Any],
    given: dict[str, Any],
    shapes: dict[str, int],
    label: str,
    path: Path,
    config_path: str | None = None,
) -> dict:
    """`base` updated with `given`; every shape field read from the weights must agree with `given`, and the
    numeric fields of `given` (read from `config_path`) must be numbers of the right kind."""
    for key, value in given.items():
        expected = type(base.get(key, shapes.get(key)))
        wrong_int = expected is int and (isinstance(value, bool) or not isinstance(value, int))
        wrong_float = expected is float and (isinstance(value, bool) or not isinstance(value, (int, float)))
        wrong_other = expected in (str, bool) and not isinstance(value, expected)
        if wrong_int or wrong_float or wrong_other:
            want = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}[expected]
            raise ReleasedCheckpointError(
                f"{config_path or path}: {label} config field {key!r} is {value!r}, expected {want}"
            )
    if "hidden_act" in given:
        from transformers.activations import ACT2FN

        if given["hidden_act"] not in ACT2FN:
            raise ReleasedCheckpointError(
                f"{config_path or path}: {label} config field 'hidden_act' is "
                f"{given['hidden_act']!r}, not an activation transformers knows "
                f"(e.g. {', '.join(sorted(ACT2FN)[:5])})"
            )
    cfg = {**base, **given}
    for key, value in shapes.items():
        if key in given and int(given[key]) != value:
            raise ReleasedCheckpointError(
                f"{path}: {label} config says {key}={given[key]} but the weights have {value}"
            )
        cfg[key] = value
    heads = int(cfg["num_attention_heads"])
    if heads < 1 or cfg["hidden_size"] % heads:
        raise ReleasedCheckpointError(
            f"{path}: {label} width {cfg['hidden_size']} is not divisible by "
            f"num_attention_heads={heads}; pass the model's config JSON "
            f"(--{'text' if label == 'BERT' else 'vision'}-config)"
        )
    return cfg


def count_layers(state: dict[str, torch.Tensor], prefix: str) -> int:
    ids = {int(k[len(prefix) :].split(".")[0]) for k in state if k.startswith(prefix)}
    return max(ids) + 1 if ids else 0


def bert_config_from_weights(
    state: dict[str, torch.Tensor], prefix: str, text_config: str | None, path: Path
) -> dict:
    def shape(key: str) -> tuple[int, ...]:
        if prefix + key not in state:
            raise ReleasedCheckpointError(f"{path}: missing BERT key {prefix + key!r}")
        return tuple(state[prefix + key].shape)

    words = shape("embeddings.word_embeddings.weight")
    shapes = {
        "vocab_size": words[0],
        "hidden_size": words[1],
        "max_position_embeddings": shape("embeddings.position_embeddings.weight")[0],
        "type_vocab_size": shape("embeddings.token_type_embeddings.weight")[0],
        "num_hidden_layers": count_layers(state, prefix + "encoder.layer."),
        "intermediate_size": shape("encoder.layer.0.intermediate.dense.weight")[0],
    }
    return merge_shapes(
        BERT_BASE_UNCASED, read_config_json(text_config, "BERT"), shapes, "BERT", path, text_config
    )


def uncased_wordpiece_vocab() -> bytes:
    """bert-base-uncased's vocab.txt, as shipped by the offline all-MiniLM-L6-v2 package."""
    from vsekit.models.text import default_transformer_path

    data = (Path(default_transformer_path()) / "vocab.txt").read_bytes()
    if len(data.decode("utf-8").splitlines()) != BERT_UNCASED_VOCAB_SIZE:
        raise ReleasedCheckpointError(
            "the packaged all-MiniLM-L6-v2 vocab.txt is not the 30,522-token uncased one"
        )
    return data


def bert_model_files(
    state: dict[str, torch.Tensor], prefix: str, text_config: str | None, path: Path
) -> tuple[dict[str, bytes], list[str]]:
    """Files of the run's text_model/ folder: config.json and, for the real vocabulary size, the tokenizer."""
    cfg = bert_config_from_weights(state, prefix, text_config, path)
    files = {"config.json": json.dumps(cfg, indent=2).encode()}
    notes = []
    if cfg["vocab_size"] == BERT_UNCASED_VOCAB_SIZE:
        files["vocab.txt"] = uncased_wordpiece_vocab()
        files["tokenizer_config.json"] = json.dumps(
            {
                "tokenizer_class": "BertTokenizer",
                "do_lower_case": True,
                "model_max_length": cfg["max_position_embeddings"],
            }
        ).encode()
    else:
        notes.append(
            f"BERT vocabulary of {cfg['vocab_size']} tokens is not bert-base-uncased's "
            f"{BERT_UNCASED_VOCAB_SIZE}: no tokenizer written, the run encodes token ids only"
        )
    return files, notes


def vit_config_from_checkpoint(
    state: dict[str, torch.Tensor], prefix: str, vision_config: str | None, path: Path
) -> tuple[dict[str, Any], list[str]]:
    """ViTConfig fields from the released `visual_encoder.*` weights (transformers 4.x key names)."""

    def shape(key: str) -> tuple[int, ...]:
        if prefix + key not in state:
            raise ReleasedCheckpointError(f"{path}: missing ViT key {prefix + key!r}")
        return tuple(state[prefix + key].shape)

    proj = shape("embeddings.patch_embeddings.projection.weight")  # [hidden, channels, patch, patch]
    positions = shape("embeddings.position_embeddings")[1] - 1
    grid = int(round(positions**0.5))
    if grid * grid != positions:
        raise ReleasedCheckpointError(
            f"{path}: ViT position table of {positions} patches is not a square grid"
        )
    shapes = {
        "hidden_size": proj[0],
        "num_channels": proj[1],
        "patch_size": proj[2],
        "image_size": grid * proj[2],
        "num_hidden_layers": count_layers(state, prefix + "encoder.layer."),
        "intermediate_size": shape("encoder.layer.0.intermediate.dense.weight")[0],
        "qkv_bias": prefix + "encoder.layer.0.attention.attention.query.bias" in state,
    }
    cfg = merge_shapes(
        VIT_BASE_PATCH16_224_IN21K, read_config_json(vision_config, "ViT"), shapes, "ViT", path, vision_config
    )
    return cfg, []
