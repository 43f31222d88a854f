"""Tasks: the built-in addition task, its tokenizer/model/warm-up cache, math files, rewards."""

import json

import pytest
import torch

from pacs.config import Config, TaskConfig
from pacs.tasks import AdditionTask, MathTask, load_problems, make_task
from pacs.tasks.embedded import build_model, build_tokenizer, prepare_embedded_model
from pacs.tasks.rewards import exact_match, extract_answer, extract_boxed, math_reward


def test_addition_stream_is_deterministic_and_disjoint_from_eval():
    task = AdditionTask(digits=2, seed=3, eval_size=50)
    again = AdditionTask(digits=2, seed=3, eval_size=50)
    train = task.train_batch(0, 300)
    assert train == again.train_batch(0, 300)
    assert task.train_batch(100, 5) == train[100:105]
    held_out = {p.prompt for p in task.eval_problems()}
    assert len(held_out) == 50 and not held_out & {p.prompt for p in train}
    for p in train[:50]:
        a, b = (int(x[::-1]) for x in p.prompt[:-1].split("+"))  # little-endian operands
        assert len(p.prompt) == 6 and p.answer == f"{a + b:03d}"[::-1]  # fixed width, reversed
    assert AdditionTask(digits=2, seed=4).train_batch(0, 20) != train[:20]
    assert task.reward(train[0].answer, train[0]) == 1.0
    assert task.reward(train[0].answer + "1", train[0]) == 0.0


def test_make_task_by_name(tmp_path):
    assert isinstance(make_task(Config()), AdditionTask)
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"problem": f"{i}+1?", "answer": str(i + 1)}) + "\n" for i in range(10)))
    cfg = Config()
    cfg.task.name, cfg.task.data_path, cfg.task.eval_size = "math", str(path), 3
    task = make_task(cfg)
    assert isinstance(task, MathTask) and len(task.eval_problems()) == 3


def test_tokenizer_roundtrip_in_hf_format(tmp_path):
    from transformers import AutoTokenizer

    tok = build_tokenizer()
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    ids = loaded("123+45=")["input_ids"]
    assert ids[0] == loaded.bos_token_id and len(ids) == 8
    assert loaded.decode(ids + [loaded.eos_token_id], skip_special_tokens=True) == "123+45="
    assert (loaded.pad_token_id, loaded.bos_token_id, loaded.eos_token_id) == (0, 1, 2)


def test_tiny_model_shape():
    cfg = TaskConfig()
    model = build_model(cfg, len(build_tokenizer()), seed=0)
    assert model.config.head_dim >= 32 and model.config.tie_word_embeddings
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight


def test_warmup_is_cached(tmp_path):
    cfg = TaskConfig(cache_dir=str(tmp_path), warmup_steps=3, warmup_batch_size=8, digits=2)
    logs: list[str] = []
    path = prepare_embedded_model(cfg, seed=0, log=logs.append)
    assert any("supervised steps" in line for line in logs)
    logs.clear()
    assert prepare_embedded_model(cfg, seed=0, log=logs.append) == path
    assert logs and "using cached model" in logs[0]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    fresh = build_model(cfg, len(build_tokenizer()), seed=0)
    changed = any(not torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    assert changed, "the warm-up must have trained the model"
    other = TaskConfig(cache_dir=str(tmp_path), warmup_steps=4, warmup_batch_size=8, digits=2)
    assert prepare_embedded_model(other, seed=0, log=logs.append) != path


def test_warmup_stops_at_target_accuracy(tmp_path):
    """With a reachable target the warm-up stops at the first validation check that meets it."""
    cfg = TaskConfig(cache_dir=str(tmp_path), warmup_steps=60, warmup_batch_size=8, digits=1,
                     warmup_target_accuracy=0.0)
    path = prepare_embedded_model(cfg, seed=0, log=lambda *_: None)
    summary = json.loads(open(f"{path}/warmup.json").read())
    assert summary["steps"] == 25 and summary["validation_accuracy"] >= 0.0


def test_math_loader_jsonl(tmp_path):
    path = tmp_path / "data.jsonl"
    rows = [{"prompt": "What is 2+2?", "answer": "4"},
            {"problem": "Half of 3?", "answer": "\\frac{3}{2}"},
            {"question": "x?", "solution": "so x = \\boxed{7}."}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    problems = load_problems(str(path))
    assert [p.answer for p in problems] == ["4", "\\frac{3}{2}", "7"]
    assert problems[1].prompt == "Half of 3?"
    task = MathTask(str(path), eval_size=1, seed=0)
    assert task.eval_problems() == problems[2:]
    epoch = [task.train_problem(i) for i in range(2)]
    assert sorted(p.prompt for p in epoch) == sorted(p.prompt for p in problems[:2])
    assert task.reward("The answer is \\boxed{7}", problems[2]) == 1.0
    assert task.reward("The answer is 8", problems[2]) == 0.0


def test_math_loader_errors(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        load_problems(str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "x"}) + "\n")
    with pytest.raises(ValueError, match="needs a question"):
        load_problems(str(bad))
    broken = tmp_path / "broken.jsonl"
    broken.write_text("{not json\n")
    with pytest.raises(ValueError, match="broken.jsonl:1: not valid JSON"):
        load_problems(str(broken))
    with pytest.raises(ValueError, match="must end in"):
        other = tmp_path / "x.csv"
        other.write_text("a,b\n")
        load_problems(str(other))


def test_math_loader_parquet(tmp_path):
    pd = pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    path = tmp_path / "d.parquet"
    pd.DataFrame({"problem": ["1+1?", "2+2?"], "answer": ["2", "4"]}).to_parquet(path)
    assert [p.answer for p in load_problems(str(path))] == ["2", "4"]
    # chat-style prompts and a missing answer read as the same rows in .jsonl do (pandas gave the prompt the
    # text of a numpy array and the answer "nan")
    chat = tmp_path / "chat.parquet"
    pd.DataFrame({"prompt": [[{"role": "user", "content": "What is 2+3?"}]] * 2, "answer": ["5", None],
                  "solution": ["\\boxed{5}", "so \\boxed{7}"]}).to_parquet(chat)
    assert [(p.prompt, p.answer) for p in load_problems(str(chat))] == [("What is 2+3?", "5"), ("What is 2+3?", "7")]


def test_rewards():
    assert exact_match(" 42 ", "42") == 1.0 and exact_match("420", "42") == 0.0
    assert extract_boxed("a \\boxed{\\frac{1}{2}} b \\boxed{3}") == "3"
    assert extract_boxed("\\boxed{x^{2}}") == "x^{2}"
    # the last box whatever its spelling (a bare \boxed 3 after a braced one was passed over for it)
    assert extract_boxed("\\boxed{4} then, finally, \\boxed 3") == "3"
    assert extract_boxed("\\boxed {5}") == "5" and extract_boxed("\\fbox{5}") == "5"
    assert extract_boxed("\\boxed 7 and then \\boxed{8}") == "8" and extract_boxed("no box") is None
    assert extract_answer("so 3 then 12.5") == "12.5"
    assert math_reward("thus \\boxed{0.5}", "0.5") == 1.0
    assert math_reward("thus \\boxed{\\dfrac{1}{2}}", "\\frac{1}{2}") == 1.0
    assert math_reward("no answer here", "3") == 0.0
    assert math_reward("the result is 3.0", "3") == 1.0


def test_a_data_file_that_is_not_utf8_is_named_with_its_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(json.dumps({"problem": "1+1", "answer": "2"}).encode() + b"\n"
                     + '{"problem": "caf\u00e9", "answer": "2"}\n'.encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1.jsonl:2: not UTF-8 text \(byte 0xe9 at offset \d+\); save the file"):
        load_problems(str(path))
