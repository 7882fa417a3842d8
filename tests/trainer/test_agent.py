"""Multi-turn GRPO episodes with tools (spec.grpo.agent): tool calls read in each chat
family's format, the tools (the calculator, an http tool against a real HTTP server,
a Python function) with their failures given to the model as results and counted, the
episode loop's token bookkeeping (only the model's tokens carry loss), and a tiny GRPO
job with tools and a verifier run through `posttrain run`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import yaml
from data_helpers import make_tokenizer_dir
from tb_events import scalars
from tool_server import ToolServer
from verifier_server import VerifierServer

from posttrain.api.spec import AgentSpec, GrpoSpec
from posttrain.trainer import tool_calls
from posttrain.trainer.agent_rollout import AgentRollout, step_metrics
from posttrain.trainer.data.tokenizer import load_tokenizer
from posttrain.trainer.tool_calls import Call
from posttrain.trainer.tools import Toolbox
from posttrain.trainer.tunix_rl import TunixTokenizer

TOKEN = "tool-token-1234"
CALC = {"name": "calc", "type": "calculator"}


def capital_of(country: str) -> str:
    """A Python tool for the tests (spec.grpo.agent.tools[].function 'test_agent:...')."""
    return {"France": "Paris"}[country]


def agent(*tools: dict, **settings) -> AgentSpec:
    return AgentSpec.model_validate({"maxTurns": 3, "tools": list(tools), **settings})


# ------------------------------------------------------------------ formats


def test_chatml_calls_and_malformed_ones():
    fmt = tool_calls.FORMATS["chatml"]
    text = (
        'Let me add. <tool_call>{"name": "calc", "arguments": {"a": 2, "b": 3, "op": "+"}}'
        '</tool_call> and <tool_call>{"name": "calc", "arguments": [1]}</tool_call>'
        "<tool_call>not json"
    )
    first, second, third = fmt.parse(text)
    assert first == Call("calc", {"a": 2, "b": 3, "op": "+"})
    assert second.name == "calc" and "must be a JSON object" in second.error
    assert third.name == "" and third.error.startswith("malformed tool call")
    assert fmt.parse("The answer is 5.") == []
    assert fmt.result_turn(["5"]) == (
        "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_llama3_and_gemma_calls():
    llama = tool_calls.FORMATS["llama3"]
    (call,) = llama.parse('{"name": "calc", "parameters": {"a": 1, "b": 2, "op": "*"}}')
    assert call == Call("calc", {"a": 1, "b": 2, "op": "*"})
    assert llama.parse("It is 2.") == []
    assert "ipython" in llama.result_turn(["2"])
    gemma = tool_calls.FORMATS["gemma"]
    fence = "`" * 3
    (call,) = gemma.parse(f'{fence}tool_code\ncalc(a=4, b=0.5, op="/")\n{fence}')
    assert call == Call("calc", {"a": 4, "b": 0.5, "op": "/"})
    (bad,) = gemma.parse(f"{fence}tool_code\ncalc(__import__('os'))\n{fence}")
    assert bad.name == "calc" and "given by name" in bad.error  # nothing is evaluated
    (bad,) = gemma.parse(f"{fence}tool_code\ncalc(a=open('x'))\n{fence}")
    assert bad.error.startswith("malformed tool call")


def test_the_format_comes_from_the_chat_template():
    assert tool_calls.detect("{{'<|im_start|>' + m.role}}").name == "chatml"
    assert tool_calls.detect("<|start_header_id|>{{ role }}").name == "llama3"
    assert tool_calls.detect("<start_of_turn>user").name == "gemma"
    with pytest.raises(ValueError, match="spec.grpo.agent.toolFormat: auto cannot tell"):
        tool_calls.detect("[INST] {{ content }} [/INST]")


def test_tool_instructions_go_where_each_family_reads_them():
    chatml = tool_calls.FORMATS["chatml"].with_tools("<|im_start|>user\nhi<|im_end|>\n", "TOOLS")
    assert chatml == "<|im_start|>system\nTOOLS<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
    llama = tool_calls.FORMATS["llama3"].with_tools("<|begin_of_text|><|start_header_id|>u", "T")
    assert llama.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nT")
    gemma = tool_calls.FORMATS["gemma"].with_tools("<bos><start_of_turn>user\nhi", "T")
    assert gemma == "<bos><start_of_turn>user\nT\n\nhi"


# ------------------------------------------------------------------ tools


def test_tools_run_and_their_failures_are_results_counted():
    with ToolServer(TOKEN) as server:
        box = Toolbox(
            agent(
                CALC,
                {
                    "name": "capital",
                    "type": "http",
                    "description": "The capital of a country.",
                    "parameters": {"type": "object", "properties": {"country": {"type": "string"}}},
                    "http": {"url": f"{server.base}/capital", "authSecret": {"name": "tools"}},
                },
                {
                    "name": "slow",
                    "type": "http",
                    "description": "d",
                    "parameters": {"type": "object"},
                    "http": {"url": f"{server.base}/slow", "timeoutSeconds": 0.2, "retries": 0},
                },
                {
                    "name": "binary",
                    "type": "http",
                    "description": "d",
                    "parameters": {"type": "object"},
                    "http": {"url": f"{server.base}/binary", "retries": 0},
                },
                {
                    "name": "capital_py",
                    "type": "python",
                    "description": "d",
                    "parameters": {"type": "object"},
                    "function": "test_agent:capital_of",
                },
            ),
            environ={"POSTTRAIN_TOOL_CAPITAL_AUTH": TOKEN},
        )
        assert box.run(Call("calc", {"a": 6, "b": 7, "op": "*"})) == "42"
        assert box.run(Call("capital", {"country": "Japan"})) == "Tokyo"
        assert server.requests[-1]["auth"] == f"Bearer {TOKEN}"
        assert box.run(Call("capital_py", {"country": "France"})) == "Paris"
        assert (box.calls, box.errors) == (3, 0)
        results = [
            box.run(Call("calc", {"a": 1, "b": 0, "op": "/"})),
            box.run(Call("slow", {})),
            box.run(Call("binary", {})),
            box.run(Call("capital_py", {"country": "Mars"})),
            box.run(Call("capital_py", {"planet": "Mars"})),
            box.run(Call("search", {})),
            box.run(Call("", error="malformed tool call (x)")),
        ]
    assert results[0] == "error: Division by zero is not allowed"
    assert results[1].startswith("error: ") and "timed out" in results[1]
    assert results[2] == "error: the tool's answer is not UTF-8 text"
    assert results[3] == "error: KeyError: 'Mars'"
    assert results[4].startswith("error: TypeError: ")
    assert results[5].startswith("error: no tool named 'search' (tools: binary, calc,")
    assert results[6] == "error: malformed tool call (x)"
    assert box.take_counts() == (10, 7) and box.take_counts() == (0, 0)


def test_an_http_tool_without_its_secret_variable_names_the_field():
    spec = agent(
        {
            "name": "capital",
            "type": "http",
            "description": "d",
            "parameters": {"type": "object"},
            "http": {"url": "http://127.0.0.1:1/c", "authSecret": {"name": "tools", "key": "k"}},
        }
    )
    with pytest.raises(ValueError, match=r"spec.grpo.agent.tools\[0\].http.authSecret: the "
                       r"trainer has no POSTTRAIN_TOOL_CAPITAL_AUTH"):  # fmt: skip
        Toolbox(spec, environ={})


def test_a_python_tool_from_the_standard_library_is_refused():
    spec = agent(
        {
            "name": "shell",
            "type": "python",
            "description": "d",
            "parameters": {"type": "object"},
            "function": "os:system",
        }
    )
    with pytest.raises(ValueError, match=r"tools\[0\].function: .*Python's own os module"):
        Toolbox(spec, environ={})


# ------------------------------------------------------------------ episodes


class ScriptedPolicy:
    """Stands in for the sampler: writes the turns a test scripts for each episode (each
    ended by its EOS), and keeps the token ids of every context it was given."""

    def __init__(self, tok: TunixTokenizer, script: list[list[str]]):
        self.tok, self.script, self.contexts = tok, script, []

    def turn(self, contexts, key):
        self.contexts.append(contexts)
        turn = len(self.contexts) - 1
        texts = [s[turn] if turn < len(s) else "" for s in self.script]
        eos = [self.tok.eos_id()]
        return [[] if c is None else self.tok.tokenizer.encode(t) + eos
                for c, t in zip(contexts, texts, strict=True)]  # fmt: skip


def test_episodes_call_tools_and_only_the_models_tokens_carry_loss(tmp_path):
    tokenizer = load_tokenizer(str(make_tokenizer_dir(tmp_path / "tok")))
    g = GrpoSpec.model_validate(
        {
            "maxPromptLength": 1200,
            "maxCompletionLength": 200,
            "rewards": [{"type": "exactAnswer"}],
            "agent": {"maxTurns": 3, "tools": [CALC], "turnLength": 100},
        }
    )
    tok = TunixTokenizer(tokenizer, g.max_prompt_length)
    rollout = AgentRollout(g, tok, tokenizer.chat_template, environ={})
    call = '<tool_call>{"name": "calc", "arguments": {"a": 6, "b": 7, "op": "*"}}</tool_call>'
    policy = ScriptedPolicy(
        tok,
        [
            [call, "It is 42."],  # calls, then answers
            ['<tool_call>{"name": "web"}</tool_call>', "No."],  # an unknown tool
            ["7"],  # answers at once
        ],
    )
    prompt = "<|im_start|>user\nWhat is 6 x 7?<|im_end|>\n<|im_start|>assistant\n"
    out = rollout.run([prompt] * 3, np.array([0, 1], np.uint32), policy)

    eos = tok.eos_id()
    enc = tokenizer.encode
    turn1 = enc(call) + [eos]
    tool = enc(tool_calls.FORMATS["chatml"].result_turn(["42"]))
    turn2 = enc("It is 42.") + [eos]
    ids = out.completion_ids[0][: len(turn1 + tool + turn2)].tolist()
    assert ids == turn1 + tool + turn2
    assert out.completion_mask[0].tolist() == (
        [1] * len(turn1) + [0] * len(tool) + [1] * len(turn2) + [0] * (200 - len(ids))
    )
    assert out.tokens[0] == turn1 + turn2  # the model's own tokens
    # The second turn saw exactly the first turn's tokens and the tool message after the
    # prompt (with the tools' instructions): token ids, not text encoded again.
    first_context = policy.contexts[0][0]
    assert policy.contexts[1][0] == first_context + turn1 + tool
    assert "# Tools" in tokenizer.decode(first_context) and "calc" in tokenizer.decode(
        first_context
    )
    assert out.text[0].endswith("42\n</tool_response>\nassistant\nIt is 42.")
    assert out.final_turn == ["It is 42.", "No.", "7"]  # what exactAnswer reads
    assert "error: no tool named 'web' (tools: calc)" in out.text[1]
    assert out.completion_mask[2].sum() == len(enc("7")) + 1  # one turn, no tools
    assert len(policy.contexts) == 2  # episode 0 and 1 took two turns; nobody a third
    assert policy.contexts[1][2] is None  # episode 2 ended after one turn
    assert out.per_episode["episode_turns"].tolist() == [2, 2, 1]
    assert out.per_episode["episode_tool_errors"].tolist() == [0, 1, 0]
    assert step_metrics(out.per_episode) == {
        "turns": 5 / 3,
        "tool_calls": 2.0,
        "tool_errors": 1.0,
        "well_formed_calls": 1 / 3,  # episode 0; episode 1's call failed, 2 made none
    }
    assert out.left_padded_prompt_tokens.shape == (3, 1200)
    assert out.left_padded_prompt_tokens[0, -len(first_context) :].tolist() == first_context


def test_an_episode_stops_at_its_token_budget(tmp_path):
    tokenizer = load_tokenizer(str(make_tokenizer_dir(tmp_path / "tok")))
    g = GrpoSpec.model_validate(
        {
            "maxPromptLength": 400,
            "maxCompletionLength": 40,
            "rewards": [{"type": "exactAnswer"}],
            "agent": {"maxTurns": 5, "tools": [CALC]},
        }
    )
    tok = TunixTokenizer(tokenizer, g.max_prompt_length)
    rollout = AgentRollout(g, tok, tokenizer.chat_template, environ={})
    call = '<tool_call>{"name": "calc", "arguments": {"a": 1, "b": 1, "op": "+"}}</tool_call>'
    policy = ScriptedPolicy(tok, [[call] * 5])
    out = rollout.run(["<|im_start|>user\nHi<|im_end|>\n"], np.array([0, 2], np.uint32), policy)
    assert out.completion_ids.shape == (1, 40) and out.completion_mask.shape == (1, 40)
    assert len(policy.contexts) == 1  # the first turn and its tool message fill the budget
    assert (out.completion_ids[0] != tok.pad_id()).all()


def test_a_jobs_own_instructions_replace_the_standard_text(tmp_path):
    tokenizer = load_tokenizer(str(make_tokenizer_dir(tmp_path / "tok")))
    own = 'Call calc as <tool_call>{"name": "calc", "arguments": {"a": 1, "b": 2, "op": "+"}}</tool_call>.'
    contexts = {}
    for name, agent in [("standard", {}), ("own", {"instructions": own})]:
        g = GrpoSpec.model_validate(
            {
                "maxPromptLength": 1200,
                "maxCompletionLength": 40,
                "rewards": [{"type": "exactAnswer"}],
                "agent": {"maxTurns": 2, "tools": [CALC], **agent},
            }
        )
        tok = TunixTokenizer(tokenizer, g.max_prompt_length)
        rollout = AgentRollout(g, tok, tokenizer.chat_template, environ={})
        policy = ScriptedPolicy(tok, [["7"]])
        rollout.run(["<|im_start|>user\nHi<|im_end|>\n"], np.array([0, 3], np.uint32), policy)
        contexts[name] = tokenizer.decode(policy.contexts[0][0])
    assert (
        contexts["own"] == f"<|im_start|>system\n{own}<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    )
    assert "# Tools" in contexts["standard"] and "# Tools" not in contexts["own"]
    with pytest.raises(ValueError, match="instructions"):
        GrpoSpec.model_validate(
            {"rewards": [{"type": "exactAnswer"}],
             "agent": {"maxTurns": 2, "tools": [CALC], "instructions": ""}}
        )  # fmt: skip


# ------------------------------------------------------------------ posttrain run


@pytest.mark.trainer
def test_posttrain_run_of_episodes_with_tools_and_a_verifier(tmp_path):
    """A tiny GRPO job with a calculator and an http tool, scored by a verifier, runs
    through `posttrain run`; TensorBoard has turns, tool calls and tool errors a step, and
    eval.json's samples are the greedy episodes the evaluation had scored."""
    from tiny_model import make_tiny_llama

    model = make_tiny_llama(tmp_path / "model")
    prompts = tmp_path / "math.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"prompt": f"What is {a} + {b}?", "answer": str(a + b)}) + "\n"
            for a in range(4)
            for b in range(4)
        )
    )
    with ToolServer() as tools, VerifierServer() as verifier:
        spec = {
            "technique": "grpo",
            "model": {"source": str(model), "dtype": "float32"},
            "data": {"source": str(prompts)},
            "training": {"steps": 2, "batchSize": 2, "learningRate": 0.002, "logEverySteps": 1},
            "grpo": {
                "numGenerations": 2,
                "beta": 0.0,
                "maxPromptLength": 1200,
                "maxCompletionLength": 24,
                "rewards": [{"type": "http", "http": {"url": verifier.url}}],
                "agent": {
                    "maxTurns": 2,
                    "turnLength": 8,
                    "tools": [
                        CALC,
                        {
                            "name": "capital",
                            "type": "http",
                            "description": "The capital of a country.",
                            "parameters": {"type": "object"},
                            "http": {"url": f"{tools.base}/capital"},
                        },
                    ],
                },
            },
            "eval": {"fraction": 0.25, "samples": 2},  # 4 prompts, at the end
            "checkpoint": {"everySteps": 1000},
            "output": {"uri": str(tmp_path / "out"), "exportHF": "none"},
        }
        doc = {"apiVersion": "posttrain.dev/v1alpha1", "kind": "PostTrainJob"}
        doc |= {"metadata": {"name": "agent"}, "spec": spec}
        job = tmp_path / "job.yaml"
        job.write_text(yaml.safe_dump(doc))
        run = subprocess.run(
            [sys.executable, "-m", "posttrain.cli", "run", str(job)],
            capture_output=True,
            text=True,
            env={**os.environ, "JAX_PLATFORMS": "cpu"},
            timeout=600,
        )
        assert run.returncode == 0, run.stdout + run.stderr
        items = [i for r in verifier.behaviour.requests for i in r["items"]]
    assert len(items) == 2 * 2 * 2 + 4  # every episode of both steps, and the 4 held out
    # The samples are the first held-out episodes as the verifier scored them.
    samples = json.loads((tmp_path / "out" / "eval.json").read_text())[-1]["samples"]
    scored = [(i["prompt"], i["completion"]) for i in items[-4:]]
    assert [(s["prompt"], s["completion"]) for s in samples] == scored[:2]
    tb = scalars(tmp_path / "out" / "tensorboard")
    for name in ("turns", "tool_calls", "tool_errors", "reward_failures"):
        assert sorted(tb[f"train/{name}"]) == [1, 2], name
    assert all(1 <= t <= 2 for t in tb["train/turns"].values())
    # The verifier saw the episodes' text after the prompt, not the prompt again.
    assert all("# Tools" not in i["completion"] for i in items)
    assert all(i["prompt"].startswith("<|im_start|>") or "What is" in i["prompt"] for i in items)


def test_status_progress_carries_episode_and_verifier_metrics():
    """status.progress.rollout (validated by the status schema) has the step's turns,
    tool calls and errors, and the verifier's failures and time."""
    from posttrain.api.spec import Progress as ProgressStatus
    from posttrain.trainer.progress import Progress

    class Status:
        patches: list = []

        def patch(self, progress):
            self.patches.append(progress)

    status = Status()
    progress = Progress(2, 0, True, None, status, show_bar=False)
    metrics = {"loss": 0.0, "reward": 0.5, "turns": 1.5, "tool_calls": 3.0, "tool_errors": 1.0}
    metrics |= {"reward_failures": 2.0, "reward_service_seconds": 0.25}
    progress.step(2, metrics, log_now=True)
    (patch,) = status.patches
    assert patch["rollout"] == {
        "turns": 1.5,
        "toolCalls": 3.0,
        "toolErrors": 1.0,
        "rewardFailures": 2.0,
        "rewardServiceSeconds": 0.25,
    }
    assert ProgressStatus.model_validate(patch).rollout["toolErrors"] == 1.0
    progress.close(2, metrics)


def test_well_formed_calls_is_the_share_of_episodes_whose_calls_all_ran():
    """train/well_formed_calls: an episode counts when it made a call and none of its
    calls failed (malformed, an unknown tool, a tool's error); one without calls does not."""
    per_episode = {
        "episode_turns": np.array([2, 3, 1, 2]),
        "episode_tool_calls": np.array([1, 2, 0, 2]),
        "episode_tool_errors": np.array([0, 0, 0, 1]),
    }
    metrics = step_metrics(per_episode)
    assert metrics["well_formed_calls"] == 0.5
    assert metrics["tool_calls"] == 5.0 and metrics["tool_errors"] == 1.0
    assert step_metrics({}) == {}  # single-turn GRPO: no episode metrics
