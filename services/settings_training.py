"""The settings of how a job trains and runs: PPO and its estimators, the KL controller, the cluster's
resources, the learner (LoRA included), the run, its metrics and checkpoints. Sections of
``services.config.JobConfig``, which checks the rules across them."""

from __future__ import annotations

import warnings
from typing import Any, Literal

from pydantic import Field, PositiveFloat, PositiveInt, model_validator

from services.choices import GRPO_TOKEN_K3_WARNING, LossForm
from services.settings_sampling import Section

# vLLM's max_lora_rank takes these (vllm.config.lora.MaxLoRARanks; tests/test_lora.py checks): an engine that
# takes LoRA adapters starts with the smallest one at least learner.lora.rank
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)

# a policy this large is a pretrained model, not a task's small model trained from scratch (the embedded
# randomwalks GPT-2 has about 1M parameters)
PRETRAINED_PARAMETERS = 20_000_000
# ppo.lr when unset, by ppo.advantage, and with it ppo.lr_schedule when that is unset too: GAE's is tuned on
# the embedded randomwalks model; the critic-free estimators' updates are larger at a rate (no value baseline
# shrinks the advantages), and at 3e-4 GRPO and RLOO end below 0.9 optimality on graphs other than the default
# one. GRPO's advantages are scaled to unit variance in each group however small its spread: at a constant
# 1e-4 it plateaued at 0.93 on one graph, at a constant 3e-5 to 1e-4 it stayed short of 0.95 on one graph in
# async mode (0.939 at 5e-5); annealed linearly from 1e-4 it learns early at the rate and settles late
# (benchmarks/advantage_lr.py). GAE's, the default job's, is annealed too: at a constant 3e-4 its
# evaluations swung by up to 0.1 between iterations 20 and 30, and 2 of 15 runs over 5 seeds and three
# paths ended below 0.95 (0.944 twice; 0.959 the next lowest); annealed, 10 of 10 over both learner thread
# counts ended at 0.973-0.995 (benchmarks/default_job_paths.py)
ADVANTAGE_LR = {"gae": 3e-4, "grpo": 1e-4, "rloo": 1e-4, "reinforce_pp": 1e-4, "reinforce_pp_baseline": 1e-4}
ADVANTAGE_LR_SCHEDULE = {"gae": "linear", "grpo": "linear"}  # the others: the field's default, constant
# In async mode, the policy losses and the correction that let a stale row weigh more than TIS's cap of 2
# (CISPO's weight up to 5, SAPO's soft gate, IcePop's untruncated weight) lost learning parity over the
# default 4 epochs (8 optimizer steps a batch); with one they held it but learned slowly (14.7 iterations to
# GRPO's 10.3), with two they keep within 3 iterations of sync (benchmarks/results/losses-and-masks-*): an
# unset ppo.epochs follows (JobConfig._defaults_follow)
ASYNC_EPOCHS = 2
ASYNC_FEWER_EPOCHS = {"policy_loss": ("cispo", "sapo"), "correction": ("icepop",)}


class PPOConfig(Section):
    advantage: str = Field(
        "gae", description="the advantage estimator, a registered entry (learner/advantages.py): gae (with a "
        "critic), or the critic-free grpo, rloo, reinforce_pp, reinforce_pp_baseline")
    epochs: PositiveInt = Field(4, description="PPO epochs over each rollout batch")
    minibatch_size: PositiveInt = Field(64, description="episodes per optimizer step, over all ranks")
    lr: PositiveFloat = Field(3e-4, description="AdamW learning rate")
    lr_schedule: Literal["constant", "linear"] = Field(
        "constant", description="linear: lr * (1 - (i - 1) / run.iterations) at iteration i, falling "
        "linearly toward 0 as in lm-human-preferences, from lr at the first iteration to lr / run.iterations "
        "at the last; constant: lr throughout. Unset, with ppo.lr unset too: gae's and grpo's rates are "
        "linear, the others' constant")
    adam_betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW betas")
    weight_decay: float = Field(1e-6, ge=0, description="AdamW weight decay")
    clip_range: PositiveFloat = Field(0.2, description="policy ratio clip epsilon")
    clip_range_low: PositiveFloat | None = Field(
        None, description="lower ratio clip epsilon, the ratio's floor 1 - it (< 1); none = clip_range "
        "(policy_loss ppo)")
    clip_range_high: PositiveFloat | None = Field(
        None, description="upper ratio clip epsilon, the ratio's ceiling 1 + it (DAPO's clip-higher: 0.28 "
        "with a low of 0.2); none = clip_range (policy_loss ppo)")
    policy_loss: str = Field(
        "ppo", description="the policy loss, a registered entry (learner/policy_losses.py): ppo, a ratio per "
        "token; gspo, one length-normalised ratio per sequence (Zheng et al. 2025); gspo_token, GSPO's ratio "
        "with each token's gradient; cispo, the token ratio clipped and detached (MiniMax-M1); sapo, a soft "
        "gate in place of the clip (Qwen). Each entry's settings: the settings reference")
    gspo_clip_low: PositiveFloat = Field(3e-4, description="gspo, gspo_token: lower clip epsilon of the "
                                         "sequence ratio (the paper's 3e-4)")
    gspo_clip_high: PositiveFloat = Field(4e-4, description="gspo, gspo_token: upper clip epsilon of the "
                                          "sequence ratio (the paper's 4e-4)")
    cispo_clip_low: float = Field(
        1.0, gt=0, le=1, description="cispo: the weight's floor is 1 - it; 1 = no floor (the paper bounds "
        "only the top; Trinity-RFT's default)")
    cispo_clip_high: PositiveFloat = Field(
        4.0, description="cispo: the weight's ceiling is 1 + it (a ceiling of 5: ScaleRL's epsilon_max, "
        "TRL's recommended cap), which tames only ratios far off-policy")
    sapo_tau_pos: PositiveFloat = Field(
        1.0, description="sapo: the gate's temperature where A > 0 (the paper's, verl's and SkyRL's 1.0)")
    sapo_tau_neg: PositiveFloat = Field(
        1.05, description="sapo: the gate's temperature where A <= 0, higher so that negative tokens' "
        "gradients fade sooner (the paper's, verl's and SkyRL's 1.05)")
    clip_range_value: PositiveFloat = Field(0.2, description="value clip around old values (gae only)")
    vf_coef: float = Field(1.0, ge=0, description="value loss weight (gae only)")
    gamma: float = Field(1.0, gt=0, le=1, description="discount (gae, reinforce_pp; reinforce_pp_baseline "
                         "takes only 1)")
    lam: float = Field(0.95, ge=0, le=1, description="GAE lambda")
    whiten_advantages: bool = Field(True, description="whiten GAE's advantages over the batch (gae only: the "
                                    "other estimators normalise as defined)")
    whiten_rewards: bool = Field(False, description="scale the KL-penalised per-token rewards to unit "
                                 "variance over the batch, mean kept, before GAE (lm-human-preferences: "
                                 "true; gae only)")
    loss_aggregation: Literal["token_mean", "sequence_mean", "seq_mean_token_sum_norm"] = Field(
        "token_mean", description="loss mean: over tokens, over sequences (each over its tokens), or "
        "seq_mean_token_sum_norm (Dr. GRPO: each sequence's token sum over rollout.max_new_tokens, then the "
        "mean)")
    max_grad_norm: PositiveFloat = Field(1.0, description="gradient clipping norm")
    mask_truncated: bool = Field(
        False, description="DAPO's overlong filtering: responses cut at rollout.max_new_tokens without EOS "
        "leave the policy and value losses (their advantages and the groups' baselines are computed with "
        "them, and their KL still counts in the controller's statistic)")
    correction: str = Field(
        "tis", description="the rollout correction, a registered entry (learner/correction.py), both modes: "
        "each token's loss term times w = pi_old / pi_behav, the learner's policy at the start of the update "
        "over the engine's sampled log-probs; tis truncates w at is_cap, mis masks what exceeds it; icepop "
        "keeps a token's w inside [icepop_low, icepop_high] and masks it outside (Ring-1T); geometric_mask "
        "is tis with the rows whose geometric-mean token ratio is outside [geometric_mask_low, "
        "geometric_mask_high] masked (verl's geo mask); off_policy_mask is tis with DeepSeek-V3.2's mask: a "
        "row with a negative advantage whose mean log(pi_behav / pi) exceeds off_policy_mask_delta; none "
        "only in sync mode")
    correction_level: Literal["token", "sequence"] = Field(
        "token", description="the rollout correction's weight: per token, or the whole response's likelihood "
        "ratio on each of its tokens (gspo takes sequence)")
    is_cap: PositiveFloat = Field(2.0, description="the rollout correction's bound on w = pi_old / pi_behav "
                                  "(> 1): tis truncates w to it, mis masks the tokens (sequence: rows) "
                                  "beyond it; in async mode pi_old is pi_prox (decoupled PPO)")
    icepop_low: float = Field(
        0.5, gt=0, lt=1, description="icepop: a token whose k = pi_old / pi_behav is below it is masked "
        "(Ring-1T's and OpenRLHF's 0.5)")
    icepop_high: float = Field(
        5.0, gt=1, description="icepop: a token whose k = pi_old / pi_behav is above it is masked (Ring-1T's "
        "and OpenRLHF's 5.0)")
    geometric_mask_low: float = Field(
        0.999, gt=0, lt=1, description="geometric_mask: a row whose exp(mean_t log(pi_old / pi_behav)) is "
        "below it is masked (verl's geo mask: 0.999; in async mode the ratio holds the staleness too, and "
        "this band masks most stale rows)")
    geometric_mask_high: float = Field(
        1.001, gt=1, description="geometric_mask: a row whose geometric-mean ratio is above it is masked "
        "(verl's 1.001)")
    off_policy_mask_delta: PositiveFloat = Field(
        1e-4, description="off_policy_mask: the threshold, nats per token, on a row's mean log(pi_behav / "
        "pi) over its tokens (pi the policy being trained) above which a row with a negative advantage is "
        "masked (slime's 1e-4)")
    grpo_normalize: Literal["score", "return"] = Field(
        "score", description="grpo with the KL in the reward: score normalises the score in its group and "
        "adds the KL penalty to go unscaled (DeepSeekMath, OpenRLHF, TRL); return normalises "
        "score - beta * KL_b (verl's use_kl_in_reward, only to reproduce it: where a group's scores tie, KL "
        "noise becomes unit advantages)")


class KLConfig(Section):
    controller: Literal["adaptive", "fixed"] = Field(
        "adaptive", description="adaptive (Ziegler et al.) or fixed")
    estimator: str = Field("k1", description="per-token KL estimator, a registered entry (learner/kl.py): "
                           "k1, k2, k3")
    scope: Literal["response_sum", "token_mean"] = Field(
        "response_sum", description="statistic fed to controller")
    placement: Literal["reward", "loss"] = Field(
        "reward", description="KL penalty in the reward or in the loss")
    loss_form: LossForm | None = Field(
        None, description="KL term in the loss (placement 'loss' only): kl_to_go or response_k2 (exact "
        "gradient of the response KL, per response), or grpo_token_k3 (GRPO's, only to reproduce it)")
    init_kl_coef: float = Field(0.15, ge=0, description="initial beta")
    target: PositiveFloat | None = Field(6.0, description="target response KL, nats (adaptive only)")
    horizon: PositiveInt = Field(10000, description="controller horizon, episodes")

    @model_validator(mode="after")
    def _target_matches_controller(self) -> KLConfig:
        if self.controller == "adaptive" and self.target is None:
            raise ValueError("kl.target is required with kl.controller='adaptive'")
        if self.controller == "fixed" and self.target is not None:
            raise ValueError("kl.target is set but kl.controller='fixed' ignores it; set kl.target=null")
        if self.scope == "token_mean":
            warnings.warn("kl.scope='token_mean' feeds the controller a per-token mean (other frameworks' "
                          "choice)")
        if self.placement == "loss" and self.loss_form is None:
            raise ValueError(
                "kl.placement='loss' needs kl.loss_form: a per-token k(r) in the loss has the wrong gradient "
                f"whichever kl.estimator (here {self.estimator!r}) it uses (k1: 0 in expectation; k3: the "
                "reverse KL's; k2: misses later tokens' log-ratios). Set kl.loss_form to 'kl_to_go' or "
                "'response_k2' (exact gradient of the response KL) or 'grpo_token_k3' (only to reproduce "
                "GRPO)")
        if self.placement == "reward" and self.loss_form is not None:
            raise ValueError(f"kl.loss_form={self.loss_form!r} is set but kl.placement='reward' ignores it; "
                             "set kl.loss_form=null or kl.placement='loss'")
        if self.loss_form == "grpo_token_k3":
            warnings.warn(GRPO_TOKEN_K3_WARNING)
        return self


class RoleResources(Section):
    num_cpus: float = Field(0.25, ge=0, description="CPUs per actor")
    num_gpus: float = Field(0.0, ge=0, description="GPUs per actor (fractional to share)")
    resources: dict[str, float] = Field(default_factory=dict, description="custom Ray resources per actor")


class ClusterConfig(Section):
    address: str | None = Field(None, description="Ray address; none = RAY_ADDRESS (ray job) or a local Ray")
    num_cpus: PositiveInt | None = Field(None, description="CPUs of a local Ray started by the job")
    object_store_mib: PositiveInt = Field(512, description="object store of a local Ray, MiB")
    connect_timeout_s: PositiveFloat = Field(30.0, description="give up reaching the cluster after this")
    placement_timeout_s: PositiveFloat = Field(30.0, description="give up waiting for resources after this")
    rollout: RoleResources = Field(default_factory=RoleResources)
    reference: RoleResources = Field(default_factory=RoleResources)
    reward: RoleResources = Field(default_factory=RoleResources)
    teacher: RoleResources = Field(default_factory=RoleResources)  # distill.teacher_path only
    learner: RoleResources = Field(default_factory=RoleResources)


class LoraConfig(Section):
    """LoRA adapters on the policy (through peft); rank 0 trains every weight."""

    rank: int = Field(0, ge=0, description="the adapters' rank r; 0 = off (full fine-tuning)")
    alpha: PositiveFloat = Field(16.0, description="the adapters' scale is alpha / rank")
    target_modules: list[str] = Field(
        default_factory=lambda: ["all-linear"], min_length=1, description="the modules that get adapters, by "
        "name (a module matches when its dotted name ends with it: GPT-2's c_attn, c_proj, c_fc; Llama's "
        "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj), or ['all-linear'] (every linear "
        "layer but the output head)")
    sync: Literal["auto", "adapter", "merged"] = Field(
        "auto", description="adapter: where vLLM's implementation of the model takes LoRA adapters, the "
        "engines run with LoRA on and each sync ships the adapter alone (elsewhere the merged weights); "
        "merged: the engines run the plain model and each sync ships the base weights with the adapters "
        "merged in (float32 only: in bf16 W + BA rounds the adapters' updates away); auto: merged for "
        "float32 engines on CPU, where vLLM's build generates with an adapter 3-7x slower than without "
        "(benchmarks/trl_smollm2.py), else adapter")
    reference: Literal["base", "actor"] = Field(
        "base", description="base: the reference log-probs are the learner's own forward with the adapters "
        "disabled (the base model is the initial policy), so no reference actor or second copy of the "
        "weights; actor: the reference actors as without LoRA")

    @model_validator(mode="after")
    def _all_linear_alone(self) -> LoraConfig:
        if "all-linear" in self.target_modules and len(self.target_modules) > 1:
            raise ValueError(f"learner.lora.target_modules {self.target_modules}: 'all-linear' already takes "
                             "every linear layer; give it alone or name the modules")
        return self


class LearnerConfig(Section):
    world_size: PositiveInt = Field(1, description="DeepSpeed ranks")
    zero_stage: int = Field(0, ge=0, le=3, description="ZeRO stage 0-3")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "float32", description="training dtype; the engines and the reference compute in it too. Unset, a "
        "pretrained policy (model.path, or any task but randomwalks) takes auto. auto: on a GPU "
        "bfloat16; on CPU the driver times the model's own matmuls (its MLP and LM head, forward and "
        "backward, on the learner's threads) in both and takes bfloat16 only where it is at least 1.2x "
        "faster (float32 for a model too small for its matmuls to count, and with learner.lora.sync merged); "
        "the job's first lines give the figures")
    attention: Literal["auto", "sdpa", "eager"] = Field(
        "auto", description="the policy's attention in the learner (transformers' attn_implementation): "
        "sdpa (torch's fused kernel) or eager (two batched matmuls and a softmax). auto: on a GPU sdpa; "
        "on CPU the driver times one layer's attention of the model's shape at the learner's dtype over "
        "the job's longest sequence (or learner.max_tokens_per_microbatch), forward and backward, both "
        "ways, and takes eager only where it is at least 1.2x faster (on short sequences in bfloat16 "
        "torch's CPU kernel is slow); sdpa for a model too small to time. The job's first lines give the "
        "figures")
    critic: Literal["value_head", "separate"] = Field(
        "value_head", description="value head or a separate critic")
    weight_sync: Literal["object_store", "nccl", "ipc"] = Field(
        "object_store", description="weights to the engines: Ray object store (CPU or GPU), or vLLM's weight "
        "transfer over NCCL (learner and engines on separate GPUs) or CUDA IPC (engines on the learner's "
        "GPUs)")
    sync_bucket_mib: PositiveInt = Field(64, description="packed buffer of vLLM's NCCL/IPC weight transfer, "
                                         "MiB; raised to the largest parameter's size when that is larger "
                                         "(logged)")
    collective_timeout_s: PositiveFloat = Field(
        1800.0, description="longest wait for the learner ranks in one call (rendezvous, collect, update, "
        "weight sync) before the job fails naming the ranks that did not answer")
    weight_sync_timeout_s: PositiveFloat = Field(
        300.0, description="learner.weight_sync nccl or ipc: longest wait for one weight transfer; an engine "
        "that dies or restarts during it is named at once (the learner's broadcast would wait on it), one "
        "that does not finish is named at this deadline")
    torch_threads: PositiveInt | None = Field(
        None, description="CPU threads of each rank's torch; none = on a local Ray the job starts, in a sync "
        "job on CPU, the machine's CPUs shared by the ranks (the engines and the reference idle while the "
        "ranks update), elsewhere Ray's default (one per whole CPU of the actor)")
    max_tokens_per_microbatch: PositiveInt | None = Field(
        None, description="pack the learner's forwards and backwards (and the reference's forward) into "
        "micro-batches of at most this many real tokens, sequences one after another without padding; one "
        "optimizer step accumulates as many as its minibatch needs. None: padded [rows, prompt + response] "
        "blocks. Attention without a variable-length kernel (SDPA, on CPU too) runs a micro-batch as one "
        "masked [N, N] block, so keep N to a few sequences' length there")
    lora: LoraConfig = Field(default_factory=LoraConfig)

    @property
    def vllm_lora_rank(self) -> int | None:
        """The max_lora_rank of an engine that takes the adapters: vLLM's smallest at least lora.rank (whether
        the engines take them is ``JobConfig.adapter_sync``)."""
        return next((r for r in VLLM_LORA_RANKS if r >= self.lora.rank), None) if self.lora.rank else None

    @property
    def reference_in_learner(self) -> bool:
        """LoRA with reference 'base': the learner ranks score the reference log-probs, no reference actor."""
        return self.lora.rank > 0 and self.lora.reference == "base"


class RunConfig(Section):
    iterations: PositiveInt = Field(30, description="rollout/train iterations")
    seed: int = Field(1000, description="seed for sampling, prompts and init")
    output_dir: str = Field("runs", description="parent of run directories: a local directory or a URI "
                            "(file://, s3://, gs://; s3 and gs need the s3fs or gcsfs package)")
    name: str = Field("randomwalks", description="run name: the run directory is output_dir/name")
    overwrite: bool = Field(False, description="replace an existing run directory")
    resume: str | None = Field(None, description="continue from a checkpoint: 'latest' or its directory")
    eval_every: PositiveInt = Field(5, description="evaluate every N iterations (and at the end)")
    eval_max_episodes: PositiveInt | None = Field(
        None, description="the most episodes an evaluation runs: the first rows of the task's evaluation "
        "set, each rollout.eval_samples_per_prompt times; none = every row for a prompt task, and for an "
        "environment or agent task (whose evaluation rows may be many, and each episode several turns) at "
        "most 2 x rollout.batch_size. The job's first lines say what an evaluation runs against an iteration")
    eval_before_training: bool = Field(
        True, description="evaluate the initial policy before the first iteration: the start that curves.png "
        "and summary.json's eval_start show (off: neither has one); a resume keeps its run's")
    probe_every: PositiveInt = Field(1, description="check engine vs learner log-probs every N syncs")
    probe_tolerance: PositiveFloat | None = Field(
        None, description="max |logp diff| allowed by the probe; none = by learner.dtype (float32 1e-4, "
        "bfloat16 see PROBE_TOLERANCE)")
    actor_max_restarts: int = Field(-1, ge=-1, description="restarts of a crashed rollout/reference/reward "
                                    "actor (-1: unlimited, as a long run on preemptible nodes needs)")
    max_chunk_retries: int = Field(3, ge=0, description="times a chunk lost to a dead actor is regenerated")


Tracker = Literal["wandb", "tensorboard", "mlflow", "trackio"]


class WandbConfig(Section):
    project: str = Field("tether", description="wandb project")
    entity: str | None = Field(None, description="wandb entity (team or user); none = the account's default")
    name: str | None = Field(None, description="wandb run name; none = run.name")
    tags: list[str] = Field(default_factory=list, description="wandb run tags")

    @model_validator(mode="before")
    @classmethod
    def enabled_moved(cls, data: Any) -> Any:
        if isinstance(data, dict) and "enabled" in data:
            raise ValueError("metrics.wandb.enabled is now an entry of metrics.report_to: set "
                             "metrics.report_to=[wandb] (with the other trackers you log to)")
        return data


class MLflowConfig(Section):
    tracking_uri: str | None = Field(
        None, description="the MLflow tracking server or database; none = MLFLOW_TRACKING_URI where set, "
        "else sqlite:///<run directory>/mlflow.db (artifacts beside it, in mlflow-artifacts/)")
    experiment: str = Field("tether", description="MLflow experiment the run is logged under")
    name: str | None = Field(None, description="MLflow run name; none = run.name")


class TrackioConfig(Section):
    project: str = Field("tether", description="trackio project")
    name: str | None = Field(None, description="trackio run name; none = run.name")
    space_id: str | None = Field(None, description="a Hugging Face Space to log to; none = trackio's local "
                                 "database (TRACKIO_DIR, default ~/.cache/huggingface/trackio), which "
                                 "`trackio show` opens")


class MetricsConfig(Section):
    plot_every: PositiveInt = Field(10, description="redraw curves.png every N iterations (and at the end)")
    report_to: list[Tracker] = Field(
        default_factory=list, description="experiment trackers that get every metrics.jsonl record, the "
        "evaluation samples and the summary: any of wandb, tensorboard (into the run directory), mlflow, "
        "trackio; as a list ([wandb, mlflow]) or comma-separated (wandb,mlflow); none = metrics.jsonl only")
    progress_bar: bool = Field(True, description="live progress bar when stdout is a terminal")
    eval_samples_saved: int = Field(8, ge=0, description="evaluation samples written as text to "
                                    "samples/iteration-NNNN.md at each evaluation (0 = none)")
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    mlflow: MLflowConfig = Field(default_factory=MLflowConfig)
    trackio: TrackioConfig = Field(default_factory=TrackioConfig)
    cpu_watch_s: float = Field(10.0, ge=0, description="every so many seconds the driver reads the CPU "
                               "time of the job's processes on its node against their time waiting for a "
                               "core, and says once on the console, naming the busiest other processes, when "
                               "other work starves them (0 = no watch)")
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "warning", description="logging of vLLM, transformers, DeepSpeed and Ray in the driver and every "
        "actor (tether's own lines always show); debug also shows the warnings tether knows to be harmless")

    @model_validator(mode="before")
    @classmethod
    def trackers_as_users_write_them(cls, data: Any) -> Any:
        """``report_to`` as TRL's ``--report_to`` takes it (one name, comma-separated names, none); the
        switches it replaced named with their new form."""
        if not isinstance(data, dict):
            return data
        if "tensorboard" in data:
            raise ValueError("metrics.tensorboard is now an entry of metrics.report_to: set "
                             "metrics.report_to=[tensorboard] (with the other trackers you log to)")
        trackers = data.get("report_to")
        if isinstance(trackers, str):
            names = [t.strip() for t in trackers.strip("[]").split(",") if t.strip()]
            data = {**data, "report_to": [] if names == ["none"] else names}
        return data

    @model_validator(mode="after")
    def each_tracker_once(self) -> MetricsConfig:
        twice = sorted({t for t in self.report_to if self.report_to.count(t) > 1})
        if twice:
            raise ValueError(f"metrics.report_to names {', '.join(twice)} more than once")
        return self


class CheckpointConfig(Section):
    every: int = Field(10, ge=0, description="save every N iterations (0 = only at the end and on stop)")
    keep: PositiveInt = Field(3, description="how many checkpoints to keep")
    export_hf: bool = Field(True, description="at the end of the run, write the policy as a Hugging Face "
                            "model directory (safetensors, config, tokenizer) to <run directory>/export")
