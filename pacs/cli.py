"""``pacs train | eval | plan | bench``: one entry point (also ``python -m pacs``).

Exit codes: 0 done (``pacs plan``: a lever set fits); 1 ``pacs plan``: nothing fits; 2 a setting, path or
file that cannot work (one line on stderr, before any work when it can be known then; also another process
using the run directory, a full disk mid-run); 3 training stopped by repeated non-finite updates; 130 Ctrl-C;
143 / 138 training stopped by SIGTERM / SIGUSR1 after checkpointing its step (pacs/run/stop_signals.py).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import sys

from pacs.config import (
    BUILTIN_TASK_SETTINGS,
    Config,
    apply_dict,
    closest_key,
    config_keys,
    known_keys,
    load_config,
    settings,
)
from pacs.model.model_dir import check_model_dir
from pacs.registry import OBJECTIVES, ROLLOUT_ENGINES
from pacs.run import RunDir, quiet_third_party, run_of_config_file

DEFAULTS = Config()


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML file (default: none, i.e. the values of configs/default.yaml)")
    parser.add_argument("--model", help="HF model directory or hub id ('embedded': the built-in tiny model) "
                                        f"(default: {DEFAULTS.model.path})")
    parser.add_argument("--output-dir", help=f"the run directory (pacs eval writes to OUTPUT_DIR/eval) "
                                             f"(default: {DEFAULTS.output_dir})")
    parser.add_argument("--seed", type=int, help=f"(default: {DEFAULTS.seed})")
    parser.add_argument("--rollout", metavar="{" + ",".join(ROLLOUT_ENGINES.names()) + ",MODULE:NAME}",
                        help="rollout engine (rollout.engine): vLLM if importable (auto), forced vLLM, HF generate, "
                             f"or your own as module:Name (pacs/registry.py) (default: {DEFAULTS.rollout.engine})")
    parser.add_argument("--verbose", action="store_true",
                        help="show third-party logs and progress bars (vLLM, transformers), hidden by default")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="config overrides with dotted keys, e.g. optim.lr=1e-4 rollout.group_size=8 "
                             "(every key and its default: below)")


def _key_list(command: str = "train") -> str:
    """Every setting a command reads, its default and its help (the config fields' own: pacs/config/)."""
    builtin = dict(config_keys(apply_dict(Config(), BUILTIN_TASK_SETTINGS)))
    lines = ["Every setting (KEY=VALUE overrides, or the same keys in a --config YAML file; precedence:",
             "defaults < --config < KEY=VALUE < named flags). Defaults (a real model's; where the built-in",
             "tasks embedded and wordmath differ, theirs in brackets, as in configs/default.yaml):", ""]
    keys = settings(Config)
    if command == "eval":  # (a run's config.yaml may hold training's too: they are read and ignored)
        lines[0] = ("The settings pacs eval reads (KEY=VALUE overrides, or the same keys in a --config YAML file; "
                    "precedence:")
        keys = [s for s in keys if s.read_by_eval]
    defaults = dict(config_keys())
    for advanced in (False, True):
        if advanced:
            lines += ["", "Advanced settings (for experts and tests; written under advanced:, e.g.",
                      "advanced.train.preflight=false or advanced: {train: {preflight: false}} in YAML):", ""]
        for s in keys:
            if s.advanced == advanced:
                value = defaults[s.key]
                lines.append(f"  {s.written} = {value}" + (f"  [{builtin[s.key]}]" if builtin[s.key] != value else ""))
                lines.append(f"      {s.help}")
    return "\n".join(lines)


def check_override_keys(assignments: list[str], command: str) -> None:
    """A KEY=VALUE whose key is unknown but close to a known one: a ValueError suggesting that one."""
    known = known_keys()
    for assignment in assignments:
        key = assignment.split("=", 1)[0].strip()
        if "=" in assignment and key and key not in known:
            close = closest_key(key)
            if close is not None:
                raise ValueError(f"unknown config key {key!r}; did you mean {close}? "
                                 f"(every key: pacs {command} --help)")


def build_config(args: argparse.Namespace) -> Config:
    from pacs.eval.presets import preset_overrides

    changes = list(getattr(args, "change", None) or [])
    data = getattr(args, "data", None)  # pacs eval --data: every row of this file is a problem to evaluate
    from_data = ["task.name=math", f"task.data_path={data}", f"task.eval_path={data}"] if data is not None else []
    # --data: every row (a config file's eval.num_problems, e.g. a run's 200, does not cut it; KEY=VALUE and
    # --num-problems do)
    every_row = ["eval.num_problems=1000000"] if data is not None else []
    check_override_keys(list(args.overrides) + changes, getattr(args, "command", "train"))
    cfg = load_config(args.config, preset_overrides(getattr(args, "preset", None)) + every_row + list(args.overrides)
                      + from_data + changes)
    if args.model is not None:
        cfg.model.path = args.model
    if args.output_dir is not None:
        cfg.output_dir = args.output_dir
    if args.seed is not None:
        cfg.seed = args.seed
    if args.rollout is not None:
        cfg.rollout.engine = args.rollout
    if getattr(args, "max_steps", None) is not None:
        cfg.max_steps = args.max_steps
    if getattr(args, "algo", None) is not None:
        cfg.optim.algo = args.algo
    if getattr(args, "resume", False):
        cfg.resume = True
        own = run_of_config_file(args.config)
        named = args.output_dir is not None or any(a.split("=", 1)[0].strip() == "output_dir" for a in args.overrides)
        if own is not None and not named and os.path.abspath(cfg.output_dir) != own:
            # its recorded output_dir is relative to where the run started, or the run was moved since
            if _is_main_rank():
                print(f"[resume] --config {args.config} is the run in {own}: resuming it there (its recorded "
                      f"output_dir {cfg.output_dir!r} is {os.path.abspath(cfg.output_dir)} from here; "
                      "--output-dir chooses another)", flush=True)
            cfg.output_dir = own
    if getattr(args, "overwrite", False):
        cfg.overwrite = True
    check_model_dir(cfg.model.path)
    return cfg


def changed_keys(assignments: list[str], *, resume: bool) -> tuple[str, ...]:
    """The dotted keys of ``--change KEY=VALUE`` arguments (checked: they go with --resume)."""
    if assignments and not resume:
        raise ValueError("--change names the settings a resumed run changes: it goes with --resume")
    for assignment in assignments:
        if "=" not in assignment or not assignment.split("=", 1)[0].strip():
            raise ValueError(f"--change must look like KEY=VALUE (e.g. --change optim.lr=1e-5), got {assignment!r}")
    return tuple(assignment.split("=", 1)[0].strip() for assignment in assignments)


def _is_main_rank() -> bool:
    return os.environ.get("RANK", "0") == "0"


def cmd_train(args: argparse.Namespace) -> int:
    from pacs.model.policy import close_distributed
    from pacs.run import NoSpaceLeft, TrainingInterrupted, TrainingPreempted, TrainingStopped, resume_hint
    from pacs.train import train

    cfg = build_config(args)
    change = changed_keys(args.change or [], resume=cfg.resume)
    try:
        train(cfg, change)
        close_distributed()  # under torchrun: every rank leaves the process group together
    except KeyboardInterrupt:  # outside the training loop (warm-up, model loading, export)
        if _is_main_rank():
            print(f"pacs train: interrupted; {resume_hint(cfg.output_dir)}", file=sys.stderr)
        return 130
    except TrainingStopped as exc:
        if _is_main_rank():
            print(f"pacs train: stopped: {exc}", file=sys.stderr)
        return 3
    except NoSpaceLeft as exc:  # a full disk mid-run: one line, and how to continue once space is freed
        if _is_main_rank():
            print(f"pacs train: error: {exc}; {resume_hint(cfg.output_dir)}", file=sys.stderr)
        return 2
    except TrainingInterrupted as exc:
        if _is_main_rank():
            print(f"pacs train: {exc}", file=sys.stderr)
        # the shell's code for a process ended by that signal (SIGTERM: 143; Ctrl-C: 130), which schedulers
        # read as "stopped by the signal", not as a failed job
        return 128 + getattr(signal, exc.signal_name) if isinstance(exc, TrainingPreempted) else 130
    return 0


# pacs eval generates this many sequences (problems x samples) per call, journaling each chunk
EVAL_CHUNK_SEQUENCES = 1024


def cmd_eval(args: argparse.Namespace) -> int:
    import torch

    from pacs.eval.evaluate import run_eval
    from pacs.eval.journal import EvalJournal, model_files, problems_digest
    from pacs.eval.outputs import write_eval_outputs
    from pacs.rollout import make_rollout_engine
    from pacs.run import (
        Terminated,
        apply_torch_threads,
        check_config,
        engine_options,
        lock_run_directory,
        prepare_run,
        sigterm_raises,
    )

    if args.data is not None and not args.data.startswith("hf:") and not os.path.isfile(args.data):
        raise ValueError(f"--data: no such file {args.data!r}")
    cfg = build_config(args)
    if args.preset is not None and cfg.task.name == "math" and not cfg.task.data_path:
        raise ValueError(f"--preset {args.preset} evaluates a data file: add --data FILE (.jsonl or .parquet)")
    if args.n_samples is not None:
        cfg.eval.n_samples = args.n_samples
        if not args.k:  # a preset's ks may exceed the new n: keep those that fit
            cfg.eval.ks = tuple(k for k in cfg.eval.ks if k <= args.n_samples) or (1,)
    if args.temperature is not None:
        cfg.eval.temperature = args.temperature
    if args.top_p is not None:
        cfg.eval.top_p = args.top_p
    if args.k:
        cfg.eval.ks = tuple(args.k)
        for k in args.k:
            if k > cfg.eval.n_samples:
                raise ValueError(f"--k {k} is more than the samples per problem ({cfg.eval.n_samples}): pass@k "
                                 f"needs k <= --n-samples (e.g. --n-samples {k})")
    if args.num_problems is not None:
        cfg.eval.num_problems = args.num_problems
    # one process, no training: a run's multi-process training settings (its config.yaml) do not apply
    cfg.train.sequence_parallel_size, cfg.train.fsdp_cpu_offload = 1, False
    check_config(cfg)
    out_dir = args.eval_dir or RunDir(cfg.output_dir).eval
    apply_torch_threads(cfg, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    run = prepare_run(cfg, log=lambda *_: None)  # its refusals before anything is written to the eval directory
    lock_run_directory(out_dir, "--eval-dir")  # one evaluation per eval directory (its journal)
    engine = make_rollout_engine(**engine_options(cfg, run.model_dir, cfg.seed, log=lambda *_: None))
    r, e = cfg.rollout, cfg.eval
    model_dir = run.model_dir
    info = {"model": model_dir, "data": cfg.task.data_path if cfg.task.name == "math" else cfg.task.name,
            "preset": args.preset, "temperature": e.temperature, "top_p": e.top_p,
            "max_new_tokens": r.max_new_tokens, "seed": cfg.seed, "label": os.path.basename(model_dir.rstrip("/"))}
    problems = run.task.eval_problems(e.num_problems)
    sampling = dict(n_samples=e.n_samples, temperature=e.temperature, top_p=e.top_p, ks=e.ks,
                    max_new_tokens=r.max_new_tokens, seed=cfg.seed, template=cfg.task.prompt_template,
                    use_chat_template=cfg.task.use_chat_template, max_prompt_len=r.max_prompt_len,
                    chunk_problems=max(1, EVAL_CHUNK_SEQUENCES // e.n_samples))
    # an interrupted evaluation started again with the same settings generates only what it had not finished
    journal = EvalJournal(out_dir, {"model_files": model_files(model_dir), "engine": type(engine).__name__,
                                    "dtype": cfg.model.dtype, "problems": problems_digest(problems), **sampling},
                          say=lambda line: print(line, file=sys.stderr))
    try:
        with sigterm_raises():  # a scheduler's SIGTERM: say what is kept, like Ctrl-C
            report = run_eval(engine, run.task, run.tokenizer, problems, stop_token_ids=run.stop_ids,
                              journal=journal, progress=True, **sampling)
    except (KeyboardInterrupt, Terminated) as exc:
        what = "SIGTERM received" if isinstance(exc, Terminated) else "interrupted"
        print(f"pacs eval: {what} after {len(journal.done)} of {len(problems)} problems, which are kept in "
              f"{journal.path}: the same command again continues from there", file=sys.stderr)
        return 128 + signal.SIGTERM if isinstance(exc, Terminated) else 130
    finally:
        engine.close()
    paths = write_eval_outputs(report, out_dir, info=info, plot=cfg.plot)
    journal.finish()
    unscored = {key: int(report.metrics.get(f"reward_{key}", 0)) for key in ("timeouts", "errors")}
    if any(unscored.values()):
        print(f"pacs eval: {unscored['timeouts']} rewards timed out and {unscored['errors']} failed (math-verify "
              f"could not read the response or the reference answer) of {len(problems) * e.n_samples}; each "
              f"scored 0 (per problem: reward_timeouts, reward_errors in {paths['problems']})", file=sys.stderr)
    print(json.dumps({"model": model_dir, **report.metrics, **{f"{kind}_path": p for kind, p in paths.items()}}))
    return 0


# pacs plan's flags with a default: absent beside --preset, the preset's own values stand
PLAN_DEFAULTS = dict(gpus=1, prompt_len=1024, response_len=8192, group_size=8, prompts_per_step=32,
                     micro_batch_groups=1, lora_targets="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
                     compute_dtype="bfloat16", master_dtype="float32", gpu_memory_utilization=0.3)


def cmd_plan(args: argparse.Namespace) -> int:
    from pacs.train.memory_plan import PlanInputs, load_model_shape, plan_preset, preset_verdict, report

    given = {name: getattr(args, name) for name in ("model", "gpu_gib", "lora_rank", *PLAN_DEFAULTS)
             if getattr(args, name) is not None}
    if args.preset is not None:
        plan = plan_preset(args.preset, given)
        if given:  # applied over the preset, never ignored
            print("applied over the preset: " + " ".join(f"--{name.replace('_', '-')} {value}"
                                                         for name, value in given.items()) + "\n")
        print(plan.table())
        if plan.generation_peak:
            print(f"\ngeneration (rollout.engine=hf, KV cache included): {plan.generation_peak / 2**30:.2f} GiB")
        print(f"\n{args.preset}: {preset_verdict(plan)}")
        return 0 if plan.fits else 1
    if args.model is None or args.gpu_gib is None:
        raise ValueError("pacs plan needs --model and --gpu-gib (or --preset PRESET.yaml)")
    if args.lora_targets is not None and args.lora_rank is None:
        raise ValueError("--lora-targets needs --lora-rank (LoRA); without it pacs plan plans full fine-tuning")
    values = {**PLAN_DEFAULTS, **given}
    inputs = PlanInputs(model=load_model_shape(args.model), gpu_gib=args.gpu_gib, gpus=values["gpus"],
                        prompt_len=values["prompt_len"], response_len=values["response_len"],
                        group_size=values["group_size"], prompts_per_step=values["prompts_per_step"],
                        micro_batch_groups=values["micro_batch_groups"], lora_rank=args.lora_rank,
                        lora_targets=tuple(t.strip() for t in values["lora_targets"].split(",") if t.strip()),
                        compute_dtype=values["compute_dtype"], master_dtype=values["master_dtype"],
                        gpu_memory_utilization=values["gpu_memory_utilization"])
    text, fits = report(inputs)
    print(text)
    return 0 if fits else 1


def benchmarks_dir() -> str:
    """Where ``pacs bench`` looks for the benchmark harness: ``benchmarks/`` next to the ``pacs`` package,
    i.e. in a source checkout (the harness is not part of the installed distribution)."""
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


def _module_from_file(name: str, path: str, package_dir: str | None = None):
    """Module ``name`` executed from the file ``path`` (a package when ``package_dir`` is given), registered in
    ``sys.modules`` so that its own ``from benchmarks import ...`` lines find it."""
    spec = importlib.util.spec_from_file_location(
        name, path, submodule_search_locations=None if package_dir is None else [package_dir])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def load_benchmarks_run():
    """benchmarks/run.py from the source checkout, loaded by file path (the harness is no dependency of the
    ``pacs`` package); a ``RuntimeError`` saying why when it cannot be loaded."""
    where = benchmarks_dir()
    missing = [name for name in ("__init__.py", "run.py") if not os.path.isfile(os.path.join(where, name))]
    if missing:
        raise RuntimeError(f"pacs bench needs a source checkout (benchmarks/ not found next to the pacs package: "
                           f"{where}, missing {', '.join(missing)}); clone the repository and run it from there")
    loaded = sys.modules.get("benchmarks")
    if loaded is None:
        loaded = _module_from_file("benchmarks", os.path.join(where, "__init__.py"), where)
    found = os.path.dirname(os.path.abspath(getattr(loaded, "__file__", None) or ""))
    if os.path.realpath(found) != os.path.realpath(where):
        raise RuntimeError(f"pacs bench: the imported 'benchmarks' package is {found}, not this checkout's {where}; "
                           "uninstall the other one")
    checkout = os.path.dirname(where)
    if checkout not in sys.path:  # the harness imports pacs_kernels from the checkout too
        sys.path.insert(0, checkout)
    return sys.modules.get("benchmarks.run") or _module_from_file("benchmarks.run", os.path.join(where, "run.py"))


def cmd_bench(argv: list[str]) -> int:
    """Forward everything to :func:`benchmarks.run.main`, loaded from the source checkout."""
    try:
        run = load_benchmarks_run()
    except ImportError as exc:
        print(f"pacs bench: error: the benchmarks cannot be imported ({exc}); install pacs-rl[bench]", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        print(f"pacs bench: error: {exc}", file=sys.stderr)
        return 2
    result = run.main(argv)
    return int(result) if isinstance(result, int) else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pacs", description=__doc__.replace("``", ""),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser(
        "train", help="train with PACS (or GRPO, DAPO, Dr.GRPO, GSPO, CISPO, your own objective); default: the "
        "built-in embedded run",
        description="Train with PACS (or GRPO, DAPO, Dr.GRPO, GSPO, CISPO, or your own objective: --algo). With no "
                    "arguments: the built-in embedded run (configs/default.yaml).",
        epilog=_key_list(), formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_common(train)
    train.add_argument("--max-steps", type=int, help=f"rollout steps (default: {DEFAULTS.max_steps})")
    train.add_argument("--algo", metavar="{" + ",".join(OBJECTIVES.names()) + ",MODULE:CLASS}",
                       help="the objective (optim.algo): a built-in one, or your own as module:Class "
                            f"(docs/objectives.md) (default: {DEFAULTS.optim.algo})")
    train.add_argument("--resume", action="store_true",
                       help="continue the run in --output-dir from its newest verified checkpoint")
    train.add_argument("--change", action="append", metavar="KEY=VALUE",
                       help="with --resume: set a setting that changes what the run is (model, algorithm, objective, "
                            "group size, learning rate or schedule, data, seed), from the resumed step on; recorded "
                            "in OUTPUT_DIR/config_history.jsonl (repeatable). A resume with such a setting changed "
                            "otherwise is refused")
    train.add_argument("--overwrite", action="store_true",
                       help="--output-dir holds a run: move it aside (to OUTPUT_DIR.replaced-<time>) and start afresh")
    ev = sub.add_parser(
        "eval", help="held-out accuracy and pass@k of a model",
        description="Held-out accuracy and pass@k of a model (--model: a run's final_model, a Hugging Face directory "
                    "or hub id): --n-samples responses to each held-out problem of the task, or to every row of "
                    "--data. Writes eval_problems.jsonl, eval_metrics.json and pass_at_k.png to --eval-dir (default "
                    "OUTPUT_DIR/eval) and prints the metrics as one JSON line; run again, an interrupted evaluation "
                    "continues where it stopped. E.g. pacs eval --model runs/x/final_model --preset math --data "
                    "test.jsonl",
        epilog=_key_list("eval"), formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_common(ev)
    ev.add_argument("--preset", help="evaluation protocol: math (the paper's sampling: 32 samples, T 0.6, top-p "
                    "0.95, pass@1..32), paper (+ chat template, instruction, 4096 tokens), paper256; see "
                    "pacs/eval/presets.py")
    ev.add_argument("--data", help="a .jsonl/.parquet file (or hf:NAME, see pacs/tasks/datasets.py) whose every row "
                    "is evaluated with the math reward")
    ev.add_argument("--eval-dir", help="where eval_problems.jsonl, eval_metrics.json and pass_at_k.png go "
                    "(default OUTPUT_DIR/eval)")
    ev.add_argument("--n-samples", type=int, help="samples per problem")
    ev.add_argument("--temperature", type=float, help="sampling temperature (eval.temperature; 0: greedy)")
    ev.add_argument("--top-p", type=float, help="nucleus sampling (advanced.eval.top_p)")
    ev.add_argument("--k", type=int, action="append", help="pass@k to report (repeatable; each <= --n-samples)")
    ev.add_argument("--num-problems", type=int, help="problems to evaluate (eval.num_problems)")
    plan = sub.add_parser("plan", help="peak GPU memory of a pacs train run by component, and the cheapest "
                          "settings that fit (reads config.json only; docs/plan.md)")
    plan.add_argument("--preset", help="plan a pacs train preset as set: a shipped one's name (e.g. "
                      "qwen2.5-1.5b_lora_24gb; pacs/configs/presets/) or a YAML path with its .plan.yaml beside it "
                      "(the model and GPUs); the flags below, given beside it, are applied over it")
    plan.add_argument("--model", help="HF model directory, its config.json, or a shipped config by name or hub id "
                      "(e.g. qwen2.5-7b or Qwen/Qwen2.5-7B; pacs/configs/models/)")
    plan.add_argument("--gpu-gib", type=float, help="memory of one GPU, GiB")
    plan.add_argument("--gpus", type=int, help="GPUs (FSDP2 ranks) (default: 1)")
    plan.add_argument("--prompt-len", type=int, help="rollout.max_prompt_len (default: 1024)")
    plan.add_argument("--response-len", type=int, help="rollout.max_new_tokens (default: 8192)")
    plan.add_argument("--group-size", type=int, help="rollout.group_size (default: 8)")
    plan.add_argument("--prompts-per-step", type=int, help="rollout.prompts_per_step (default: 32)")
    plan.add_argument("--micro-batch-groups", type=int, help="optim.micro_batch_groups (default: 1)")
    plan.add_argument("--lora-rank", type=int, help="plan LoRA adapters of this rank (default: full fine-tuning)")
    plan.add_argument("--lora-targets", help="comma-separated projections LoRA adapts (default: all seven)")
    plan.add_argument("--compute-dtype", choices=("bfloat16", "float32"), help="model.dtype (default: bfloat16)")
    plan.add_argument("--master-dtype", choices=("float32", "bfloat16"), help="optim.master_dtype (default: float32)")
    plan.add_argument("--gpu-memory-utilization", type=float,
                      help="rollout.gpu_memory_utilization, vLLM's share held during training; 0: "
                           "rollout.engine=hf (default: 0.3)")
    plan.add_argument("--verbose", action="store_true", help=argparse.SUPPRESS)
    sub.add_parser("bench", help="kernel benchmarks (arguments go to benchmarks/run.py; pacs bench --help)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        quiet_third_party("--verbose" in argv)
        return cmd_bench([a for a in argv[1:] if a != "--verbose"])
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    # KEY=VALUE anywhere on the line: argparse takes one run of positionals, and a second (after an option, as in
    # --output-dir D optim.lr=1e-3 --seed 1 rollout.group_size=4) came back unrecognized
    later = [a for a in unknown if "=" in a and not a.startswith("-")] if hasattr(args, "overrides") else []
    if len(later) < len(unknown):
        parser.error(f"unrecognized arguments: {' '.join(a for a in unknown if a not in later)}")
    if later:
        args.overrides = [*args.overrides, *later]
    quiet_third_party(args.verbose)
    try:
        if args.command == "train":
            return cmd_train(args)
        if args.command == "plan":
            return cmd_plan(args)
        return cmd_eval(args)
    except (ValueError, TypeError) as exc:
        if getattr(exc, "pacs_during_training", False):  # not a setting: a failure inside a training step
            raise
        if _is_main_rank():
            print(f"pacs {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"pacs {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
