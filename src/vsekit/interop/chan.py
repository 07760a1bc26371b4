"""Importer for the checkpoints the released CHAN code writes (ppanzx/CHAN, BiGRU configuration).

`train.py` saves `{'epoch', 'model', 'best_rsum', 'opt', 'Eiters'}` where `model` is a list of four state dicts:
`[0]` the self-attention region encoder (`fc`, `feedforward.ln`, `feedforward.attn`), `[1]` the BiGRU text
encoder (`embed`, `rnn`, and `fc`, which its forward never uses), `[2]` the similarity module and `[3]` the loss
(both without weights). The pickled options carry the vocabulary itself (`opt.word2idx`, a plain dict of word
-> id, `<mask>` included): read through the restricted unpickler (`read_released_checkpoint`), which builds
only containers, numbers, strings, tensors and `argparse.Namespace`, never other objects.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vsekit.interop.checkpoint_reader import (
    ReleasedCheckpointError,
    check_finite_weights,
    float_option,
    int_option,
    json_safe,
    options_dict,
    read_released_checkpoint,
)
from vsekit.interop.released import (
    ImportedModel,
    base_recipe,
    bigru_settings,
    check_embed_size,
    check_norms,
    inverse,
    read_vocab,
    rename,
    strip_prefix,
    tensor,
)
from vsekit.models.vse import DataSpec

CHAN_IMAGE_RULES = [
    ("fc.", "image_encoder.fc."),
    ("feedforward.ln.", "image_encoder.attend.ln."),
    ("feedforward.attn.", "image_encoder.attend.attn."),
]
# the text encoder's `fc` is built and saved but its forward never applies it
CHAN_TEXT_RULES = [("embed.", "text_encoder.embed."), ("rnn.", "text_encoder.gru."), ("fc.", None)]
# the released pooling heads -> `model.similarity.word_pooling` (SoftmaxPooling gives NaN as released: refused)
WORD_POOLINGS = {"LSEPooling": "lse", "MaxPooling": "max", "MeanPooling": "mean", "SumPooling": "sum"}
RELEASED_HEADS = 8  # nn.MultiheadAttention(embed_size, 8) in the released SelfAttention


def vocabulary_from_options(options: dict[str, Any], rows: int, path: Path) -> list[str]:
    """The words by id from the pickled `opt.word2idx` (ids 0..n-1 once each, n = the embedding's rows)."""
    word2idx = options.get("word2idx")
    if not isinstance(word2idx, dict) or not word2idx:
        raise ReleasedCheckpointError(
            f"{path}: the pickled options hold no vocabulary (opt.word2idx); pass --vocab "
            "with the SCAN vocabulary JSON the model was trained with"
        )
    words: list[str | None] = [None] * len(word2idx)
    for word, idx in word2idx.items():
        if not isinstance(word, str) or isinstance(idx, bool) or not isinstance(idx, int):
            raise ReleasedCheckpointError(
                f"{path}: opt.word2idx entry {word!r}: {idx!r} is not word -> integer id"
            )
        if not 0 <= idx < len(words) or words[idx] is not None:
            raise ReleasedCheckpointError(
                f"{path}: opt.word2idx gives id {idx} to {word!r}; ids must be 0..{len(words) - 1}, each once"
            )
        words[idx] = word
    if len(words) != rows:
        raise ReleasedCheckpointError(
            f"{path}: opt.word2idx has {len(words)} words but the embedding table has {rows} rows"
        )
    return [w for w in words if w is not None]


def check_options(options: dict[str, Any], path: Path) -> str:
    """The released configuration vsekit imports (BiGRU text, self-attention regions, VHA coding); returns the
    word pooling."""
    for name, want in (
        ("text_enc_type", "bigru"),
        ("precomp_enc_type", "selfattention"),
        ("coding_type", "VHACoding"),
    ):
        if options.get(name, want) != want:
            raise ReleasedCheckpointError(
                f"{path}: {name}={options[name]!r}; vsekit imports CHAN's {want!r} "
                "configuration (the BiGRU scripts of scripts/train.sh)"
            )
    head = options.get("pooling_type", "LSEPooling")
    if head not in WORD_POOLINGS:
        raise ReleasedCheckpointError(
            f"{path}: pooling_type={head!r}; vsekit imports {', '.join(WORD_POOLINGS)}"
        )
    return WORD_POOLINGS[head]


def import_chan(checkpoint: str | Path, vocab: str | None = None) -> ImportedModel:
    """Read and map a released CHAN checkpoint (nothing written); any misfit is one line naming it."""
    path = Path(checkpoint)
    ckpt = read_released_checkpoint(path)
    options = options_dict(ckpt, "opt", path)
    model = ckpt["model"]
    if not (isinstance(model, (list, tuple)) and len(model) == 4 and all(isinstance(m, dict) for m in model)):
        raise ReleasedCheckpointError(
            f"{path}: 'model' is not the list of four state dicts the CHAN scripts save "
            "(image, text, similarity, loss)"
        )
    img = strip_prefix(model[0], "module.")
    txt = strip_prefix(model[1], "module.")
    check_norms(options, path)
    word_pooling = check_options(options, path)
    recipe = base_recipe("chan", {"name": "imported_chan"})
    fc = tensor(img, "fc.weight", path)
    embed, img_dim = int(fc.shape[0]), int(fc.shape[1])
    check_embed_size(options, "embed_size", embed, path)
    given_dim = int_option(options, "img_dim", path, None)
    if given_dim is not None and given_dim != img_dim:
        raise ReleasedCheckpointError(f"{path}: img_dim={given_dim} but fc.weight takes {img_dim} inputs")
    if embed % RELEASED_HEADS:
        raise ReleasedCheckpointError(
            f"{path}: embed size {embed} is not a multiple of the release's {RELEASED_HEADS} attention heads"
        )
    recipe.model.embed_dim = embed
    recipe.model.image.kind = "selfattention"
    recipe.model.image.selfattn_heads = RELEASED_HEADS
    recipe.model.image.selfattn_mask_padding = False  # the release passes no lengths to its attention
    rows = bigru_settings(recipe, txt, options, path)
    words = read_vocab(vocab, rows, options, path) if vocab else vocabulary_from_options(options, rows, path)
    recipe.model.similarity.name = "chan"
    recipe.model.similarity.word_pooling = word_pooling
    recipe.model.similarity.lse_temperature = float_option(options, "belta", path, 0.1)
    recipe.loss.name = "triplet"
    recipe.loss.margin = float_option(options, "margin", path, recipe.loss.margin)
    recipe.loss.warmup_epochs = int_option(options, "vse_mean_warmup_epochs", path, recipe.loss.warmup_epochs)
    spec = DataSpec(img_dim=img_dim, vocab_words=words)
    state_i, unused_i, unknown_i = rename(img, CHAN_IMAGE_RULES, "model[0].")
    state_t, unused_t, unknown_t = rename(txt, CHAN_TEXT_RULES, "model[1].")
    weighted = [f"model[{i}].{k}" for i in (2, 3) for k in model[i]]  # the release's are empty
    check_finite_weights(ckpt, path)
    options.pop("word2idx", None)  # the vocabulary is the run's own (vocab.json), not an option to record
    return ImportedModel(
        "chan",
        recipe,
        spec,
        {**state_i, **state_t},
        json_safe(options),
        unused_i + unused_t,
        unknown_i + unknown_t + weighted,
        {},
        [],
        inverse(CHAN_IMAGE_RULES, "model[0].") + inverse(CHAN_TEXT_RULES, "model[1]."),
    )
