"""`vse import KIND CHECKPOINT --out RUN`: a released VSE∞ / VSE+2AD / AVSE checkpoint as a vsekit run."""

from __future__ import annotations

import argparse

from vsekit.commands.argtypes import POSITIVE


def run_import(args: argparse.Namespace) -> int:
    from vsekit.interop.released import check_out_dir, import_checkpoint, write_imported_run

    check_out_dir(args.out)  # a bad --out is reported before the checkpoint is read
    if args.kind == "chan":  # its importer is its own module (vsekit.interop.chan)
        from vsekit.interop.chan import import_chan

        imported = import_chan(args.checkpoint, vocab=args.vocab)
    elif args.kind == "esa":  # its importer is its own module (vsekit.interop.esa)
        from vsekit.interop.esa import import_esa

        imported = import_esa(args.checkpoint, vocab=args.vocab)
    elif args.kind == "hrem":  # its importer is its own module (vsekit.interop.hrem)
        from vsekit.interop.hrem import import_hrem

        imported = import_hrem(args.checkpoint, text_config=args.text_config)
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
    p = sub.add_parser("import", help="import a released VSE∞ / VSE+2AD / AVSE checkpoint as a vsekit run")
    p.add_argument(
        "kind",
        choices=("vse_infty", "vse_2ad", "avse", "chan", "esa", "hrem"),
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
