"""`vse train` and `vse recipes`."""

from __future__ import annotations

import argparse

from vsekit.config import builtin_recipes, load_recipe, to_dict


def add_recipe_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--recipe", default="vse_infty", help=f"built-in ({', '.join(builtin_recipes())}) or a YAML file")
    p.add_argument("--epochs", type=int, help="override train.epochs")
    p.add_argument("--batch-size", type=int, help="override train.batch_size")
    p.add_argument("--device", help="cpu, cuda, cuda:1 … (default: cuda when available)")
    p.add_argument("--seed", type=int, help="override train.seed")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any recipe key, e.g. model.embed_dim=512")


def recipe_from_args(args: argparse.Namespace):
    overrides = list(args.set)
    for flag, key in (("epochs", "train.epochs"), ("batch_size", "train.batch_size"), ("device", "train.device"), ("seed", "train.seed")):
        value = getattr(args, flag, None)
        if value is not None:
            overrides.append(f"{key}={value}")
    return load_recipe(args.recipe, overrides)


def run_train(args: argparse.Namespace) -> int:
    from vsekit.training.checkpoint import read_run_config
    from vsekit.training.trainer import Trainer

    if args.resume:
        recipe, _, cfg = read_run_config(args.resume)
        trainer = Trainer(recipe, args.data or cfg["data_dir"], args.resume, resume=True, progress=not args.no_progress)
    else:
        if not args.data or not args.out:
            raise ValueError("vse train needs --data DIR and --out RUN_DIR (or --resume RUN_DIR)")
        recipe = recipe_from_args(args)
        trainer = Trainer(recipe, args.data, args.out, overwrite=args.overwrite, progress=not args.no_progress)
    result = trainer.fit()
    print(f"best dev rsum {result['best_rsum']:.2f} at epoch {result['best_epoch'] + 1}; run: {trainer.run_dir}")
    return 0


def run_recipes(args: argparse.Namespace) -> int:
    import yaml

    if args.name:
        print(yaml.safe_dump(to_dict(load_recipe(args.name)), sort_keys=False))
    else:
        print("\n".join(builtin_recipes()))
    return 0


def register(sub) -> None:
    p = sub.add_parser("train", help="train a model from a recipe")
    p.add_argument("--data", help="dataset directory (precomp layout)")
    p.add_argument("--out", help="run directory to create")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue an interrupted run exactly where it stopped")
    p.add_argument("--overwrite", action="store_true", help="replace an existing run in --out")
    p.add_argument("--no-progress", action="store_true", help="log lines instead of a progress bar")
    add_recipe_args(p)
    p.set_defaults(func=run_train)
    r = sub.add_parser("recipes", help="list built-in recipes, or print one fully resolved")
    r.add_argument("name", nargs="?")
    r.set_defaults(func=run_recipes)
