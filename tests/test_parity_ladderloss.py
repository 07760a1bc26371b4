"""Number-for-number parity of vsekit's ladder losses with the released code (cdluminate/ladderloss).

Fixtures: `reference_fixture_dir("ladderloss")` (README section "ladderloss"). Every config `<c>` with a
`loss_<c>` output is recomputed from the fixture's `sims` / `relevance` (and from `xs`, `vs` through
`sims = xs @ vs.T`) with the option values written in `meta.json/loss_configs`, through vsekit's public
API: `reference_ladder_loss` and a `LadderLoss` built from a `LossConfig` (the recipe path). Loss and the
gradients w.r.t. sims, xs and vs are compared at atol = rtol = 1e-5 (the same float32 hinge sums in other
orders / on other CPU kernels: at most log2(terms) eps relative; measured identical). Nothing is hard-coded: batch, width
and options come from the fixture files, so a held-out set runs unchanged.
"""

from __future__ import annotations

import ast
import json
import operator
import re

import numpy as np
import pytest
import torch

from conftest import reference_fixture_dir
from vsekit.config import LossConfig
from vsekit.losses import create_loss
from vsekit.losses.ladder import reference_ladder_loss

ITEM = "ladderloss"
TOL = {"atol": 1e-5, "rtol": 1e-5}
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


class Unmappable(ValueError):
    """A released config whose options this test cannot express with vsekit's functions."""


# ------------------------------------------------------------------------------ fixture discovery


def fixture_folder_or_none():
    try:
        return reference_fixture_dir(ITEM)
    except pytest.skip.Exception:
        return None


def discovered_configs() -> list[str]:
    """Config names from the `loss_<c>` keys of outputs.npz; one placeholder when the fixtures are absent
    (its test then skips with the helper's message)."""
    folder = fixture_folder_or_none()
    if folder is None:
        return ["<no-fixtures>"]
    with np.load(folder / "outputs.npz") as f:
        keys = f.files
    losses = [k for k in keys if k.startswith("loss_") and not k.startswith("loss_from_sims_")]
    return sorted(k.removeprefix("loss_") for k in losses)


def load() -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict]:
    folder = reference_fixture_dir(ITEM)
    with np.load(folder / "inputs.npz") as f:
        inputs = {k: f[k] for k in f.files}
    with np.load(folder / "outputs.npz") as f:
        outputs = {k: f[k] for k in f.files}
    return inputs, outputs, json.loads((folder / "meta.json").read_text())


# ------------------------------------------------------------------ meta.json config -> options


def _literal(node: ast.AST):
    """Numbers, booleans, lists and + - * / of them (`betas=[1/4]`); anything else is not an option value."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, bool)):
        return node.value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _literal(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_literal(node.left), _literal(node.right))
    raise Unmappable(f"not a literal option value: {ast.unparse(node)}")


def parse_config(text: str) -> tuple[str, dict, str]:
    """`Class(key=value, ...)  # comment` -> (class name, literal keyword options, comment). Keywords whose
    value is a name (`reldeg=R`, the relevance source) are kept as the string of that name."""
    code, _, comment = text.partition("#")
    call = ast.parse(code.strip(), mode="eval").body
    if not isinstance(call, ast.Call) or call.args:
        raise Unmappable(f"not a keyword-only constructor call: {text!r}")
    name = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", "?")
    opts = {kw.arg: getattr(kw.value, "id", None) or _literal(kw.value) for kw in call.keywords}
    return name, opts, comment


def _margins(opts: dict, comment: str) -> list[float]:
    """`margins=[...]`; a bare `LadderLoss()` (pwl) states its one margin only in the comment."""
    if "margins" in opts:
        return [float(m) for m in opts["margins"]]
    found = re.search(r"margin\s*=?\s*([0-9]*\.?[0-9]+)", comment)
    if found is None:
        raise Unmappable("no margins given and none stated in the comment")
    return [float(found.group(1))]


def released_options(text: str) -> dict:
    """meta.json/loss_configs[c] -> keyword arguments of `reference_ladder_loss` (less sims, relevance)."""
    name, opts, comment = parse_config(text)
    out = {"margins": _margins(opts, comment), "cumulative": bool(opts.get("cumulative", False))}
    if "reldeg" not in opts:  # no relevance: rung 0 (VSE++) alone
        return out
    out["betas"] = [float(b) for b in opts["betas"]]
    if name == "LadderLoss":
        out["thresholds"] = [float(t) for t in opts["thresholds"]]
    elif name == "AutoThreshLadderLoss":
        if len(opts["percentiles"]) != 1:  # the README defines the labelling for one percentile only
            raise Unmappable(f"{len(opts['percentiles'])} percentiles")
        out["percentile"] = float(opts["percentiles"][0])
    else:
        raise Unmappable(f"released class {name} has no vsekit counterpart here")
    unknown = set(opts) - {"margins", "betas", "thresholds", "percentiles", "cumulative", "reldeg"}
    if unknown:
        raise Unmappable(f"unhandled options {sorted(unknown)}")
    return out


def options_for(config: str, meta: dict) -> dict:
    text = meta.get("loss_configs", {}).get(config)
    if text is None:
        pytest.skip(f"config {config!r} has outputs but no entry in meta.json/loss_configs")
    try:
        return released_options(text)
    except Unmappable as e:
        pytest.skip(f"config {config!r} ({text}) cannot be mapped: {e}")


def recipe_loss(opts: dict):
    """The same options as a LossConfig (what a recipe would set), through `create_loss`."""
    cfg = LossConfig(
        name="ladder",
        margin=opts["margins"][0],
        ladder_margins=opts["margins"],
        ladder_weights=[1.0, *opts.get("betas", [])],
        ladder_thresholds=opts.get("thresholds", []),
        ladder_cumulative=opts["cumulative"],
        ladder_percentile=opts.get("percentile"),
        ladder_variant="reference",
        max_violation=True,
    )
    return create_loss(cfg)


# ----------------------------------------------------------------------------------------- checks


def close(actual: torch.Tensor, expected: np.ndarray, what: str) -> float:
    actual = actual.detach()
    expected_t = torch.as_tensor(expected).reshape(actual.shape).to(actual.dtype)
    torch.testing.assert_close(actual, expected_t, **TOL, msg=lambda m: f"{what}: {m}")
    return float((actual - expected_t).abs().max())


def check(loss_of_sims, config: str, inputs: dict, outputs: dict) -> float:
    """Loss + grad w.r.t. sims (on the given sims) and + grads w.r.t. xs, vs (on xs @ vs.T); max abs error."""
    sims = torch.tensor(inputs["sims"]).requires_grad_(True)
    loss = loss_of_sims(sims)
    errs = [
        close(loss, outputs[f"loss_from_sims_{config}"], f"loss_from_sims_{config}"),
        close(loss, outputs[f"loss_{config}"], f"loss_{config}"),
    ]
    loss.backward()
    errs.append(close(sims.grad, outputs[f"grad_sims_{config}"], f"grad_sims_{config}"))
    xs = torch.tensor(inputs["xs"]).requires_grad_(True)
    vs = torch.tensor(inputs["vs"]).requires_grad_(True)
    loss = loss_of_sims(xs @ vs.T)
    errs.append(close(loss, outputs[f"loss_{config}"], f"loss_{config} (xs, vs)"))
    loss.backward()
    errs.append(close(xs.grad, outputs[f"grad_xs_{config}"], f"grad_xs_{config}"))
    errs.append(close(vs.grad, outputs[f"grad_vs_{config}"], f"grad_vs_{config}"))
    return max(errs)


CONFIGS = discovered_configs()


def test_fixture_sims_are_xs_vs():
    inputs, outputs, _ = load()
    close(torch.tensor(inputs["xs"]) @ torch.tensor(inputs["vs"]).T, inputs["sims"], "xs @ vs.T")
    assert CONFIGS and all(f"grad_sims_{c}" in outputs for c in CONFIGS)


@pytest.mark.parametrize("config", CONFIGS)
def test_reference_ladder_loss_matches_released(config):
    inputs, outputs, meta = load()
    opts = options_for(config, meta)
    relevance = torch.tensor(inputs["relevance"])
    err = check(lambda s: reference_ladder_loss(s, relevance, **opts), config, inputs, outputs)
    print(f"{config}: max abs error {err:.3g}")


@pytest.mark.parametrize("config", CONFIGS)
def test_recipe_ladder_loss_matches_released(config):
    """`LadderLoss(variant="reference")` from a LossConfig; it shares one set of levels between both
    directions, which is the released computation when the relevance is symmetric (README: it is)."""
    inputs, outputs, meta = load()
    opts = options_for(config, meta)
    relevance = torch.tensor(inputs["relevance"])
    if not torch.equal(relevance, relevance.T):
        pytest.skip("relevance not symmetric: only reference_ladder_loss reads columns from its transpose")
    loss_fn = recipe_loss(opts)
    err = check(lambda s: loss_fn(s, relevance=relevance)[0], config, inputs, outputs)
    print(f"{config}: max abs error {err:.3g}")


def test_percentile_matches_numpy():
    """The per-row threshold of the auto-threshold ladder is numpy's linear-interpolation percentile.

    Exact: a sort and numpy's own two-op interpolation formula, elementwise IEEE float32 ops (no reduction)."""
    from vsekit.losses.ladder import row_percentile

    inputs, _, _ = load()
    rel = inputs["relevance"]
    g = np.random.default_rng(0)
    rows = np.concatenate([rel, g.random((5, rel.shape[1]), dtype=np.float32)])
    for q in (0, 12.5, 50, 85, 99.9, 100):
        expected = np.percentile(rows, q, axis=1)
        assert np.array_equal(row_percentile(torch.tensor(rows), q).numpy(), expected.astype(np.float32)), q


def test_bad_percentile_is_a_clear_error():
    from vsekit.config import load_recipe

    assert create_loss(load_recipe("cvsepp", ["loss.ladder_percentile=85"]).loss).percentile == 85.0
    bad_overrides = (("cvsepp", "loss.ladder_percentile=150"), ("cvsepp_auto", "loss.ladder_percentile=85"))
    for recipe, bad in bad_overrides:
        with pytest.raises(ValueError, match="ladder_percentile"):
            create_loss(load_recipe(recipe, [bad]).loss)
