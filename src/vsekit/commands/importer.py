"""`vse import KIND CHECKPOINT --out RUN`: a released checkpoint (VSE∞, VSE+2AD, AVSE, HREM, ESA, CHAN) as a
vsekit run."""

from __future__ import annotations

import argparse
import importlib

from vsekit.commands.argtypes import POSITIVE

# the releases whose importer is a module of its own: kind -> (module, function, the options it takes)
OWN_IMPORTERS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "chan": ("vsekit.interop.chan", "import_chan", ("vocab",)),
    "esa": ("vsekit.interop.esa", "import_esa", ("vocab",)),
    "hrem": ("vsekit.interop.hrem", "import_hrem", ("text_config",)),
}


def run_import(args: argparse.Namespace) -> int:
    from vsekit.interop.released import check_out_dir, import_checkpoint, write_imported_run

    check_out_dir(args.out)  # a bad --out is reported before the checkpoint is read
    if args.kind in OWN_IMPORTERS:
        module, function, options = OWN_IMPORTERS[args.kind]
        importer = getattr(importlib.import_module(module), function)
        imported = importer(args.checkpoint, **{o: getattr(args, o) for o in options})
    else:
        imported = import_checkpoint(
            args.kind,
            args.checkpoint,
            vocab=args.vocab,
            text_config=args.text_config,
            vision_config=args.vision_config,
            block_dim=args.block_dim,
        )
    out = write_imported_run(imported, args.checkpoint, args.out)
    r = imported.recipe.model
    print(f"imported {imported.kind} from {args.checkpoint} -> {out}")
    print(
        f"  embed {r.embed_dim}, image {r.image.kind} ({r.image.pooling.name}), text {r.text.kind} "
        f"({r.text.pooling.name}), similarity {r.similarity.name}, loss {imported.recipe.loss.name}"
    )
    if imported.unused_keys:
        print(
            f"  {len(imported.unused_keys)} stored key(s) the released forward never reads, recorded in "
            f"{out}/config.json under imported_from (e.g. {imported.unused_keys[0]})"
        )
    for note in imported.notes:
        print(f"  note: {note}")
    print(f"  next: vse eval {out} --data DIR --split test   |   python: vsekit.load({str(out)!r})")
    return 0


def register(sub) -> None:
    p = sub.add_parser(
        "import",
        help="import a released VSE∞ / VSE+2AD / AVSE / HREM / ESA / CHAN checkpoint as a vsekit run",
    )
    p.add_argument(
        "kind",
        choices=("vse_infty", "vse_2ad", "avse", *OWN_IMPORTERS),
        help="vse_infty: BiGRU or BERT release (detected from the keys)",
    )
    p.add_argument(
        "checkpoint", help="model_best.pth / checkpoint.pth as the released training script wrote it"
    )
    p.add_argument("--out", required=True, help="run directory to create (must not exist or be empty)")
    p.add_argument(
        "--vocab",
        help="BiGRU releases: the SCAN vocabulary JSON it was trained with (chan: default "
        "the vocabulary its checkpoint holds)",
    )
    p.add_argument(
        "--text-config", help="BERT bodies: a transformers config JSON (default: bert-base-uncased)"
    )
    p.add_argument(
        "--vision-config", help="AVSE: a transformers ViT config JSON (default: vit-base-patch16-224-in21k)"
    )
    p.add_argument(
        "--block-dim",
        type=int,
        action=POSITIVE,
        help="AVSE: AEOM block size (default: embed size / 4, the release's 256)",
    )
    p.set_defaults(func=run_import)
