"""Multi-turn episodes' sampling on CPU: the episode sampler's kept KV cache against
sampling every turn from an empty cache, in one run on the same model and contexts.

A batch of 4 episodes of 3 turns, each turn `--turn` tokens (no EOS, so every path does
the same decoding) followed by a tool message of `--message` tokens, as the calculator
example samples them: one prompt (its instructions) and 4 episodes of it, a GRPO group
(`--prompts 4`: four prompts, one episode each). SmolLM2-135M-Instruct when converted
under .cache/models, else a tiny random Llama. Timed, after a warm-up batch that compiles:

1. Tunix's sampler from an empty cache each turn, the contexts padded to the longest
   rounded up to 64 tokens (what posttrain's episodes did before the episode sampler);
2. the episode sampler starting every turn over (its whole context prefilled);
3. the episode sampler keeping each episode's cache (only the message prefilled; a
   group's prompt prefilled once).

Prints seconds a batch (the median of `--repeats`), each turn's, and the ratios 1 / 3 and
2 / 3 (goal: > 1; the saving grows with the context a turn carries).

    python bench/agent_turns.py [--turn 36] [--message 15] [--prompts 1] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "trainer")]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import yaml  # noqa: E402

from posttrain.api.spec import GrpoSpec  # noqa: E402
from posttrain.trainer import data, models  # noqa: E402
from posttrain.trainer.agent_rollout import AgentRollout  # noqa: E402
from posttrain.trainer.episode_sampler import EpisodeSampler  # noqa: E402
from posttrain.trainer.tunix_rl import TunixTokenizer  # noqa: E402

EXAMPLE = ROOT / "examples" / "agent-calculator-smollm2-cpu.yaml"
SMOLLM2 = ROOT / ".cache" / "models" / "smollm2-135m-instruct"
ROWS, TURNS, NEVER = 4, 3, -1  # an EOS no token is: every turn runs its whole length


class PinnedIds(TunixTokenizer):
    """Hands Tunix's sampler the token ids kept for a context's key."""

    def __init__(self, tokenizer, max_prompt_length: int):
        super().__init__(tokenizer, max_prompt_length)
        self.pinned: dict[str, list[int]] = {}

    def encode(self, text: str, **kwargs) -> list[int]:
        return list(self.pinned[text])


def tunix_turns(model, tok: PinnedIds, cache_size: int, turn: int):
    """One Tunix sampler for every batch (as GRPO's rollout keeps one): its compiled
    programs are its own."""
    from tunix.generate import sampler as tunix_sampler

    cfg = model.config
    cache = tunix_sampler.CacheConfig(cache_size=cache_size, num_layers=cfg.num_layers,
                                      num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim)  # fmt: skip
    sampler = tunix_sampler.Sampler(model, tok, cache)

    def sample(contexts: list[list[int]], key) -> list[list[int]]:
        keys = [f"episode-{i}" for i in range(len(contexts))]
        tok.pinned = dict(zip(keys, contexts, strict=True))
        width = min(cache_size - turn, -(-max(map(len, contexts)) // 64) * 64)
        out = sampler(keys, max_generation_steps=turn, max_prompt_length=width,
                      temperature=0.8, top_p=1.0, seed=np.asarray(key), eos_tokens=[NEVER])  # fmt: skip
        return [[int(t) for t in row] for row in out.tokens]

    return lambda: sample


def episode_turns(model, cache_size: int, turn: int, pad: int, keep: bool):
    """A new episode sampler for each batch (as each GRPO step starts one)."""

    def start():
        sampler = EpisodeSampler(model, ROWS, cache_size, turn, eos=NEVER, pad=pad,
                                 temperature=0.8)  # fmt: skip
        if not keep:
            sampler.keeps = False
        return sampler.turn

    return start


def batch(sample, prompts: list[list[int]], message: list[int]) -> list[float]:
    """Seconds of each turn of one batch of episodes."""
    contexts = [list(p) for p in prompts]
    seconds = []
    for t in range(TURNS):
        start = time.perf_counter()
        out = sample(contexts, jax.random.PRNGKey(t))
        seconds.append(time.perf_counter() - start)
        contexts = [c + o + message for c, o in zip(contexts, out, strict=True)]
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turn", type=int, default=36)
    parser.add_argument("--message", type=int, default=15)
    parser.add_argument("--prompts", type=int, default=1, choices=(1, 2, 4))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    job = yaml.safe_load(EXAMPLE.read_text())
    g = GrpoSpec.model_validate(job["spec"]["grpo"])
    source = SMOLLM2
    if not (SMOLLM2 / "config.json").is_file():
        from tiny_model import make_tiny_llama

        source = make_tiny_llama(Path(tempfile.mkdtemp()) / "model", hidden=128, layers=4)
    tokenizer = data.load_tokenizer(str(source))
    model, _ = models.load_model(source, dtype=jnp.float32)
    model = models.without_remat(model)
    tok = PinnedIds(tokenizer, g.max_prompt_length)
    agent = AgentRollout(g, tok, None)
    template = tokenizer.template()
    rows = [json.loads(line) for line in (ROOT / job["spec"]["data"]["source"]).open()]
    prompts = [
        agent._prompt_ids(template.render(r["prompt"], add_generation_prompt=True))
        for r in rows[: args.prompts]
    ]
    prompts = [p for p in prompts for _ in range(ROWS // args.prompts)]
    message = list(range(100, 100 + args.message))
    cache_size = g.max_prompt_length + g.max_completion_length + args.turn
    paths = {
        "tunix, empty cache each turn": tunix_turns(model, tok, cache_size, args.turn),
        "episode sampler, starting over": episode_turns(
            model, cache_size, args.turn, tok.pad_id(), keep=False
        ),  # fmt: skip
        "episode sampler, cache kept": episode_turns(
            model, cache_size, args.turn, tok.pad_id(), keep=True
        ),  # fmt: skip
    }
    print(f"{source.name}: {ROWS} episodes of {TURNS} turns of {args.turn} tokens, "
          f"prompts of {[len(p) for p in prompts]} tokens, messages of {args.message}")  # fmt: skip
    results = {}
    for name, start in paths.items():
        batch(start(), prompts, message)  # compiles
        runs = [batch(start(), prompts, message) for _ in range(args.repeats)]
        total = statistics.median(sum(r) for r in runs)
        turns = [statistics.median(r[t] for r in runs) for t in range(TURNS)]
        results[name] = total
        print(f"{name:32s} {total:6.2f} s a batch  turns " + "  ".join(f"{t:.2f}" for t in turns))
    kept = results["episode sampler, cache kept"]
    for name, total in results.items():
        if total is not kept:
            print(f"ratio {name} / cache kept: {total / kept:.2f}")


if __name__ == "__main__":
    main()
