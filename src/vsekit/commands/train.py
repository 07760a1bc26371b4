"""`vse train` and `vse recipes`."""

from __future__ import annotations

import argparse
import contextlib
import shlex
from pathlib import Path

from vsekit.commands.argtypes import at_least
from vsekit.config import builtin_recipes, load_recipe, to_dict
from vsekit.errors import VseInputError


def add_recipe_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--recipe", help=f"built-in ({', '.join(builtin_recipes())}) or a YAML file (default: vse_infty)"
    )
    p.add_argument(
        "--epochs",
        type=int,
        action=at_least(1),
        help="override train.epochs; with --resume: train the run on to N epochs in all",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        action=at_least(2),
        help="override train.batch_size (at least 2: in-batch negatives)",
    )
    p.add_argument("--device", help="cpu, cuda, cuda:1 … (default: cuda when available)")
    p.add_argument("--seed", type=int, action=at_least(0), help="override train.seed")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any recipe key, e.g. model.embed_dim=512",
    )


def recipe_from_args(args: argparse.Namespace):
    overrides = list(args.set)
    for flag, key in (
        ("epochs", "train.epochs"),
        ("batch_size", "train.batch_size"),
        ("device", "train.device"),
        ("seed", "train.seed"),
    ):
        value = getattr(args, flag, None)
        if value is not None:
            overrides.append(f"{key}={value}")
    return load_recipe(args.recipe or "vse_infty", overrides)


# flags a resumed run cannot take: it continues with the recipe, batches and folder it was started with
_NOT_WITH_RESUME = (
    ("recipe", "--recipe"),
    ("out", "--out"),
    ("batch_size", "--batch-size"),
    ("seed", "--seed"),
    ("overwrite", "--overwrite"),
)
# recipe keys a resumed run may be given with --set: the lr schedule of the epochs still to train, and whether the
# step is replayed as CUDA graphs (the same step either way; checkpoints record the optimizer as it was built)
RESUME_KEYS = ("optim.lr_decay_epochs", "optim.lr_decay", "train.cuda_graph")


def _resume_command(args: argparse.Namespace) -> str:
    parts = ["vse", "train", "--resume", str(args.resume)]
    for flag, value in (("--data", args.data), ("--epochs", args.epochs), ("--device", args.device)):
        if value is not None:
            parts += [flag, str(value)]
    for item in args.set:
        parts += ["--set", item]
    parts += ["--report-to", args.report_to] if getattr(args, "report_to", None) else []
    return shlex.join(parts + (["--no-progress"] if args.no_progress else []))


def _train_command(args: argparse.Namespace) -> str:
    parts = [
        "vse",
        "train",
        "--recipe",
        args.recipe or "vse_infty",
        "--data",
        str(args.data),
        "--out",
        str(args.out),
    ]
    for flag, value in (
        ("--epochs", args.epochs),
        ("--batch-size", args.batch_size),
        ("--device", args.device),
        ("--seed", args.seed),
    ):
        if value is not None:
            parts += [flag, str(value)]
    for item in args.set:
        parts += ["--set", item]
    parts += (["--overwrite"] if args.overwrite else []) + (["--no-progress"] if args.no_progress else [])
    parts += ["--report-to", args.report_to] if getattr(args, "report_to", None) else []
    return shlex.join(parts)


def _config_stamp(run_dir: str | Path) -> tuple[int, int] | None:
    """config.json's file stamp: another after the run means this command set the run up."""
    from vsekit.utils.io import file_stamp

    return file_stamp(Path(run_dir) / "config.json")


def _interrupt_hint(args: argparse.Namespace, before: tuple[int, int] | None) -> str:
    """What to run after Ctrl-C: resume when the run was set up (config.json written by this command, or an
    existing run for --resume), otherwise the same command again (nothing of the new run was saved)."""
    from vsekit.runs import is_run_dir

    if args.resume:
        return f"{args.resume} keeps its last checkpoint; continue with: {_resume_command(args)}"
    if is_run_dir(args.out) and _config_stamp(args.out) != before:
        resume = shlex.join(
            ["vse", "train", "--resume", str(args.out)]
            + (["--no-progress"] if args.no_progress else [])
            + (["--report-to", args.report_to] if getattr(args, "report_to", None) else [])
        )
        return f"{args.out} keeps its last checkpoint (or restarts from step 0 if none was saved); continue with: {resume}"
    kept = "the run already there is untouched" if is_run_dir(args.out) else "nothing was saved"
    return f"{args.out} was not set up yet, {kept}; start again with: {_train_command(args)}"


def run_train(args: argparse.Namespace) -> int:
    if args.resume:
        for attr, flag in _NOT_WITH_RESUME:
            value = getattr(args, attr, None)
            if not (value is None or value is False or value == []):  # `--seed 0` is given too
                raise VseInputError(
                    f"{flag} cannot be combined with --resume: a resumed run keeps its recipe, batches and "
                    f"folder ({args.resume}); only --epochs, --data, --device, --no-progress and "
                    f"--set {'/'.join(RESUME_KEYS)} apply"
                )
        for item in args.set:
            key = item.split("=", 1)[0].strip()
            if key not in RESUME_KEYS:
                raise VseInputError(
                    f"--set {item}: a resumed run keeps its recipe; with --resume only the lr schedule "
                    f"and the CUDA graph switch can change ({', '.join(RESUME_KEYS)}); start a new run to "
                    f"change {key}"
                )
    elif not args.data or not args.out:
        raise VseInputError("vse train needs --data DIR and --out RUN_DIR (or --resume RUN_DIR)")
    before = _config_stamp(args.out) if not args.resume else None
    from vsekit.training.reporting import check_report_to  # no torch: a missing wandb fails before any work

    report_to = check_report_to([args.report_to] if getattr(args, "report_to", None) else [])
    run_dir = Path(args.resume or args.out)
    try:
        from vsekit.distributed import writes_run_files
        from vsekit.runs import run_writer_lock
        from vsekit.utils.io import storage_full_errno, storage_full_error

        # one writer per run, for the whole run: a second `vse train` of this folder stops here, writing nothing
        with run_writer_lock(run_dir) if writes_run_files() else contextlib.nullcontext():
            try:
                trainer, result = _train(args, report_to)
            except OSError as e:  # a write no checkpoint function named (metrics.jsonl, TensorBoard events)
                if storage_full_errno(e) is None:
                    raise
                raise storage_full_error(e.filename or run_dir, e, "the run keeps its last checkpoint") from e
    except KeyboardInterrupt:
        raise KeyboardInterrupt(_interrupt_hint(args, before)) from None
    print(f"best dev rsum {result['best_rsum']:.2f} at epoch {result['best_epoch']}; run: {trainer.run_dir}")
    return 0


def _train(args: argparse.Namespace, report_to: tuple[str, ...]):
    """Build the trainer of a new or resumed run and train it: (trainer, its result)."""
    from vsekit.config import apply_overrides, recipe_from_dict, validate_recipe
    from vsekit.runs import read_run_config
    from vsekit.training.trainer import Trainer

    if args.resume:
        recipe, _, cfg = read_run_config(args.resume)
        # a new lr schedule (or graph switch) for the epochs still to train; config.json records it
        if args.set:
            recipe = recipe_from_dict(apply_overrides(to_dict(recipe), args.set))
        if args.epochs is not None:  # train on to N epochs in all; the lr schedule stays the recipe's
            recipe.train.epochs = args.epochs
        if args.device is not None:
            recipe.train.device = args.device
        validate_recipe(recipe)
        trainer = Trainer(
            recipe,
            args.data or cfg["data_dir"],
            args.resume,
            resume=True,
            progress=not args.no_progress,
            report_to=report_to,
        )
    else:
        recipe = recipe_from_args(args)
        trainer = Trainer(
            recipe,
            args.data,
            args.out,
            overwrite=args.overwrite,
            progress=not args.no_progress,
            report_to=report_to,
        )
    return trainer, trainer.fit()


def run_recipes(args: argparse.Namespace) -> int:
    import yaml

    from vsekit.parts import part_choices, recipe_keys_markdown

    if args.keys:
        if args.name:
            raise VseInputError("--keys lists every key of every recipe: give no recipe name with it")
        print(recipe_keys_markdown(), end="")
    elif args.name:
        print(yaml.safe_dump(to_dict(load_recipe(args.name)), sort_keys=False))
    else:
        print("\n".join(builtin_recipes()))
        print("\nparts a recipe names (their keys: vse recipes --keys):")
        for keys, names in part_choices():
            print(f"{', '.join(keys)}: {', '.join(names)}")
    return 0


def register(sub) -> None:
    p = sub.add_parser("train", help="train a model from a recipe")
    p.add_argument("--data", help="dataset directory (precomp layout)")
    p.add_argument("--out", help="run directory to create")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue an interrupted run exactly where it stopped")
    p.add_argument("--overwrite", action="store_true", help="replace an existing run in --out")
    p.add_argument("--no-progress", action="store_true", help="log lines instead of a progress bar")
    p.add_argument(
        "--report-to",
        choices=["wandb", "wandb-offline"],
        default=None,
        help="also log metrics.jsonl's records to Weights & Biases (pip install wandb); `wandb` is "
        "offline when no W&B credentials are found, `wandb-offline` always (docs/training.md)",
    )
    add_recipe_args(p)
    p.set_defaults(func=run_train)
    r = sub.add_parser(
        "recipes", help="list built-in recipes and the parts a recipe names, or print one fully resolved"
    )
    r.add_argument("name", nargs="?")
    r.add_argument(
        "--keys",
        action="store_true",
        help="print every recipe key with its type, default and help (Markdown)",
    )
    r.set_defaults(func=run_recipes)
