"""GRPO (technique grpo) on Tunix's RL stack, inside posttrain's training loop.

Tunix does the RL work: an ``RLCluster`` (``ClusterConfig``, ``RLTrainingConfig``) holds
the policy, its optimizer and the rollout engine (``vanilla``: Tunix's JAX sampler,
sharing the policy's weights when colocated; on its own mesh when spec.grpo.rollout is
disaggregated, see ``rl_placement``); a ``GRPOLearner`` holds the ``GRPOConfig``
(numGenerations, beta, epsilon, the loss variant of ``rl_losses``: grpo, gspo-token,
dapo, dr-grpo) and the reward manager over ``posttrain.trainer.rewards``; Tunix's
advantage estimators and its registered policy loss (clipped ratio objective plus beta *
KL to the reference) make the update.

posttrain drives each step itself (``loop.run_steps``) rather than calling
``GRPOLearner.train``:

- exact resume: checkpoints hold trainable params, optimizer state and the data
  position (``checkpoint.Checkpoints``); rollouts are seeded from (seed, step, host), so a
  resumed run samples the very completions the uninterrupted run sampled;
- multi-host: the learner's own step builds its arrays from host-local rollouts and
  cannot use them with parameters sharded over other hosts (Tunix's open issue with
  non-addressable arrays). Here every host samples its own prompts' completions on a
  host-local copy of the policy (``HostLocalRollout``: the policy's params gathered with
  ``process_allgather``, refreshed after every update; only the LoRA params when LoRA is
  on), and the per-host results become global arrays for one sharded update;
- the reference model costs nothing extra with LoRA: it is the policy with its adapters
  zeroed, inside the same jitted step. A full fine-tune keeps a frozen copy. beta 0 skips
  the reference entirely.

Completions end with the EOS token when the model stopped (Tunix's sampler drops it), so
stopping is part of what the policy learns. The KL term uses the k3 estimator
(``low_var_kl``, as in the GRPO paper).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from typing import Any

import jax
import numpy as np
from flax import nnx

from posttrain.api.spec import PostTrainJob
from posttrain.trainer import (
    agent_rollout,
    data,
    evaluate,
    grpo_step,
    loop,
    models,
    optim,
    reward_failures,
    rewards,
    rl_losses,
    rl_placement,
)
from posttrain.trainer.distributed import ProcessInfo
from posttrain.trainer.policy import Policy, load_reference
from posttrain.trainer.tunix_rl import (
    TunixTokenizer,
    check_rollout_engine,
    local_mesh,
    make_host_local_rollout_class,
)

log = logging.getLogger("posttrain.grpo")

# Sampling rounds of DAPO's dynamic sampling: the batch's own prompts, then up to this
# many minus one batches of new prompts in place of the groups whose rewards all agree.
DYNAMIC_SAMPLING_ROUNDS = 3

BATCH_KEYS = ("prompt_ids", "completion_ids", "completion_mask", "advantages", "rewards")


def _eos_padded(tokens: list[np.ndarray], length: int, eos: int, pad: int) -> np.ndarray:
    """Completions [n, length], right-padded; EOS appended where the model stopped."""
    out = np.full((len(tokens), length), pad, np.int32)
    mask = np.zeros((len(tokens), length), np.int32)
    for i, t in enumerate(tokens):
        t = list(np.asarray(t, np.int32)[:length])
        if len(t) < length:
            t.append(eos)
        out[i, : len(t)] = t
        mask[i, : len(t)] = 1
    return out, mask


class GrpoRun:
    """The pieces of a GRPO run and its per-step work (rollout, rewards, update)."""

    def __init__(
        self,
        job: PostTrainJob,
        process: ProcessInfo,
        policy: Policy,
        tokenizer: data.Tokenizer,
        mesh: jax.sharding.Mesh,
        *,
        host_local: bool | None = None,
    ):
        from tunix.rl import function_registry
        from tunix.rl import rl_cluster as rlc
        from tunix.rl.grpo import grpo_learner
        from tunix.rl.rollout import base_rollout

        spec = job.spec
        g = spec.grpo
        check_rollout_engine(str(g.rollout_engine))
        self.spec, self.g, self.policy, self.mesh = spec, g, policy, mesh
        self.process = process
        self.tok = TunixTokenizer(tokenizer, g.max_prompt_length)
        self.pad_id, self.eos_id = self.tok.pad_id(), self.tok.eos_id()
        self.reward_fns = rewards.build_rewards(
            g, count_tokens=lambda text: len(tokenizer.encode(text))
        )
        self.reward_names = [fn.__name__ for fn in self.reward_fns]
        # spec.eval.samples: the first held-out prompts' greedy completions, as scored
        self.samples_wanted = spec.eval.samples if spec.eval else 0
        self.eval_samples: list[tuple[str, str]] = []

        # Reference: none (beta 0), the policy with adapters zeroed (LoRA), or a frozen copy.
        self.ref_kind = "none" if g.beta == 0 else ("lora" if spec.lora else "model")
        self.ref_model = None
        if self.ref_kind == "model":
            self.ref_model = load_reference(spec, policy, mesh)

        self.rollout_config = base_rollout.RolloutConfig(
            max_tokens_to_generate=g.max_completion_length,
            max_prompt_length=g.max_prompt_length,
            kv_cache_size=g.max_prompt_length + g.max_completion_length,
            temperature=g.temperature,
            top_p=1.0,
            eos_tokens=[self.eos_id],
        )
        self.agent = None  # spec.grpo.agent: multi-turn episodes with tools
        if g.agent:
            template = tokenizer.template(spec.data.chat_template)
            self.agent = agent_rollout.AgentRollout(g, self.tok, template and template.source)
        cfg = policy.model.config
        cache_config = base_rollout.CacheConfig(
            cache_size=self.rollout_config.kv_cache_size,
            num_layers=cfg.num_layers,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
        )
        # One process: the sampler shares the policy's weights. Several: each host samples
        # on a host-local replica (see HostLocalRollout). host_local forces either (tests).
        if host_local is None:
            host_local = process.multi_process or jax.process_count() > 1
        self.host_local = host_local
        rollout_mesh = mesh
        engine: Any = str(g.rollout_engine)
        # Disaggregated: the sampler's own mesh, on devices the trainer's mesh lacks. Tunix
        # reshards a copy of the policy onto it (role_to_mesh) and update_params feeds it.
        _, sampler_devices = rl_placement.split_devices(spec)
        self.sampler_mesh = None
        if sampler_devices:
            if set(sampler_devices) & rl_placement.devices_of(nnx.state(policy.model)):
                raise ValueError(
                    "spec.grpo.rollout: the policy was loaded on the sampler's devices; load "
                    "it on the trainer's mesh (rl_placement.split_devices)"
                )
            self.sampler_mesh = rollout_mesh = models.make_mesh(devices=sampler_devices)
            self.host_local = False
        elif self.host_local:
            rollout_mesh = local_mesh()
            engine = functools.partial(make_host_local_rollout_class(), cache_config=cache_config)
        training_config = rlc.RLTrainingConfig(
            actor_optimizer=optim.optimizer(spec.training),
            eval_every_n_steps=10**9,
            max_steps=spec.training.steps,
        )
        cluster_config = rlc.ClusterConfig(
            role_to_mesh={
                rlc.Role.ACTOR: mesh,
                rlc.Role.REFERENCE: mesh,
                rlc.Role.ROLLOUT: rollout_mesh,
            },
            rollout_engine=engine,
            training_config=training_config,
            rollout_config=self.rollout_config,
        )
        with jax.set_mesh(mesh):
            self.cluster = rlc.RLCluster(
                # The sampler's model (and what Tunix copies onto a sampler mesh or a host)
                # does not rematerialise: Tunix's sampler cannot run nnx.remat, and
                # generation has no backward pass. The view holds the policy's Variables,
                # which the train step (on policy.model, rematerialised) updates.
                actor=models.without_remat(policy.model),
                reference=None,  # computed in the train step (see module docstring)
                tokenizer=self.tok,
                cluster_config=cluster_config,
            )
            self.algo_config = rl_losses.algo_config(g, grpo_learner.GRPOConfig)
            self.variant = rl_losses.VARIANTS[str(g.loss_algorithm)]
            self.learner = grpo_learner.GRPOLearner(
                rl_cluster=self.cluster,
                algo_config=self.algo_config,
                reward_fns=self.reward_fns,
            )
        # The learner sets algo_config.temperature from the rollout config.
        self.advantages = function_registry.get_advantage_estimator(
            self.algo_config.advantage_estimator
        )
        # The vanilla sampler on the policy's mesh holds the policy's own nnx Variables:
        # updates reach it.
        self.shares_weights = engine == "vanilla" and rollout_mesh is mesh
        self.max_staleness = g.max_staleness
        self.sampler_lock = threading.Lock()  # one generate at a time (rollouts, eval)
        self.weight_sync_seconds = 0.0
        self.loader: Any = None  # rl_placement.Lookahead, set by train()
        self.async_rollouts: rl_placement.AsyncRollouts | None = None
        if self.sampler_mesh is not None:
            sampler_model = self.cluster.rollout.model()
            self._sampler_shardings = jax.tree.map(
                lambda x: x.sharding, nnx.state(sampler_model, policy.wrt)
            )
            self._behaviour = grpo_step.behaviour_logps_fn(
                self.pad_id, self.eos_id, float(self.algo_config.temperature)
            )
            self.async_rollouts = rl_placement.AsyncRollouts(
                max_staleness=g.max_staleness,
                every_steps=spec.checkpoint.every_steps,
                total_steps=spec.training.steps,
                snapshot=self.snapshot,
                generate=self._generate_on_sampler,
                lock=self.sampler_lock,
            )
        # RLCluster keeps a host copy of the whole policy for Tunix's off-policy
        # correction, which this loop does not use (num_iterations 1): free it.
        self.cluster._anchor_policy_state = None
        self.opt = self.cluster.actor_trainer.optimizer
        self.train_step = grpo_step.make_train_step(
            policy.wrt,
            self.algo_config,
            self.pad_id,
            self.eos_id,
            spec.training.gradient_accumulation,
            self.ref_kind,
        )
        self.zero_advantage_step = (
            grpo_step.make_zero_advantage_step(policy.wrt) if g.beta == 0 else None
        )
        self.batch_keys = BATCH_KEYS + (("behaviour_logps",) if g.max_staleness else ())

    # ---------------------------------------------------------------- per step

    def sync_rollout(self) -> None:
        """Give the rollout engine the policy's current trainable params."""
        if self.shares_weights:
            return
        wrt = self.policy.wrt
        start = time.monotonic()
        self.cluster.rollout.update_params(nnx.state(self.policy.model, wrt), (wrt,))
        self.weight_sync_seconds = time.monotonic() - start

    def snapshot(self) -> nnx.State:
        """The policy's trainable params (only the adapters under LoRA), copied onto the
        sampler's devices: what a weight sync moves."""
        return jax.device_put(
            nnx.state(self.policy.model, self.policy.wrt), self._sampler_shardings
        )

    def _generate_on_sampler(
        self, index: int, host_batch: dict[str, np.ndarray], snapshot: nnx.State
    ) -> dict[str, np.ndarray]:
        """On the sampler thread: load `snapshot` into the sampler, sample step `index`'s
        rollouts, and (asynchronous rollouts) the sampling policy's log-probs."""
        self.cluster.rollout.update_params(snapshot, (self.policy.wrt,))
        rolled = self._rollout(host_batch, index)
        if self.max_staleness:
            replicated = jax.sharding.NamedSharding(self.sampler_mesh, jax.sharding.PartitionSpec())
            logps = self._behaviour(
                self.cluster.rollout.model(),
                jax.device_put(rolled["prompt_ids"], replicated),
                jax.device_put(rolled["completion_ids"], replicated),
            )
            rolled["behaviour_logps"] = np.asarray(logps, np.float32)
        return rolled

    def rollout(self, host_batch: dict[str, np.ndarray], index: int) -> dict[str, np.ndarray]:
        """Sample numGenerations completions of this host's prompts and score them (with
        DAPO's dynamic sampling, `_refill`)."""
        self.sync_rollout()
        return self._rollout(host_batch, index)

    def _rollout(self, host_batch: dict[str, np.ndarray], index: int) -> dict[str, np.ndarray]:
        G = self.g.num_generations
        # Seeded by (seed, step, host): a resumed run samples what the first run sampled.
        key = jax.random.PRNGKey(self.spec.training.seed)
        key = jax.random.fold_in(jax.random.fold_in(key, index), self.process.process_id)
        sample = self._sample(host_batch, key)
        if self.variant.dynamic_sampling:
            sample = self._refill(sample, index, key)
        std = self.variant.advantage_estimator == "grpo"  # dr-grpo's has no std
        sample = reward_failures.drop_unscored(sample, G, std, self.advantages)
        self.last_texts = sample.pop("texts")
        return sample

    def _refill(self, sample: dict, index: int, key: jax.Array) -> dict:
        """DAPO's dynamic sampling: the groups whose rewards all agree teach nothing and
        are dropped; new prompts (`DataLoader.draw`, seeded by the seed, step and round)
        are sampled in their place, up to DYNAMIC_SAMPLING_ROUNDS rounds in all. Groups
        still missing then are filled with dropped ones, which carry zero advantage."""
        G = self.g.num_generations
        groups = len(sample["total"]) // G
        kept, dropped, drawn = [], [], 0
        for attempt in range(DYNAMIC_SAMPLING_ROUNDS):
            if attempt:
                extra = self.loader.draw((self.spec.training.seed, index, attempt))
                drawn += len(extra["prompts"])
                sample = self._sample(extra, jax.random.fold_in(key, 10_000 + attempt))
            informative = rl_losses.informative_groups(reward_failures.scored_total(sample), G)
            kept += [_group(sample, g, G) for g in np.flatnonzero(informative)]
            dropped += [_group(sample, g, G) for g in np.flatnonzero(~informative)]
            if len(kept) >= groups:
                break
        chosen = (kept + dropped)[:groups]
        out = {k: np.concatenate([c[k] for c in chosen]) for k in chosen[0]}
        out["groups_dropped"] = np.int32(len(dropped))
        out["prompts_drawn"] = np.int32(drawn)
        return out

    def _sample(self, host_batch: dict[str, np.ndarray], key: jax.Array) -> dict:
        """numGenerations completions of each of the batch's prompts sampled with `key`,
        scored."""
        G = self.g.num_generations
        prompts = [str(p) for p in host_batch["prompts"]]
        answers = np.asarray(host_batch["answer"], dtype=object)
        repeated = [str(p) for p in prompts for _ in range(G)]
        # As host data: under the global mesh a device key would carry that mesh into the
        # host-local sampler.
        self.rollout_config.seed = np.asarray(key)
        if self.agent is not None:
            out = self._episodes(repeated, key, self.g.temperature)
            completion_ids, completion_mask = out.completion_ids, out.completion_mask
        else:
            out = self.cluster.generate(repeated)
            completion_ids, completion_mask = _eos_padded(
                out.tokens, self.g.max_completion_length, self.eos_id, self.pad_id
            )
        info = self.learner.reward_manager(
            prompts=repeated,
            completions=out.text,
            answer=np.repeat(answers, G),
            completion_tokens=[len(t) for t in out.tokens],
            mode="train",
            **self._episode_columns(out),
        )
        parts = np.stack(
            [
                np.asarray(info["log_metrics"][f"rewards/{n}"][0], np.float32)
                for n in self.reward_names
            ],
            axis=-1,
        )
        return {
            "prompt_ids": np.asarray(out.left_padded_prompt_tokens, np.int32),
            "completion_ids": completion_ids,
            "completion_mask": completion_mask,
            "rewards": parts,
            "total": np.asarray(info["rewards"], np.float32),
            "texts": np.asarray(out.text, dtype=object),
            **getattr(out, "per_episode", {}),
        }

    def _episodes(self, prompts: list[str], key: Any, temperature: float | None) -> Any:
        """spec.grpo.agent's episodes of `prompts` on the sampler's model (greedy without
        a temperature)."""
        model = self.cluster.rollout.model()
        return self.agent.run(prompts, key, self.agent.sampler(model, len(prompts), temperature))

    def _episode_columns(self, out: Any) -> dict[str, list[str]]:
        """The reward functions' column of episodes' last model turns (spec.grpo.agent)."""
        return {"final_turn": out.final_turn} if self.agent is not None else {}

    def evaluate(self, host_batch: dict[str, np.ndarray]) -> dict[str, float]:
        """Greedy completions of held-out prompts, scored by spec.grpo.rewards: the summed
        reward, the prompts that passed (every reward but lengthPenalty positive) and the
        prompt count, over all hosts (each generates for its own prompts)."""
        prompts = [str(p) for p in host_batch["prompts"]]
        with self.sampler_lock:  # the sampler thread loads its own version before sampling
            self.sync_rollout()
            config = self.rollout_config
            saved = config.top_k, config.seed
            config.top_k, config.seed = 1, np.asarray(jax.random.PRNGKey(0))  # greedy
            try:
                # The loop runs under the trainer's mesh; a disaggregated sampler's own.
                with jax.set_mesh(self.sampler_mesh or self.mesh):
                    if self.agent is not None:
                        out = self._episodes(prompts, config.seed, None)
                    else:
                        out = self.cluster.generate(prompts)
            finally:
                config.top_k, config.seed = saved
        wanted = self.samples_wanted - len(self.eval_samples)
        self.eval_samples += list(zip(prompts, out.text, strict=True))[: max(wanted, 0)]
        columns = {
            "answer": list(host_batch["answer"]),
            "completion_tokens": [len(t) for t in out.tokens],
            **self._episode_columns(out),
        }
        parts = {
            fn.__name__: np.asarray(fn(prompts=prompts, completions=out.text, **columns))
            for fn in self.reward_fns
        }
        gates = [v > 0 for name, v in parts.items() if not name.startswith("lengthPenalty")]
        total = np.nansum(list(parts.values()), axis=0)  # NaN: a service gave none
        passed = np.all(gates, axis=0) if gates else total > 0
        return evaluate.across_hosts(
            {"reward": float(total.sum()), "passed": float(passed.sum()), "prompts": len(prompts)}
        )

    def scored_samples(self) -> list[tuple[str, str]]:
        """The last evaluation's samples (spec.eval.samples): (prompt, greedy completion)
        of its first prompts, the very completions it scored."""
        samples, self.eval_samples = self.eval_samples, []
        return samples

    def __call__(self, host_batch: dict[str, np.ndarray], index: int) -> dict[str, Any]:
        if self.async_rollouts is not None:
            return self._disaggregated_step(host_batch, index)
        # The sampler reads the weights the last step wrote: wait for them first, so that
        # rollout_seconds is this step's sampling and scoring, not the last step's learner.
        jax.block_until_ready(nnx.state(self.policy.model, self.policy.wrt))
        start = time.monotonic()
        rolled = self.rollout(host_batch, index)
        rollout_seconds = time.monotonic() - start
        batch = loop._global_batch(rolled, self.mesh, BATCH_KEYS)
        out = self._update(batch, rolled)
        out["rollout_seconds"] = rollout_seconds
        return self._named(out, rolled)

    def _disaggregated_step(self, host_batch: dict[str, np.ndarray], index: int) -> dict:
        """Train on step `index`'s rollout (sampled on the sampler mesh, up to
        maxStaleness versions ago), then hand the sampler the new version's weights."""
        rollouts = self.async_rollouts

        def batch_at(step: int) -> dict[str, np.ndarray]:
            return host_batch if step == index else self.loader.peek(step - index)

        if rollouts.start is None:
            rollouts.begin(index, batch_at)
        rolled, version = rollouts.take(index)
        batch = loop._global_batch(rolled, self.mesh, self.batch_keys)
        start = time.monotonic()
        out = self._update(batch, rolled)
        jax.block_until_ready(out)
        rollouts.trained(start, time.monotonic())
        rollouts.submit_due(index + 1, batch_at)
        out["staleness"] = index - version
        out.update(rollouts.metrics())
        return self._named(out, rolled)

    def _update(self, batch: dict[str, jax.Array], rolled: dict[str, Any]) -> dict[str, Any]:
        """The step's update. One whose rollouts all have zero advantage, on every host
        (every group's rewards agreed: nothing to learn), is `grpo_step.make_zero_advantage_step`'s
        when there is no KL term, and says so (`zero_advantage`)."""
        nonzero = float(np.count_nonzero(rolled["advantages"]))
        zero = evaluate.across_hosts({"nonzero": nonzero})["nonzero"] == 0
        skip = zero and self.zero_advantage_step is not None
        step = self.zero_advantage_step if skip else self.train_step
        out = dict(step(self.policy.model, self.opt, self.ref_model, batch))
        out["zero_advantage"] = float(zero)
        return out

    def close(self) -> None:
        if self.async_rollouts is not None:
            self.async_rollouts.close()

    def _named(self, out: dict[str, Any], rolled: dict[str, Any]) -> dict[str, Any]:
        for name in ("groups_dropped", "prompts_drawn", "reward_failures"):
            if name in rolled:
                out[name] = rolled[name]
        out.update(reward_failures.service_seconds(self.reward_fns))
        out.update(agent_rollout.step_metrics(rolled))
        parts = out.pop("reward_parts")
        for j, name in enumerate(self.reward_names):
            out[f"reward/{name}"] = parts[j]
        return out


def _group(sample: dict[str, np.ndarray], g: int, size: int) -> dict[str, np.ndarray]:
    """Prompt group g of a sample: its rows g x size to (g + 1) x size."""
    return {k: v[g * size : (g + 1) * size] for k, v in sample.items()}


def check(spec: Any) -> None:
    """What a GRPO job got wrong, before anything loads."""
    if spec.grpo is None:
        raise ValueError("spec.grpo: technique grpo needs a spec.grpo block with rewards")
    check_rollout_engine(str(spec.grpo.rollout_engine))
    rewards.build_rewards(spec.grpo)  # a reward the user got wrong fails before any loading


def train(run: loop.RunSetup) -> loop.Result:
    """GRPO for spec.training.steps steps of spec.training.batchSize prompts (each with
    spec.grpo.numGenerations completions), resuming from the newest checkpoint."""
    grpo_run = GrpoRun(run.job, run.process, run.policy, run.tokenizer, run.mesh)
    run.loader = grpo_run.loader = rl_placement.Lookahead(run.loader)
    try:
        # A held-out batch is as many prompts as a step samples rows (one greedy rollout
        # each): the sampler runs at the shape it compiled for training.
        eval_rows = run.job.spec.training.batch_size * run.job.spec.grpo.num_generations
        return run.train(
            grpo_run.opt,
            grpo_run,
            grpo_run.evaluate,
            reward_summary,
            eval_rows,
            grpo_run.scored_samples,
        )
    finally:
        grpo_run.close()


def reward_summary(sums: dict[str, float]) -> dict[str, float]:
    """Held-out mean reward and pass rate of greedy completions (GrpoRun.evaluate)."""
    prompts = max(sums["prompts"], 1.0)
    return {"mean_reward": sums["reward"] / prompts, "pass_rate": sums["passed"] / prompts}
