"""Tests for asyncflow.data: Example, dataset file loaders, built-in tasks and countdown_reward."""

import json
import pickle
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncflow.data import TASK_ALPHABET, TASKS, DatasetError, Example, countdown_reward, load_examples, make_task
from asyncflow.data.tasks import TEST_SIZE, VALIDATION_SIZE, carve_validation, is_held_out, is_validation

# ---------------------------------------------------------------- Example


def test_example_rejects_non_string_fields():
    with pytest.raises(TypeError, match="Example.answer must be a str"):
        Example(prompt="1+1=", answer=2)
    with pytest.raises(TypeError, match="Example.metadata must be a dict"):
        Example(prompt="p", answer="a", metadata=[1])


# ---------------------------------------------------------------- JSONL


def _write_jsonl(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_jsonl_loads_fields_metadata_and_sources(tmp_path):
    path = _write_jsonl(tmp_path / "train.jsonl", [
        json.dumps({"prompt": "1+2=", "answer": 3, "level": "easy"}),
        "",
        json.dumps({"prompt": "what?", "answer": "x", "tags": ["a"]}),
        json.dumps({"prompt": "cd", "answer": {"target": 5, "numbers": [2, 3]}}),
    ])
    examples = load_examples(path)
    assert [e.prompt for e in examples] == ["1+2=", "what?", "cd"]
    assert examples[0].answer == "3"  # int answer converted with str()
    assert examples[0].metadata == {"level": "easy"}
    assert examples[1].metadata == {"tags": ["a"]}
    assert json.loads(examples[2].answer) == {"target": 5, "numbers": [2, 3]}
    # the blank line still counts in the 1-based numbering
    assert [e.source for e in examples] == [f"{path}:1", f"{path}:3", f"{path}:4"]


def test_jsonl_custom_field_names(tmp_path):
    path = _write_jsonl(tmp_path / "q.jsonl", [json.dumps({"question": "q1", "solution": "s1", "id": 7})])
    [example] = load_examples(path, prompt_field="question", answer_field="solution")
    assert (example.prompt, example.answer, example.metadata) == ("q1", "s1", {"id": 7})


def test_jsonl_missing_field_names_file_line_field_and_present_fields(tmp_path):
    path = _write_jsonl(tmp_path / "bad.jsonl", [
        json.dumps({"prompt": "a", "answer": "b"}),
        json.dumps({"prompt": "c", "solution": "d"}),
    ])
    with pytest.raises(DatasetError) as err:
        load_examples(path)
    message = str(err.value)
    assert f"{path}:2" in message and "'answer'" in message and "['prompt', 'solution']" in message


def test_jsonl_bad_json_and_non_object_lines(tmp_path):
    path = _write_jsonl(tmp_path / "broken.jsonl", [json.dumps({"prompt": "a", "answer": "b"}), '{"prompt": "x",'])
    with pytest.raises(DatasetError, match=r"broken\.jsonl:2: line 2 is not valid JSON"):
        load_examples(path)
    path = _write_jsonl(tmp_path / "list.jsonl", ["[1, 2]"])
    with pytest.raises(DatasetError, match=r"list\.jsonl:1: .*JSON list, expected an object"):
        load_examples(path)


def test_null_answer_and_non_string_prompt_are_errors(tmp_path):
    path = _write_jsonl(tmp_path / "null.jsonl", [json.dumps({"prompt": "a", "answer": None})])
    with pytest.raises(DatasetError, match=r"null\.jsonl:1: field 'answer' is null"):
        load_examples(path)
    path = _write_jsonl(tmp_path / "num.jsonl", [json.dumps({"prompt": 5, "answer": "a"})])
    with pytest.raises(DatasetError, match=r"num\.jsonl:1: field 'prompt' must be a string, got int"):
        load_examples(path)


def test_unknown_format_missing_path_and_split_on_file(tmp_path):
    with pytest.raises(DatasetError, match="unsupported dataset format '.csv'"):
        (tmp_path / "d.csv").write_text("prompt,answer\n")
        load_examples(tmp_path / "d.csv")
    with pytest.raises(DatasetError, match="no such file"):
        load_examples(tmp_path / "absent.jsonl")
    path = _write_jsonl(tmp_path / "ok.jsonl", [json.dumps({"prompt": "a", "answer": "b"})])
    with pytest.raises(DatasetError, match="only applies to a saved HF dataset folder"):
        load_examples(path, split="train")


# ---------------------------------------------------------------- Parquet and HF folders


def test_parquet_rows_and_missing_field_row_index(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": ["p0", "p1", "p2"], "answer": [10, 11, 12], "extra": [True, False, True]}), path)
    examples = load_examples(path)
    assert [(e.prompt, e.answer, e.metadata["extra"]) for e in examples] == [("p0", "10", True), ("p1", "11", False),
                                                                             ("p2", "12", True)]
    assert examples[2].source == f"{path}[2]"
    with pytest.raises(DatasetError) as err:
        load_examples(path, answer_field="target")
    assert f"{path}[0]" in str(err.value) and "'target'" in str(err.value) and "'extra'" in str(err.value)


def test_parquet_null_cell_names_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "n.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"], "answer": ["x", None]}), path)
    with pytest.raises(DatasetError, match=r"n\.parquet\[1\]: field 'answer' is null"):
        load_examples(path)


def test_hf_dataset_folder_and_splits(tmp_path):
    import datasets

    single = tmp_path / "single"
    datasets.Dataset.from_dict({"prompt": ["a", "b"], "answer": [1, 2]}).save_to_disk(str(single))
    assert [(e.prompt, e.answer) for e in load_examples(single)] == [("a", "1"), ("b", "2")]
    with pytest.raises(DatasetError, match="single dataset without splits"):
        load_examples(single, split="train")

    both = tmp_path / "both"
    datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"prompt": ["t"], "answer": ["1"]}),
        "test": datasets.Dataset.from_dict({"q": ["u"], "answer": ["2"]}),
    }).save_to_disk(str(both))
    [train] = load_examples(both, split="train")
    assert (train.prompt, train.source) == ("t", f"{both}/train[0]")
    with pytest.raises(DatasetError, match=r"splits \['test', 'train'\]; pass split="):
        load_examples(both)
    with pytest.raises(DatasetError, match="no split 'dev'"):
        load_examples(both, split="dev")
    with pytest.raises(DatasetError, match=r"test\[0\]: missing field 'prompt'; the row has fields \['answer', 'q'\]"):
        load_examples(both, split="test")


def test_folder_that_is_not_a_dataset(tmp_path):
    with pytest.raises(DatasetError, match="not a saved HF dataset"):
        load_examples(tmp_path)


# ---------------------------------------------------------------- tasks


@pytest.mark.parametrize("name", sorted(TASKS))
def test_tasks_are_deterministic_and_seed_dependent(name):
    first = make_task(name, seed=3)
    again = make_task(name, seed=3)
    other = make_task(name, seed=4)
    assert first.examples("train", 50) == again.examples("train", 50)
    assert first.examples("test", 20) == again.examples("test", 20)
    assert [e.prompt for e in first.examples("train", 50)] != [e.prompt for e in other.examples("train", 50)]


@pytest.mark.parametrize("name", sorted(TASKS))
@pytest.mark.slow
def test_held_out_never_overlaps_train(name):
    task = make_task(name)
    test = task.examples("test")
    train_prompts = {e.prompt for e in task.examples("train", 3000)}
    test_prompts = [e.prompt for e in test]
    assert len(test) == TEST_SIZE
    assert len(set(test_prompts)) == len(test_prompts), "test split has duplicate prompts"
    assert not train_prompts & set(test_prompts)
    assert all(is_held_out(p) for p in test_prompts) and not any(is_held_out(p) for p in train_prompts)
    # another seed's train stream avoids this seed's test prompts too (the partition ignores the seed)
    assert not {e.prompt for e in make_task(name, seed=9).examples("train", 3000)} & set(test_prompts)


@pytest.mark.parametrize("name", sorted(TASKS))
@pytest.mark.slow
def test_validation_split_is_disjoint_from_train_and_test(name):
    task = make_task(name)
    validation = [e.prompt for e in task.examples("validation")]
    assert len(validation) == len(set(validation))
    assert len(validation) == VALIDATION_SIZE or name == "countdown"  # 255 distinct at difficulty 2
    assert all(is_validation(p) and not is_held_out(p) for p in validation)
    train = {e.prompt for e in task.examples("train", 3000)}
    assert not train & set(validation) and not any(is_validation(p) for p in train)
    assert not set(validation) & {e.prompt for e in task.examples("test")}
    assert make_task(name).examples("validation", 10) == task.examples("validation")[:10]
    assert task.examples("validation", 1)[0].metadata["split"] == "validation"


def test_carve_validation_splits_file_rows_by_the_same_partition():
    rows = [Example(prompt=f"{a}+{b}=", answer=str(a + b)) for a in range(30) for b in range(30)]
    rest, validation = carve_validation(rows + rows[:50], 5)
    assert len(validation) == 5 and len({e.prompt for e in validation}) == 5
    assert all(is_validation(e.prompt) for e in validation) and not any(is_validation(e.prompt) for e in rest)
    assert len(rest) == sum(not is_validation(e.prompt) for e in rows + rows[:50])


def test_test_split_is_a_fixed_prefix_and_train_n_is_required():
    task = make_task("reverse", seed=1)
    assert task.examples("test", 10) == task.examples("test")[:10]
    assert make_task("reverse", seed=1).examples("test", 300)[:TEST_SIZE] == task.examples("test")
    with pytest.raises(ValueError, match="infinite stream; pass n"):
        task.examples("train")
    with pytest.raises(ValueError, match=r"split must be one of \['train', 'validation', 'test'\]"):
        task.examples("valid", 3)


def test_small_task_has_fewer_test_prompts_and_says_so():
    task = make_task("arithmetic", difficulty=1)  # 100 possible prompts, about 10% held out
    test = task.examples("test")
    assert 0 < len(test) < 25
    with pytest.raises(ValueError, match=f"only {len(test)} distinct held-out prompts exist, asked for 100"):
        task.examples("test", 100)


def _arithmetic_value(prompt):
    assert re.fullmatch(r"\d+([+\-*]\d+)*=", prompt), prompt
    return eval(prompt[:-1])  # test oracle only: the prompt is checked to be digits and operators


@pytest.mark.parametrize("difficulty", [1, 2, 3, 4, 5])
def test_arithmetic_answers_and_difficulty(difficulty):
    task = make_task("arithmetic", difficulty=difficulty)
    examples = task.examples("train", 300)
    for example in examples:
        assert example.answer == str(_arithmetic_value(example.prompt))
    operators = {op for e in examples for op in re.findall(r"[+\-*]", e.prompt)}
    operand_counts = {len(re.findall(r"\d+", e.prompt)) for e in examples}
    longest = max(len(n) for e in examples for n in re.findall(r"\d+", e.prompt))
    expected = {1: ({"+"}, {2}, 1), 2: ({"+"}, {2}, 2), 3: ({"+", "-"}, {2}, 3),
                4: ({"+", "-"}, {3}, 2), 5: ({"+", "-", "*"}, {3}, 2)}[difficulty]
    assert (operators, operand_counts, longest) == expected
    assert task.verifier == "numeric_match"


def test_reverse_and_sort_answers():
    for example in make_task("reverse", difficulty=3).examples("train", 100):
        digits = re.fullmatch(r"rev:(\d{5})=", example.prompt).group(1)
        assert example.answer == digits[::-1]
    for example in make_task("sort", difficulty=5).examples("train", 100):
        digits = re.fullmatch(r"sort:(\d{8})=", example.prompt).group(1)
        assert example.answer == "".join(sorted(digits))
    assert make_task("reverse").verifier == make_task("sort").verifier == "exact_match"


@pytest.mark.parametrize("difficulty", [1, 2, 3, 4, 5])
@pytest.mark.slow
def test_countdown_instances_are_solvable_and_well_formed(difficulty):
    task = make_task("countdown", difficulty=difficulty)
    for example in task.examples("train", 100) + task.examples("test")[:30]:
        truth = json.loads(example.answer)
        numbers, target = truth["numbers"], truth["target"]
        assert example.prompt == f"{','.join(map(str, numbers))}->{target}:"
        assert len(numbers) == task.params.count and 1 <= target <= task.params.max_target
        assert countdown_reward(example.metadata["solution"], example.answer) == 1.0


def test_every_prompt_and_model_output_uses_the_task_alphabet():
    alphabet = set(TASK_ALPHABET)
    assert len(TASK_ALPHABET) == len(alphabet)
    for name in TASKS:
        for difficulty in TASKS[name].levels:
            for example in make_task(name, difficulty).examples("train", 200):
                model_text = example.metadata.get("solution", example.answer)
                assert set(example.prompt + model_text) <= alphabet, (name, example)


def test_make_task_errors_and_metadata():
    with pytest.raises(ValueError, match=r"unknown task 'chess'; built-in tasks: \['arithmetic', 'countdown'"):
        make_task("chess")
    with pytest.raises(ValueError, match=r"difficulty must be one of \[1, 2, 3, 4, 5\], got 9"):
        make_task("sort", difficulty=9)
    example = make_task("sort", difficulty=2, seed=5).examples("test", 1)[0]
    assert example.metadata == {"task": "sort", "difficulty": 2, "split": "test"}
    assert example.source == "sort-d2-s5/test[0]"
    train = make_task("sort", difficulty=2, seed=5).examples("train", 3)
    assert [e.metadata for e in train] == [{"task": "sort", "difficulty": 2, "split": "train"}] * 3
    assert train[0].metadata is train[2].metadata  # one dict for a split's examples, not one per example
    countdown = make_task("countdown", seed=2).examples("train", 2)
    assert countdown[0].metadata["solution"] != countdown[1].metadata["solution"]  # fields of their own: own dicts


def test_task_pickles_for_remote_workers():
    task = make_task("countdown", seed=2)
    task.examples("test", 5)
    clone = pickle.loads(pickle.dumps(task))
    assert clone.examples("test", 8) == task.examples("test", 8)


# ---------------------------------------------------------------- countdown_reward

TRUTH = json.dumps({"target": 22, "numbers": [3, 5, 7]})


@pytest.mark.parametrize("completion", ["3*5+7", " (5*3)+7 ", "7+5*3=22", "3*5+7=99", "(7+5*3)"])
def test_countdown_reward_accepts_correct_expressions(completion):
    assert countdown_reward(completion, TRUTH) == 1.0


@pytest.mark.parametrize("completion", [
    "3*5+6+1",        # 6 and 1 were not given
    "7+7+5+3",        # 7 used twice
    "3*5+7+0",        # 0 not given
    "3+5+7",          # wrong value
    "22",             # the target is not a given number
    "3**5",           # power not allowed
    "-3+5*5",         # unary minus not allowed (5 also reused)
    "__import__('os')",
    "7/(5-5)",        # division by zero
    "",
    "(" * 300 + "3" + ")" * 300,
    "3*5+7\nmore text",
])
def test_countdown_reward_rejects_everything_else(completion):
    assert countdown_reward(completion, TRUTH) == 0.0


def test_countdown_reward_division_is_exact():
    truth = json.dumps({"target": 2, "numbers": [3, 6, 1]})
    assert countdown_reward("6/3", truth) == 1.0
    assert countdown_reward("(6+1)/3", truth) == 0.0  # 7/3 is not 2 (no integer truncation)


def test_countdown_reward_bad_ground_truth_raises():
    with pytest.raises(ValueError, match="countdown ground truth must be JSON"):
        countdown_reward("1+2", "22")
    with pytest.raises(ValueError, match="needs an int target"):
        countdown_reward("1+2", json.dumps({"target": "22", "numbers": [1]}))


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=TASK_ALPHABET + " x.", max_size=40))
def test_countdown_reward_never_raises_on_completions(completion):
    assert countdown_reward(completion, TRUTH) in (0.0, 1.0)


# ---------------------------------------------------------------- issue 15, item 8: broken files are named
def test_non_utf8_jsonl_names_file_line_and_column(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(json.dumps({"prompt": "a", "answer": "b"}).encode() + b"\n"
                     + '{"prompt": "caf\u00e9", "answer": "x"}\n'.encode("latin-1"))
    with pytest.raises(DatasetError) as err:
        load_examples(path)
    message = str(err.value)
    assert message.startswith(f"{path}:2: ") and "not valid UTF-8" in message
    assert "byte 0xe9 at column 16" in message  # {"prompt": "caf is 15 characters


def test_a_utf8_byte_order_mark_is_ignored(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"prompt": "p", "answer": "1"}).encode() + b"\r\n")
    assert [(e.prompt, e.answer) for e in load_examples(path)] == [("p", "1")]


def test_empty_files_are_named(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    with pytest.raises(DatasetError, match=rf"^{re.escape(str(empty))}: the file is empty"):
        load_examples(empty)
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n  \n")
    with pytest.raises(DatasetError, match=rf"^{re.escape(str(blank))}: no rows \(only blank lines\)"):
        load_examples(blank)
    no_rows = tmp_path / "none.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string()), "answer": pa.array([], pa.string())}), no_rows)
    with pytest.raises(DatasetError, match=rf"^{re.escape(str(no_rows))}: no rows"):
        load_examples(no_rows)


def test_missing_values_and_bytes_are_not_answers(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "nan.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"], "answer": [1.5, float("nan")]}), path)
    with pytest.raises(DatasetError, match=r"nan\.parquet\[1\]: field 'answer' is nan \(a missing value\?\)"):
        load_examples(path)
    path = tmp_path / "bytes.parquet"
    pq.write_table(pa.table({"prompt": ["a"], "answer": pa.array([b"\x00\x01"], pa.binary())}), path)
    with pytest.raises(DatasetError, match=r"bytes\.parquet\[0\]: field 'answer' must be a string.*got bytes"):
        load_examples(path)


# ---------------------------------------------------------------- issue 15, item 7: the whole file up front
def test_validate_data_file_checks_every_row_and_names_the_first_bad_one(tmp_path):
    from asyncflow.data import validate_data_file

    rows = [json.dumps({"question": f"q{i}", "solution": i}) for i in range(500)]
    good = _write_jsonl(tmp_path / "good.jsonl", rows)
    assert validate_data_file(good, prompt_field="question", answer_field="solution") == 500
    rows[420] = json.dumps({"question": 7, "solution": 1})  # far down the file: found before any training
    rows[430] = json.dumps({"question": "q", "answer": 1})
    bad = _write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(DatasetError, match=rf"^{re.escape(str(bad))}:421: field 'question' must be a string, got int"):
        validate_data_file(bad, prompt_field="question", answer_field="solution")
    rows[420] = json.dumps({"question": "q", "solution": 1})
    bad = _write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(DatasetError, match=r"bad\.jsonl:431: missing field 'solution'; the row has fields"):
        validate_data_file(bad, prompt_field="question", answer_field="solution")
    rows[430] = '{"question": "q", "solution": 1'
    bad = _write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(DatasetError, match=r"bad\.jsonl:431: line 431 is not valid JSON \(.* at column 32\)"):
        validate_data_file(bad, prompt_field="question", answer_field="solution")
    with pytest.raises(DatasetError, match="no such file"):
        validate_data_file(tmp_path / "absent.jsonl")
