"""``pacs train | eval | bench``: one entry point (also ``python -m pacs``)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

from .config import Config, load_config

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML file (see configs/); defaults reproduce the embedded run")
    parser.add_argument("--model", help="HF model directory or hub id ('embedded': the built-in tiny model)")
    parser.add_argument("--output-dir", help="where metrics, checkpoints and the final model go")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--rollout", choices=("auto", "vllm", "hf"),
                        help="rollout engine: vLLM if importable (auto), forced vLLM, or HF generate")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="config overrides with dotted keys, e.g. optim.lr=1e-4 rollout.group_size=8")


def build_config(args: argparse.Namespace) -> Config:
    from .eval_presets import preset_overrides

    cfg = load_config(args.config, preset_overrides(getattr(args, "preset", None)) + list(args.overrides))
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
    return cfg


def cmd_train(args: argparse.Namespace) -> int:
    from .trainer import TrainingStopped, train

    cfg = build_config(args)
    try:
        train(cfg)
    except TrainingStopped as exc:
        print(f"[train] stopped: {exc}", file=sys.stderr)
        return 3
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoTokenizer

    from .config import check_lengths, validate
    from .eval_outputs import write_eval_outputs
    from .evaluate import run_eval
    from .policy import check_model_path, max_positions
    from .rollout import check_vllm_available, make_rollout_engine
    from .tasks import make_task

    cfg = build_config(args)
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
    if args.num_problems is not None:
        cfg.eval.num_problems = args.num_problems
    if args.data is not None:  # every row of this file is a problem to evaluate
        cfg.task.name, cfg.task.data_path, cfg.task.eval_path = "math", args.data, args.data
    validate(cfg)
    if cfg.rollout.engine == "vllm":
        check_vllm_available()
    from .trainer import apply_torch_threads

    apply_torch_threads(cfg, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    model_dir = cfg.model.path
    if model_dir == "embedded":
        from .tasks.embedded import prepare_embedded_model

        model_dir = prepare_embedded_model(cfg.task, cfg.seed)
    check_lengths(cfg, max_positions(check_model_path(model_dir, cfg.model.trust_remote_code)))
    task = make_task(cfg)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=cfg.model.trust_remote_code)
    r, e = cfg.rollout, cfg.eval
    engine = make_rollout_engine(r.engine, model_dir, max_model_len=r.max_prompt_len + r.max_new_tokens,
                                 seed=cfg.seed, dtype=cfg.model.dtype,
                                 gpu_memory_utilization=r.gpu_memory_utilization, kv_cache_gib=r.kv_cache_gib,
                                 enforce_eager=r.enforce_eager)
    try:
        report = run_eval(engine, task, tokenizer, task.eval_problems(e.num_problems),
                          n_samples=e.n_samples, temperature=e.temperature, top_p=e.top_p, ks=e.ks,
                          max_new_tokens=r.max_new_tokens, stop_token_ids=[tokenizer.eos_token_id], seed=cfg.seed,
                          template=cfg.task.prompt_template, use_chat_template=cfg.task.use_chat_template,
                          max_prompt_len=r.max_prompt_len)
    finally:
        engine.close()
    info = {"model": model_dir, "data": cfg.task.data_path if cfg.task.name == "math" else cfg.task.name,
            "preset": args.preset, "temperature": e.temperature, "top_p": e.top_p,
            "max_new_tokens": r.max_new_tokens, "seed": cfg.seed, "label": os.path.basename(model_dir.rstrip("/"))}
    out_dir = args.eval_dir or os.path.join(cfg.output_dir, "eval")
    paths = write_eval_outputs(report, out_dir, info=info, plot=cfg.plot)
    print(json.dumps({"model": model_dir, **report.metrics, **{f"{kind}_path": p for kind, p in paths.items()}}))
    return 0


def cmd_bench(argv: list[str]) -> int:
    """Forward everything to benchmarks/run.py's main(argv), loaded by path from the repo root."""
    path = os.path.join(REPO_ROOT, "benchmarks", "run.py")
    if not os.path.isfile(path):
        print(f"pacs bench: {path} is missing; the benchmarks ship with a source checkout of the "
              "repository (git clone), not with an installed wheel", file=sys.stderr)
        return 2
    spec = importlib.util.spec_from_file_location("pacs_benchmarks_run", path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, REPO_ROOT)
    spec.loader.exec_module(module)
    result = module.main(argv)
    return int(result) if isinstance(result, int) else 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # vLLM logs every weight push at INFO
    if argv and argv[0] == "bench":
        return cmd_bench(argv[1:])
    parser = argparse.ArgumentParser(prog="pacs", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train with PACS (or GRPO); default: the built-in embedded run")
    _add_common(train)
    train.add_argument("--max-steps", type=int, help="rollout steps")
    train.add_argument("--algo", choices=("pacs", "grpo"))
    train.add_argument("--resume", action="store_true", help="continue from OUTPUT_DIR's latest checkpoint")
    ev = sub.add_parser("eval", help="held-out accuracy and pass@k of a model")
    _add_common(ev)
    ev.add_argument("--preset", help="evaluation protocol: math (the paper's sampling: 32 samples, T 0.6, top-p "
                    "0.95, pass@1..32), paper (+ chat template, instruction, 4096 tokens), paper256; see "
                    "pacs/eval_presets.py")
    ev.add_argument("--data", help="a .jsonl/.parquet file (or hf:NAME, see pacs/datasets.py) whose every row "
                    "is evaluated with the math reward")
    ev.add_argument("--eval-dir", help="where eval_problems.jsonl, eval_metrics.json and pass_at_k.png go "
                    "(default OUTPUT_DIR/eval)")
    ev.add_argument("--n-samples", type=int, help="samples per problem")
    ev.add_argument("--temperature", type=float)
    ev.add_argument("--top-p", type=float)
    ev.add_argument("--k", type=int, action="append", help="pass@k to report (repeatable)")
    ev.add_argument("--num-problems", type=int)
    sub.add_parser("bench", help="kernel benchmarks (arguments go to benchmarks/run.py)")
    args = parser.parse_args(argv)
    try:
        if args.command == "train":
            return cmd_train(args)
        return cmd_eval(args)
    except (ValueError, TypeError) as exc:
        print(f"pacs {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
