"""The `flash` command: a few verbs, each one function.

    flash run RECIPE [key=value ...]       train (RECIPE: a name from `flash ls`, or a YAML path)
    flash run resume=RUN_DIR [key=value ...]  continue a stopped run with its own settings
    flash validate RECIPE [key=value ...]  check a recipe and overrides without running
    flash ls                               recipes with one-line descriptions
    flash losses                           registered losses and advantage estimators, with knobs
    flash sweep RECIPE key=v1,v2 ...       run a grid of overrides, tabulate, plot, recommend a setting
    flash plot RUN_DIR... [-o FILE]        reward, accuracy, throughput, staleness, role timeline
    flash plan RUN_DIR... [key=v1,v2 ...]  predict seconds per step of other settings from a run
    flash replay RUN_DIR                   re-train a run from its schedule record, step for step
    flash data RECIPE [key=value ...]      the prompts as the engine sees them, lengths, bad rows
    flash data export TASK -o FILE         write a built-in task's items as a dataset file

Errors a user can fix (unknown key, bad value, missing recipe) print one line and exit 2. A reader
that closes stdout early (``flash validate R | head -1``) ends the command quietly with status 141
(128 + SIGPIPE, what the shell reports for any producer a closed pipe stops, e.g. ``yes | head -1``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from flash.errors import FlashError

# Before torch loads OpenMP: spinning waits collapse throughput on a shared or loaded machine
# (see flash.cluster.PERF_ENV); the SFT warm start runs in this process.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from flash.app.recipe_files import recipe_paths, resolve_recipe  # noqa: E402


def cmd_ls(_: argparse.Namespace) -> int:
    from omegaconf import OmegaConf

    rows = [(name, str(OmegaConf.load(path).get("description", ""))) for name, path in recipe_paths().items()]
    width = max((len(n) for n, _ in rows), default=0)
    for name, desc in rows:
        print(f"{name:<{width}}  {desc}")
    return 0


def recipe_and_overrides(args: argparse.Namespace) -> tuple[Path, list[str], str]:
    """The recipe's path, the overrides and the recipe as named. ``flash run resume=DIR`` alone
    names no recipe: the run dir's ``config.yaml`` is it (every setting the run started with)."""
    key, eq, value = args.recipe.partition("=")
    if not eq:
        return resolve_recipe(args.recipe), list(args.overrides), args.recipe
    if key.strip() != "resume" or value.strip() in ("", "latest"):
        raise FlashError(
            f"'{args.recipe}' is not a recipe: name one first (`flash ls`), e.g. flash "
            f"{args.verb} stutter {args.recipe}; only resume=RUN_DIR may stand alone"
        )
    from flash.app.resume_dir import resolve_resume

    run_dir = resolve_resume(value.strip(), "")
    return run_dir / "config.yaml", [args.recipe, *args.overrides], ""


def cmd_validate(args: argparse.Namespace) -> int:
    from flash.app.config import load_config
    from flash.app.preflight import preflight

    path, overrides, _ = recipe_and_overrides(args)
    cfg = load_config(path, overrides)
    checked = preflight(cfg, path.stem)  # the checks `flash run` makes before it starts (flash.app.preflight)
    print(f"ok: {path} (async_ratio={cfg.async_ratio}, loss={cfg.algo.loss['name']}, steps={cfg.train.steps})")
    from flash.app.config import base_differences

    changed = base_differences(path, cfg, overrides)
    if changed:
        print(f"differs from its base in {len(changed)} settings:")
        for line in changed:
            print(f"  {line}")
    from flash.app.data_preview import recipe_warnings

    for line in recipe_warnings(cfg, checked.task):  # what no check refuses but wastes the run
        print(f"warning: {line}")
    for line in checked.memory:  # each GPU role's estimated peak (flash.app.memory_fit)
        print(f"memory: {line}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from flash.app.config import load_config
    from flash.app.runner import run

    path, overrides, named = recipe_and_overrides(args)
    cfg = load_config(path, overrides)
    summary = run(cfg, recipe_name=path.stem, recipe_arg=named)
    best = summary.get("eval_best_step")
    best = f" (best {summary['eval_accuracy_best']:.3f} at step {best})" if best not in (None, summary["steps"]) else ""
    print(
        f"flash: accuracy {summary['eval_accuracy_initial']:.3f} -> {summary['eval_accuracy_final']:.3f}{best} "
        f"in {summary['steps']} steps, {summary['wall_seconds']:.0f}s; summary: "
        f"{summary['run_dir']}/summary.json"
    )
    return 0


def cmd_losses(_: argparse.Namespace) -> int:
    from flash import algos

    sections = (
        ("losses", algos.describe_losses()),
        ("corrections (algo.corrections; weight and mask by pi_prox/pi_behav)", algos.describe_corrections()),
        ("advantage estimators", algos.describe_advantages()),
    )
    for title, rows in sections:
        print(f"{title}:")
        for row in rows:
            knobs = ", ".join(f"{k}={v!r}" for k, v in row["knobs"].items()) or "-"
            print(f"  {row['name']:<16} {row['description']}")
            if "reads" in row:
                print(f"  {'':<16} reads: {_reads_line(row)}")
            print(f"  {'':<16} knobs: {knobs}")
    return 0


def _reads_line(row: dict) -> str:
    """``behav, current (ratios: current/behav)``; ``undeclared`` for a plugin that says nothing."""
    if row["reads"] is None:
        return "undeclared"
    ratios = row.get("ratios")
    return ", ".join(row["reads"]) + (
        f" (ratios: {', '.join(ratios)})" if ratios else " (no ratio)" if ratios == [] else ""
    )


def cmd_sweep(args: argparse.Namespace) -> int:
    from flash.app.sweep import sweep

    points, _ = sweep(
        args.recipe, args.grid, out=args.out, tolerance=args.tolerance, parallel=args.parallel, repeats=args.repeats
    )
    return 0 if all(p.row.get("status") == "ok" for p in points) else 1


def cmd_plot(args: argparse.Namespace) -> int:
    from flash.app.plot import main as plot_main

    plot_main(args.run_dirs, args.output, args.steps)
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from flash.app.plan import DEFAULT_P, plan

    runs = [a for a in args.args if "=" not in a]  # run dirs (repeats of one setting), then key=v1,v2
    if not runs:
        raise FlashError("flash plan needs a run dir (a finished `flash run`) before the key=v1,v2 candidates")
    from flash.app.plan_sim import is_sim_run, plan_sim

    if is_sim_run(runs[0]):  # simulated GPU roles: scales in simulated seconds, no thread terms
        if len(runs) > 1 or args.calibrate or args.p_engine is not None or args.p_trainer is not None:
            raise FlashError("flash plan on a simulated run takes one run dir and no --calibrate/--p-* (no threads)")
        plan_sim(runs[0], [a for a in args.args if "=" in a])
        return 0
    p = {
        "engine": DEFAULT_P["engine"] if args.p_engine is None else args.p_engine,
        "trainer": DEFAULT_P["trainer"] if args.p_trainer is None else args.p_trainer,
    }
    plan(runs, [a for a in args.args if "=" in a], p=p, calibrate=args.calibrate)
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    from flash.app.replay import describe, replay

    summary = replay(args.run_dir, steps=args.steps, out=args.out)
    print(describe(summary))
    return 0 if summary["first_mismatch"] is None else 1


def cmd_data(args: argparse.Namespace) -> int:
    from flash.app.data_preview import export_task, preview

    if args.args[0] != "export":
        from flash.app.config import load_config

        preview(load_config(resolve_recipe(args.args[0]), args.args[1:]), rows=args.rows)
        return 0
    if len(args.args) < 2 or not args.output:
        raise FlashError(
            "usage: flash data export TASK [option=value ...] -o FILE (a .jsonl, .csv, .parquet or a directory)"
        )
    options = {}
    for pair in args.args[2:]:
        key, sep, value = pair.partition("=")
        if not sep:
            raise FlashError(f"task options are key=value, got {pair!r}")
        import yaml

        options[key] = yaml.safe_load(value)
    try:
        n = export_task(args.args[1], options, args.output, args.rows, args.split)
    except (ValueError, TypeError) as exc:
        raise FlashError(f"task {args.args[1]!r}: {exc}") from None
    except OSError as exc:  # a folder that does not exist, no permission, a full disk
        raise FlashError(
            f"-o {args.output}: cannot write it: {exc.strerror or exc}{f' ({exc.filename})' if exc.filename else ''}"
        ) from None
    print(f"flash: wrote {n} {args.split} rows of {args.args[1]} to {args.output}")
    return 0


def _positive_int(text: str) -> int:
    """A count argument (``--rows``, ``--steps``): 0 or a negative number would silently write or
    replay nothing, or (a negative slice) all but the last few."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {value}")
    return value


def _add_data(sub) -> None:
    p = sub.add_parser("data", help="preview a recipe's prompts, or export a built-in task as a file")
    p.add_argument("args", nargs="+", metavar="RECIPE [key=value ...] | export TASK [option=value ...]")
    p.add_argument("-o", "--output", help="export: the file to write (.jsonl, .csv, .parquet, or a directory)")
    p.add_argument("--rows", type=_positive_int, default=1000, help="rows to scan (preview) or write (export)")
    p.add_argument("--split", choices=("train", "eval"), default="train", help="export: which split")
    p.set_defaults(fn=cmd_data)


def _add_replay(sub) -> None:
    p = sub.add_parser("replay", help="re-train a run from its recorded schedule; exit 1 if a step's loss differs")
    p.add_argument("run_dir", help="the run dir of a `flash run` (it holds schedule.jsonl)")
    p.add_argument("--steps", type=_positive_int, help="replay the first N steps only")
    p.add_argument("--out", help="write one JSON line per step (recorded and replayed numbers) to this file")
    p.set_defaults(fn=cmd_replay)


def _add_plan(sub) -> None:
    p = sub.add_parser("plan", help="predict seconds per step of other settings from a finished run")
    p.add_argument(
        "args",
        nargs="+",
        metavar="RUN_DIR... key=v1,v2",
        help="a finished run dir (or repeats of one setting), then candidates, e.g. async_ratio=0,1,2 "
        "rollout.scheduler=plain,tail_batching rollout.tail_batching.threshold=24,p75; a simulated "
        "run (train.backend=sim) plans scales in simulated seconds: sim.rollout_gpus, sim.train_gpus, "
        "train.prompts_per_step, async_ratio",
    )
    p.add_argument(
        "--calibrate",
        metavar="RUN_DIR2",
        action="append",
        help="a run with another thread split "
        "(e.g. async beside a sync RUN_DIR; repeatable for repeats): its measured time sets how "
        "threads scale on this machine",
    )
    p.add_argument("--p-engine", type=float, help="engine's parallel fraction (Amdahl; default 0.35)")
    p.add_argument("--p-trainer", type=float, help="trainer's parallel fraction (Amdahl; default 0.35)")
    p.set_defaults(fn=cmd_plan)


def _add_sweep_plot(sub) -> None:
    p = sub.add_parser("sweep", help="run a grid of overrides and recommend a setting")
    p.add_argument("recipe", help="a name from `flash ls` or a path to a YAML recipe")
    p.add_argument("grid", nargs="*", help="key=v1,v2,... (swept) or key=value (fixed), e.g. async_ratio=0,1,2")
    p.add_argument("--out", help="sweep dir (default: sweeps/<recipe>-<hash of the arguments>, so a re-run resumes)")
    p.add_argument(
        "--tolerance",
        type=float,
        default=0.02,
        help="how far (absolute) below the synchronous setting's mean final accuracy a setting's "
        "may be, after one standard error against it",
    )
    p.add_argument("--parallel", type=int, default=1, help="runs side by side, sharing the cores (default 1)")
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run each setting N times (replicates, like a seed axis: reported as mean ± SE)",
    )
    p.set_defaults(fn=cmd_sweep)
    p = sub.add_parser("plot", help="plot one or more run dirs into a PNG")
    p.add_argument("run_dirs", nargs="+", help="run dirs (each holds metrics.jsonl)")
    p.add_argument("-o", "--output", default="flash-plot.png", help="PNG file to write")
    p.add_argument("--steps", help="timeline window A:B (train steps, inclusive); default: mid-run")
    p.set_defaults(fn=cmd_plot)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flash", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="verb", required=True)
    for verb, fn, help_ in (
        ("run", cmd_run, "train with a recipe"),
        ("validate", cmd_validate, "check a recipe without running"),
    ):
        p = sub.add_parser(verb, help=help_)
        p.add_argument(
            "recipe",
            help="a name from `flash ls` or a path to a YAML recipe (or resume=RUN_DIR "
            "alone: the run's recorded settings)",
        )
        p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. async_ratio=2")
        p.set_defaults(fn=fn)
    sub.add_parser("ls", help="list recipes").set_defaults(fn=cmd_ls)
    sub.add_parser("losses", help="list losses and advantage estimators").set_defaults(fn=cmd_losses)
    _add_sweep_plot(sub)
    _add_plan(sub)
    _add_replay(sub)
    _add_data(sub)
    return parser


def _reader_gone() -> int:
    """stdout's reader closed it: stdout points at devnull, so the interpreter's last flush writes
    nowhere instead of raising again; the status is the shell's for a SIGPIPE."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 141


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = args.fn(args)
        sys.stdout.flush()  # a closed pipe shows here, in this handler, not at interpreter exit
        return code
    except BrokenPipeError:
        return _reader_gone()
    except FlashError as exc:
        print(f"flash: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        print(f"flash: interrupted ({exc})" if str(exc) else "flash: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
