"""`troupe plan SCRIPT.py -n W --link 1gbit`: profile a script's model, print every candidate, pick one.

This module owns the command's work (cli.py owns its flags): importing the script without
running its main, finding its model and input shape, and printing the table or JSON lines.
Bad input raises ValueError; `main` turns it into exit code 2 and one line.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import sys
from collections.abc import Sequence
from types import ModuleType

import torch
from torch import nn

from troupe.partition.planner.link import Link, link_from_text
from troupe.partition.planner.profile import ModelProfile, profile_model
from troupe.partition.planner.search import (EXACT_OPTIONS, PICK_FROM, REGIMES, SHARD, Candidate, candidates,
                                             divisors, pick)


def main(args: argparse.Namespace) -> int:
    """Run `troupe plan`; 0 on success, 2 (one line on stderr) on bad input."""
    try:
        return _plan(args)
    except (ValueError, TypeError) as e:
        print(f"troupe plan: {e}", file=sys.stderr)
        return 2


def positive(text: str, flag: str) -> int:
    """`text` as an int >= 1, else a ValueError naming the flag and the text."""
    try:
        value = int(text)
    except (TypeError, ValueError):
        value = 0
    if value < 1:
        raise ValueError(f"{flag} must be a positive integer, got {text!r}")
    return value


def _group_sizes(world: int, given: Sequence[str] | None) -> list[int]:
    if not given:
        return divisors(world)
    ks = sorted({positive(k, "--workers-per-group") for k in given})
    for k in ks:
        if world % k:
            raise ValueError(f"--workers-per-group {k} does not divide -n {world} (divisors: {divisors(world)})")
    return ks


def _plan(args: argparse.Namespace) -> int:
    world = positive(args.nproc, "-n")
    ks = _group_sizes(world, args.workers_per_group)
    batch = positive(args.batch, "--batch")
    bad = [o for o in args.options if o not in REGIMES]
    if bad:
        raise ValueError(f"--options: unknown option(s) {bad} (known: {list(REGIMES)})")
    ranks = [positive(r, "--powersgd-ranks") for r in args.powersgd_ranks]
    sync_freqs = [positive(h, "--sync-freqs") for h in args.sync_freqs]
    link = link_from_text(args.link)  # before the script: a typo should not wait for profiling
    budget = parse_bytes(args.memory_per_rank)
    module = load_script(args.script)
    model = find_model(module, args.model)
    shape = input_shape(module, args.input, args.script)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    sample = torch.randn((batch, *shape), dtype=dtype)
    profile = profile_model(model, sample, ks, reps=positive(args.reps, "--reps"), threads=args.threads)
    cands = candidates(profile, world, link, workers_per_group=ks, options=args.options, powersgd_ranks=ranks,
                       sync_freqs=sync_freqs, pseudo_grad_dtype=args.pseudo_grad_dtype,
                       fragments=positive(args.fragments, "--fragments"), delay=args.delay, spars=args.spars,
                       overlap=args.overlap,
                       optimizer_slots=args.optimizer_slots, memory=budget)
    chosen = pick(cands, PICK_FROM[args.pick_from], budget)
    if args.json:
        print_json(profile, world, link, cands, chosen, budget)
    else:
        print(render_table(profile, world, link, cands, chosen, args.script, budget))
    return 0


UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
         "tib": 2**40}


def parse_bytes(text: str | None, flag: str = "--memory-per-rank") -> float | None:
    """``2GiB``, ``1500MiB``, ``2e9`` (bytes) as a number of bytes; None stays None."""
    if text is None:
        return None
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in UNITS or float(m.group(1)) <= 0:
        raise ValueError(f"{flag} must be a positive size such as 2GiB, 1500MiB or 2e9 (bytes), got {text!r}")
    return float(m.group(1)) * UNITS[unit]


def load_script(path: str) -> ModuleType:
    """Import the script as a module (not as __main__, so its main does not run)."""
    if not os.path.isfile(path):
        raise ValueError(f"script not found: {path}")
    name = "_troupe_plan_" + re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0])
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"cannot import {path} as a Python module")
    module = importlib.util.module_from_spec(spec)
    folder = os.path.dirname(os.path.abspath(path))
    sys.modules[name] = module  # dataclasses and pickling look the module up by name
    sys.path.insert(0, folder)  # the script's own imports of its neighbours
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as e:  # the script's own failure, reported as one line
        del sys.modules[name]
        raise ValueError(f"importing {path} failed: {type(e).__name__}: {e}") from e
    finally:
        sys.path.remove(folder)
    return module


def _module_classes(module: ModuleType) -> list[str]:
    return [n for n, v in vars(module).items()
            if isinstance(v, type) and issubclass(v, nn.Module) and v.__module__ == module.__name__]


def find_model(module: ModuleType, name: str | None) -> nn.Module:
    """`--model NAME` (a class or zero-argument function in the script), else its one nn.Module class."""
    where = module.__file__
    classes = _module_classes(module)
    if name is None:
        if len(classes) != 1:
            what = f"defines {len(classes)} nn.Module classes ({', '.join(classes)})" if classes else \
                "defines no nn.Module class"
            raise ValueError(f"{where} {what}: choose one with --model NAME")
        name = classes[0]
    factory = getattr(module, name, None)
    if not callable(factory):
        raise ValueError(f"--model {name!r}: {where} has no class or function of that name "
                         f"(nn.Module classes there: {classes or 'none'})")
    try:
        model = factory()
    except Exception as e:
        raise ValueError(f"building the model with {name}() failed: {type(e).__name__}: {e} "
                         "(--model takes a class or function that needs no arguments)") from e
    if not isinstance(model, nn.Module):
        raise ValueError(f"--model {name!r}: {name}() returned {type(model).__name__}, not an nn.Module")
    return model


def input_shape(module: ModuleType, text: str | None, script: str) -> tuple[int, ...]:
    """One sample's shape (no batch dim) from `--input 1,28,28`, else the script's INPUT_SHAPE."""
    if text is None:
        shape = getattr(module, "INPUT_SHAPE", None)
        if shape is None:
            raise ValueError(f"no input shape: pass --input C,H,W (one sample, no batch dim) or set INPUT_SHAPE "
                             f"in {script}")
        text, source = ",".join(str(d) for d in shape), "INPUT_SHAPE"
    else:
        source = "--input"
    try:
        dims = tuple(int(d) for d in text.split(","))
    except ValueError:
        dims = ()
    if not dims or min(dims) < 1:
        raise ValueError(f"{source} must be positive integers separated by commas (e.g. 1,28,28), got {text!r}")
    return dims


def _header(profile: ModelProfile, world: int, link: Link) -> list[str]:
    lines = [f"{profile.model}: {world} workers, {profile.batch} samples per worker, link {link.describe()}",
             f"dims: partition_dim of {', '.join(profile.names) or 'no layer'} "
             "(0 batch, 1 output features, -1 worker 0)"]
    if profile.unused:
        lines.append(f"never called by forward (planned dim 0): {', '.join(profile.unused)}")
    return lines


def render_table(profile: ModelProfile, world: int, link: Link, cands: Sequence[Candidate], chosen: Candidate,
                 script: str = "", budget: float | None = None) -> str:
    """The candidates as a text table, fastest first, then the pick; with a `budget` (bytes of model state
    per worker) the ones that do not fit are marked."""
    lines = _header(profile, world, link)
    if budget is not None:
        lines.append(f"memory budget: {budget / 2**20:,.1f} MiB of model state per worker (parameters, gradients, "
                     f"optimizer state)")
    width = max(len("candidate"), *(len(c.name) for c in cands))
    dwidth = max(len("dims"), *(len(c.dims_text()) for c in cands))
    lines.append(f"{'candidate':<{width}}  {'k':>2}  {'dims':<{dwidth}}  {'option':<16}  {'sync SGD':<8}  "
                 f"{'ms/step':>9}  {'MB/step/worker':>14}  {'param MB/worker':>15}  {'state MB/worker':>15}"
                 + ("  fits" if budget is not None else ""))
    for c in cands:
        fits = "" if budget is None else ("  yes" if c.state_bytes <= budget else "  no")
        lines.append(f"{c.name:<{width}}  {c.workers_per_group:>2}  {c.dims_text():<{dwidth}}  {c.option:<16}  "
                     f"{c.sync_sgd:<8}  {c.seconds * 1e3:>9.2f}  {c.cost.bytes / 1e6:>14.3f}  "
                     f"{c.param_bytes / 1e6:>15.3f}  {c.state_bytes / 1e6:>15.3f}{fits}")
    lines.append("sync SGD: exact = the update of synchronous SGD; approx = synchronous SGD on compressed "
                 "gradients; no = not equivalent to synchronous SGD (local steps, then an outer optimizer)")
    lines.append(f"picked: {describe_pick(chosen)}")
    fastest = min((c for c in cands if budget is None or c.state_bytes <= budget), key=lambda c: c.seconds)
    if fastest.regime not in EXACT_OPTIONS and fastest is not chosen:
        lines.append(f"faster with an option that changes the update ({fastest.option}, sync SGD "
                     f"{fastest.sync_sgd}): {describe_pick(fastest)}")
    return "\n".join(lines)


def describe_pick(c: Candidate) -> str:
    """One line: the candidate, how to ask troupe for it, and its predicted step."""
    if c.worker_groups is not None:  # DiLoCo: a cluster framework, set on `troupe run`
        how = (f"--framework diloco --nworker-groups {c.worker_groups} --sync-freq {c.option.split(':')[1]}"
               f"{c.run_flags}")
    elif c.regime == SHARD and any(c.dims):  # a partition plan with a sharded DistOpt
        dims = " ".join(f"{name}:{d}" for name, d in c.plan.items())
        how = f"workers_per_group={c.workers_per_group}, dims {dims}, troupe run{c.run_flags}"
    elif c.regime == SHARD:
        how = f"troupe run{c.run_flags}"
    else:
        dims = " ".join(f"{name}:{d}" for name, d in c.plan.items()) or "-"
        how = f"workers_per_group={c.workers_per_group}, dims {dims}, option {c.option}"
    return f"{c.name} ({how}): {c.seconds * 1e3:.2f} ms/step predicted"


def print_json(profile: ModelProfile, world: int, link: Link, cands: Sequence[Candidate], chosen: Candidate,
               budget: float | None = None) -> None:
    """JSON lines: the setup, one line per candidate (fastest first), then the pick."""
    print(json.dumps({"model": profile.model, "world_size": world, "batch": profile.batch,
                      "link": {"name": link.name, "alpha_s": link.alpha, "beta_s_per_byte": link.beta},
                      "layers": list(profile.names), "unused": list(profile.unused), "memory_per_rank": budget}))
    for c in cands:
        print(json.dumps({**c.to_json(), "fits": None if budget is None else c.state_bytes <= budget}))
    print(json.dumps({"picked": chosen.to_json()}))
