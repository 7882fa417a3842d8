"""GRPO rewards (posttrain.trainer.rewards): the built-ins, users' functions by import
path, weights, and the errors a user can cause. Pure Python: no JAX."""

from __future__ import annotations

import pytest

from posttrain.api.spec import GrpoSpec, RewardSpec
from posttrain.trainer import rewards

PROMPTS = ["What is 2 + 3?"] * 4


def shout(prompts, completions, answer, **unused):
    """A user reward (imported by path in the tests below): 1 for all-caps text."""
    return [1.0 if c.isupper() else 0.0 for c in completions]


def wrong_length(prompts, completions, **columns):
    return [1.0]


def fn(spec: dict, **kw):
    return rewards.build_reward(RewardSpec.model_validate(spec), 0, **kw)


def test_last_number():
    assert rewards.last_number("2 + 3 is 5, so Answer: 5.") == "5"
    assert rewards.last_number("Answer: -12") == "-12"
    assert rewards.last_number("about 1,234.5 apples") == "1234.5"
    assert rewards.last_number("no digits here") is None


def test_exact_answer_compares_the_last_number():
    r = fn({"type": "exactAnswer"})
    got = r(
        prompts=PROMPTS,
        completions=["Answer: 5.", "5 or 6? 6", "five", "Answer: 5.0"],
        answer=["5", "5", "5", "5"],
        mode="train",
        trajectory_ids=["a", "b", "c", "d"],
    )
    assert got == [1.0, 0.0, 0.0, 1.0]
    assert r.__name__ == "exactAnswer_0"
    # non-numeric answers compare as text
    assert fn({"type": "exactAnswer"})(
        prompts=PROMPTS[:1], completions=["it is 7"], answer=["seven"]
    ) == [0.0]


def test_an_episodes_answer_is_its_last_model_turn_not_a_tools_result():
    """With tools, the completion holds the tools' results: exactAnswer reads the model's
    last turn (final_turn), so an episode whose last number came from the calculator is
    not paid for an answer it never wrote."""
    episodes = [
        "<tool_call>{...}</tool_call>\n<tool_response>\n5\n</tool_response>\nAnswer: 5",
        "<tool_call>{...}</tool_call>\n<tool_response>\n5\n</tool_response>\n<tool_call>{",
    ]
    got = fn({"type": "exactAnswer"})(
        prompts=PROMPTS[:2], completions=episodes, answer=["5", "5"],
        final_turn=["Answer: 5", "<tool_call>{"],
    )  # fmt: skip
    assert got == [1.0, 0.0]


def test_regex_format_and_weights():
    r = fn({"type": "regexFormat", "pattern": r"^Answer: -?\d+\.$", "weight": 0.5})
    assert r(prompts=PROMPTS[:3], completions=["Answer: 5.", "answer: 5.", "Answer: 5.\nok"]) == [
        0.5,
        0.0,
        0.0,
    ]
    # '.' matches newlines
    multi = fn({"type": "regexFormat", "pattern": r"<think>.*</think>"})
    assert multi(prompts=PROMPTS[:1], completions=["<think>a\nb</think> 5"]) == [1.0]


def test_length_penalty_uses_sampled_token_counts():
    r = fn({"type": "lengthPenalty", "targetLength": 4, "weight": 2.0})
    got = r(prompts=PROMPTS[:3], completions=["x", "y", "z"], completion_tokens=[2, 4, 6])
    assert got == [0.0, 0.0, pytest.approx(-1.0)]  # 2.0 * -(6 - 4) / 4
    counted = fn({"type": "lengthPenalty", "targetLength": 2}, count_tokens=len)
    assert counted(prompts=PROMPTS[:1], completions=["abcd"]) == [pytest.approx(-1.0)]


def test_python_reward_gets_columns_only():
    r = fn({"type": "python", "function": "test_rewards:shout", "weight": 3.0})
    got = r(
        prompts=PROMPTS[:2],
        completions=["LOUD", "quiet"],
        answer=["5", "5"],
        mode="train",
        trajectory_ids=["a", "b"],
        completion_tokens=[1, 1],
    )
    assert got == [3.0, 0.0]


@pytest.mark.parametrize(
    ("spec", "field", "words"),
    [
        ({"type": "python", "function": "no_such_module_x:f"}, "rewards[0].function", "import"),
        (
            {"type": "python", "function": "test_rewards:missing"},
            "rewards[0].function",
            "no callable",
        ),
        ({"type": "lengthPenalty"}, "rewards[0].targetLength", "targetLength"),
    ],
)
def test_user_errors_name_the_field(spec, field, words):
    with pytest.raises(ValueError) as e:
        fn(spec)
    assert f"spec.grpo.{field}" in str(e.value) and words in str(e.value)


@pytest.mark.parametrize("pattern", ["(unclosed", "(a+)+$", "a{4294967296}"])
def test_reward_patterns_checked_by_the_spec_and_the_trainer(pattern):
    with pytest.raises(ValueError, match="regular expression"):
        RewardSpec.model_validate({"type": "regexFormat", "pattern": pattern})
    unchecked = RewardSpec.model_construct(type="regexFormat", pattern=pattern)
    with pytest.raises(
        ValueError, match=r"spec\.grpo\.rewards\[0\]\.pattern: .*regular expression"
    ):
        rewards.build_reward(unchecked, 0)


def test_python_reward_with_wrong_length_is_an_error():
    r = fn({"type": "python", "function": "test_rewards:wrong_length"})
    with pytest.raises(ValueError, match=r"spec.grpo.rewards\[0\].function.*1 rewards for 2"):
        r(prompts=PROMPTS[:2], completions=["a", "b"])


def test_build_rewards_sums_weighted():
    grpo = GrpoSpec.model_validate(
        {
            "rewards": [
                {"type": "exactAnswer"},
                {"type": "regexFormat", "pattern": r"^Answer:", "weight": 0.5},
            ]
        }
    )
    fns = rewards.build_rewards(grpo)
    assert [f.__name__ for f in fns] == ["exactAnswer_0", "regexFormat_1"]
    totals = rewards.total_rewards(
        fns, PROMPTS[:3], ["Answer: 5", "Answer: 4", "5"], answer=["5", "5", "5"]
    )
    assert totals == [1.5, 0.5, 1.0]


def test_a_reward_function_re_exported_from_python_s_own_modules_is_refused(tmp_path, monkeypatch):
    """`function: mymod:run` where mymod only does `from subprocess import run`: the
    callable is subprocess.run, refused as `subprocess:run` itself is."""
    from posttrain.trainer.rewards import import_function

    (tmp_path / "sneaky_rewards.py").write_text(
        "from subprocess import run\n\ndef score(prompts, completions, **kw):\n"
        "    return [0.0] * len(completions)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=r"^spec\.f: 'sneaky_rewards:run' is subprocess\.run: "):
        import_function("sneaky_rewards:run", "spec.f")
    with pytest.raises(ValueError, match=r"^spec\.f: 'builtins:exec' is from Python's own"):
        import_function("builtins:exec", "spec.f")
    assert import_function("sneaky_rewards:score", "spec.f")([], ["a"]) == [0.0]


def test_a_slow_pattern_s_match_is_bounded(caplog):
    """`.*a.*aX` passes the shape checks (two wide repeats) but is cubic in the text's
    length: took 7.8 s on 2000 characters with re. Each match now stops at
    MATCH_TIMEOUT_S and scores 0, said once."""
    import time

    r = fn({"type": "regexFormat", "pattern": ".*a.*aX"})
    slow = "a" * 20_000
    began = time.monotonic()
    assert r(prompts=PROMPTS[:3], completions=[slow, slow, "a, aX"]) == [0.0, 0.0, 1.0]
    assert time.monotonic() - began < 3 * rewards.MATCH_TIMEOUT_S + 1.0
    said = [rec.getMessage() for rec in caplog.records if "took over" in rec.getMessage()]
    assert len(said) == 1 and said[0].startswith("spec.grpo.rewards[0].pattern: a match took")
