"""Speed of the vLLM rollout engine on a tiny Qwen2 built in code (CPU or GPU).

Measures, in one process: `import vllm`, the first and a second engine start, rollout throughput
(generated tokens per second, groups of `--group` responses for `--prompts` prompts, no stop
token so every response has `--new-tokens` tokens), one `sync_weights`, and Hugging Face
`generate` on the same workload for comparison. Prints one JSON object.

    PYTHONPATH=. python benchmarks/rollout_vllm_speed.py            # the embedded task's shapes
    PYTHONPATH=. python benchmarks/rollout_vllm_speed.py --hidden 256 --layers 4 --new-tokens 64
"""

import argparse
import json
import random
import tempfile
import time

import torch
import transformers


def tiny_qwen2(args: argparse.Namespace, seed: int) -> transformers.Qwen2ForCausalLM:
    config = transformers.Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 32,
        num_key_value_heads=args.hidden // 32,
        head_dim=32,
        max_position_embeddings=args.prompt_len + args.new_tokens,
        tie_word_embeddings=True,
        initializer_range=0.2,
    )
    torch.manual_seed(seed)
    return transformers.Qwen2ForCausalLM(config).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=64, help="hidden size (head_dim is 32)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=40)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=12)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-hf", action="store_true", help="do not time HF generate")
    args = parser.parse_args()

    result: dict = {"device": "cuda" if torch.cuda.is_available() else "cpu",
                    "torch_threads": torch.get_num_threads(), **vars(args)}  # fmt: skip
    start = time.perf_counter()
    import vllm  # noqa: F401

    result["import_vllm_s"] = time.perf_counter() - start
    from pacs.rollout.vllm import VLLMRolloutEngine

    rng = random.Random(0)
    prompts = [
        [rng.randrange(args.vocab) for _ in range(args.prompt_len)] for _ in range(args.prompts)
    ]
    sampling = {
        "temperature": 1.0,
        "top_p": 1.0,
        "max_new_tokens": args.new_tokens,
        "stop_token_ids": [],
    }
    with tempfile.TemporaryDirectory() as model_dir:
        model = tiny_qwen2(args, seed=0)
        model.save_pretrained(model_dir)
        engine_args = {"max_model_len": args.prompt_len + args.new_tokens, "kv_cache_gib": 0.25}
        for name in ("engine_start_first_s", "engine_start_again_s"):
            start = time.perf_counter()
            engine = VLLMRolloutEngine(model_dir, **engine_args)
            result[name] = time.perf_counter() - start
            if name == "engine_start_first_s":
                engine.close()
        engine.generate(prompts, args.group, seed=0, **sampling)  # warm-up
        start, tokens = time.perf_counter(), 0
        for repeat in range(args.repeats):
            groups = engine.generate(prompts, args.group, seed=repeat + 1, **sampling)
            tokens += sum(len(response) for group in groups for response in group)
        seconds = time.perf_counter() - start
        result["vllm_tokens_per_s"] = tokens / seconds
        result["vllm_rollout_step_s"] = seconds / args.repeats
        new_weights = [(n, p.detach().clone()) for n, p in tiny_qwen2(args, 1).named_parameters()]
        start = time.perf_counter()
        engine.sync_weights(new_weights)
        result["sync_weights_s"] = time.perf_counter() - start
        engine.close()

    if not args.skip_hf:
        batch = torch.tensor(prompts)
        with torch.no_grad():
            start = time.perf_counter()
            for _ in range(args.repeats):
                model.generate(batch, attention_mask=torch.ones_like(batch), do_sample=True,
                               num_return_sequences=args.group, max_new_tokens=args.new_tokens,
                               min_new_tokens=args.new_tokens, eos_token_id=None, pad_token_id=0)  # fmt: skip
            seconds = time.perf_counter() - start
        result["hf_generate_tokens_per_s"] = (
            args.repeats * args.prompts * args.group * args.new_tokens / seconds
        )
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}))


if __name__ == "__main__":
    main()
