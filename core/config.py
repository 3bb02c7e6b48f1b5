"""The run configuration: its pydantic models, and the one home of every default.

A run config names the policies to host, how the engine and server behave, how the trainer
optimises, which local clients to start, how their processes are contained and where telemetry
goes. Unknown keys are errors that name the key. This module is the schema and validates; reading
YAML and overrides in, what counts as a credential and writing a config down are `core.config_io`'s
job, and it does not start anything (containing a process is `core.contain.contained`'s job).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

GiB = 1024 ** 3


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LoraConfig(Strict):
    r: int = Field(16, ge=1)
    alpha: int = Field(32, ge=1)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])


class RayResources(Strict):
    """What one Ray actor reserves on the cluster (`placement.kind: ray` only; ignored otherwise)."""

    num_cpus: float = Field(1.0, ge=0)  # Ray schedules by these reservations, it does not cap real use
    num_gpus: float = Field(0.0, ge=0)  # a model on cuda needs >= 1: Ray sets CUDA_VISIBLE_DEVICES from it
    resources: dict[str, float] = Field(default_factory=dict)  # custom node resources, e.g. {"agent_node": 1}


class ClientRay(RayResources):
    """A client's Ray actors: `replicas` copies of the client, each with `concurrency` episodes in flight."""

    num_gpus: float = Field(0.0, ge=0, le=0)  # clients run agent code, never a model
    replicas: int = Field(1, ge=1)  # actors started from this client entry, spread over the cluster's CPUs


class ModelTrainer(Strict):
    """How one model's trainer is spread over devices (`core.train.distributed`)."""

    # Data-parallel ranks, each a process with a full copy of the weights and the optimizer (gloo on
    # CPU, NCCL on GPU). Rank 0 is the run's own process; 1 is the single-process trainer.
    world_size: int = Field(1, ge=1)
    # One device per rank; None: every rank on cpu for a cpu model, else cuda:0..world_size-1.
    devices: list[str] | None = None
    # How the ranks hold the model. replicate: each rank a full copy of weights, gradients and AdamW
    # state (core.train.distributed). fsdp2: FSDP2 `fully_shard`, each rank 1/world_size of them
    # (core.train.sharded; full fine-tunes only). auto: fsdp2 when the memory arithmetic
    # (core.train.memory) says one rank's full state does not fit its GPU, else replicate (always
    # replicate on CPU, whose memory is not counted).
    sharding: Literal["replicate", "fsdp2", "auto"] = "auto"
    # Between steps (while the replicas generate), keep the trainer's weights, fp32 master copies,
    # AdamW moments and KL reference in host memory and empty the GPU's cache; they come back for the
    # next backward (`core.train.offload`). For `layout: colocated` on GPUs that do not hold a rank's
    # state and a replica at once (`core.run.plan` says). Replicated ranks only (not fsdp2).
    offload: bool = False
    # FSDP2 only: recompute each decoder layer's activations in the backward instead of keeping them
    # (`core.train.sharded`): about one extra forward a step for activations of one layer at a time.
    activation_checkpointing: bool = False

    @model_validator(mode="after")
    def _one_device_per_rank(self) -> ModelTrainer:
        if self.devices is not None and len(self.devices) != self.world_size:
            raise ValueError(f"devices lists {len(self.devices)} devices for world_size {self.world_size}; "
                             "give one per rank")
        if self.offload and self.sharding == "fsdp2":
            raise ValueError("offload moves a replicated trainer's state to the host between steps; fsdp2's shards "
                             "are not offloaded (use sharding replicate, or fsdp2 without offload)")
        if self.sharding == "fsdp2" and self.world_size < 2:
            raise ValueError(f"sharding fsdp2 shards over the ranks and needs world_size >= 2, got {self.world_size}")
        return self


class ModelConfig(Strict):
    name: str = "policy"  # what clients pass as `model`; also the MLflow metric prefix for multi-model runs
    source: str = "tiny"  # a preset (`swarm models`) or a local Hugging Face folder
    # Where the model lives: auto (CUDA when available), cpu, cuda or cuda:N. Its engine and its
    # trainer share it, as colocated training does on CPU.
    device: str = "auto"
    # None: bfloat16 on a GPU, float32 on CPU. A bf16/fp16 model trains on fp32 master weights.
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    max_context: int | None = Field(None, ge=16)  # None: the model's own limit
    lora: LoraConfig | None = None
    trainable: bool = True
    # Seeds a random-initialised model's weights (the `tiny` preset). None: the run's trainer.seed, so
    # replicates of a study start from different weights; an int pins them whatever the run's seed.
    seed: int | None = None
    ray: RayResources = Field(default_factory=RayResources)  # its engine+trainer actor under Ray placement
    # Rollout engines for this model (`core.engine.replicas`): 1 is the engine sharing the trainer's
    # module in this process; N >= 2 starts N engine processes (or Ray actors under Ray placement),
    # each on its own device, routed by episode and synced with the trainer's weights after each step.
    replicas: int = Field(1, ge=1)
    # One device per replica; None: cpu for a cpu model, else the GPUs `layout` assigns.
    replica_devices: list[str] | None = None
    # colocated: replica i shares a device with trainer rank i (engines idle during the step);
    # split: trainer ranks on the first devices, replicas on the ones after (`core.run.plan`).
    layout: Literal["colocated", "split"] = "split"
    trainer: ModelTrainer = Field(default_factory=ModelTrainer)

    @field_validator("device")
    @classmethod
    def _known_device(cls, device: str) -> str:
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", device):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {device!r}")
        return device

    @model_validator(mode="after")
    def _one_device_per_replica(self) -> ModelConfig:
        if self.replica_devices is not None and len(self.replica_devices) != self.replicas:
            raise ValueError(f"replica_devices lists {len(self.replica_devices)} devices for {self.replicas} "
                             "replicas; give one per replica")
        for d in [*(self.replica_devices or []), *(self.trainer.devices or [])]:
            self._known_device(d)
        return self


class EngineConfig(Strict):
    kind: Literal["hf", "instant", "vllm"] = "hf"  # instant: the null engine, answers at once (benchmarks)
    max_batch: int = Field(32, ge=1)  # most sequences decoded together in one forward pass
    batch_window_ms: float = Field(2.0, ge=0)  # how long the first request of a batch waits for company
    default_max_tokens: int = Field(256, ge=1)  # for requests that do not say
    default_temperature: float = Field(1.0, ge=0, le=2)  # for requests that do not say
    # Every request samples with its own seed, derived from (trainer.seed, episode, call, choice), so a
    # run repeats whatever order concurrent calls arrive in (hf: one generator a row; vLLM: a seed a
    # request). Off by default: a seed per request moves vLLM off its batched sampler onto a per-row
    # loop, and costs the hf engine one draw a row (bench/repeatable_sampling.py, docs/benchmarks.md).
    repeatable_sampling: bool = False
    # The share of its GPU's total memory a vLLM engine takes for its weights, activations and KV cache
    # (vLLM's own `gpu_memory_utilization`). 0.4 leaves a colocated trainer rank the rest; a replica
    # alone on its GPU may take 0.9. `core.run.plan` counts it (`swarm run --dry-run`).
    gpu_memory_utilization: float = Field(0.4, gt=0, le=1)


class ServerConfig(Strict):
    host: str = "127.0.0.1"  # loopback unless told otherwise: no hidden network
    port: int = Field(8000, ge=0, le=65535)  # 0 picks a free port
    # Serve requests without an episode key (never recorded) when nothing trains (`swarm serve` without
    # training); a run that trains (`swarm run`, `swarm serve` with a trainer) answers them 401 regardless.
    allow_anonymous: bool = True
    admin_token: str | None = None  # None: a random token, kept in a 0600 file whose path is printed (never the token)
    lease_s: float = Field(60.0, gt=0)
    max_open_episodes: int = Field(512, ge=1)
    # The hang watchdog (`core.run.watchdog`): no finished episode and no train step for this long while a
    # trainer waits means the run is stalled: one diagnostic line, thread stacks dumped, status `stalled`.
    # Ten minutes is far beyond a CPU step of the shipped models, so a slow step is never taken for a hang. 0: off.
    stall_s: float = Field(600.0, ge=0)
    # The longest the gateway waits for an engine to answer one request before a 504: no request is
    # awaited without a bound. Ten minutes is far beyond a CPU completion of default_max_tokens.
    request_timeout_s: float = Field(600.0, gt=0)
    # Request bodies larger than this are refused with 413 before they are parsed. 8 MiB holds a
    # 64k-token context as JSON many times over; a 12 MB message only costs memory and event-loop time.
    max_request_bytes: int = Field(8 * 1024 * 1024, ge=1024)
    # How long a stopping server (SIGTERM, Ctrl-C, /admin/shutdown) waits for requests in flight before
    # it cancels them: a stuck request must not keep the process alive with its port closed.
    shutdown_s: float = Field(10.0, gt=0)
    # A folder of sealed judges, one sub-folder per sandbox folder name (`<judges_dir>/letters/`: its
    # sandbox.toml, judge and what it imports). Set, every judge is loaded from there and never from the
    # folder a client runs: a study seals its judges once (researcher.code.sealed) so that every arm it
    # compares, whatever code it checks out, is scored by one judge (docs/security.md). None: each
    # client's own sandbox folder.
    judges_dir: str | None = None


class TrainerConfig(Strict):
    steps: int = Field(10, ge=0)
    batch_groups: int = Field(4, ge=1)  # ready groups per optimizer step
    group_size: int = Field(4, ge=1)  # default episodes per group when a client does not say
    lr: float = Field(1e-5, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    advantage: Literal["grpo", "rloo", "reinforce_pp"] = "grpo"
    clip_low: float = Field(0.2, ge=0)
    clip_high: float = Field(0.2, ge=0)  # > clip_low for asymmetric ("clip-higher") bounds
    kl_coef: float = Field(0.0, ge=0)  # k3 KL to the reference (the base model; adapters off with LoRA)
    episode_weighting: bool = False  # weight each episode 1/its trained tokens so long ones do not dominate
    merge: Literal["none", "linear", "tree"] = "linear"
    # Hold a group's common prompt once in training (tree samples): its episodes share the task's
    # prompt, which with short completions is most of the tokens (groups of 8 on bench/share_prompt.py: 3x fewer).
    share_prompt: bool = True
    micro_batch_tokens: int = Field(4096, ge=16)
    grad_clip: float = Field(1.0, gt=0)
    # Step fp32 copies of a bf16/fp16 model's weights (core/train/master.py): at RL learning rates most
    # of a step is below half a bf16 ulp and rounds away in place. False saves 4 bytes a parameter of
    # copy (and halves Adam's state) for a model that only just fits, at the cost of that update.
    master_weights: bool = True
    # Drop episodes whose oldest generating weights are more than this many versions behind; >= 1
    # also overlaps generation with the train step, and sizes admission control (DESIGN §3.3).
    max_staleness: int = Field(1, ge=0)
    # Truncated importance sampling: replace PPO-clip by the policy gradient weighted with
    # min(pi_theta / pi_behaviour, tis_cap), so off-policy (stale) tokens count by how likely they
    # still are instead of being clipped out. None: plain PPO-clip.
    tis_cap: float | None = Field(None, gt=0)
    # Rollout correction (core/train/correction.py), with tis_cap as its bound C: token_tis / seq_tis
    # weight by the truncated token / sequence ratio, token_mis / seq_mis drop what leaves [1/C, C] and
    # count it. "none" with tis_cap set is token_tis (the setting before this field existed).
    correction: Literal["none", "token_tis", "seq_tis", "token_mis", "seq_mis"] = "none"
    # The policy loss (core/train/loss.py): PPO-clip, or CISPO (a clipped stop-gradient weight times
    # logp, so a token past the bound is down-weighted, never cut off). CISPO's weight bounds are absolute:
    # cispo_max 5 is ScaleRL's epsilon_max as TRL recommends it; cispo_min 0 is MiniMax-M1's (no lower clip).
    loss: Literal["ppo_clip", "cispo"] = "ppo_clip"
    cispo_min: float = Field(0.0, ge=0, lt=1)
    cispo_max: float = Field(5.0, gt=1)
    # Which tokens an advantage goes to (core/train/credit.py): "episode" gives every token its episode's
    # group advantage; "turn" gives each turn's tokens an advantage against the episodes of its group
    # that reached that turn (unbiased when the policy decides when to stop: docs/architecture.md).
    credit: Literal["episode", "turn"] = "episode"
    # A step whose batch has no signal (every advantage zero, no KL): "momentum" still takes the AdamW step,
    # on zero gradients, so the momentum of earlier steps keeps moving the weights, as TRL (any
    # optimizer fed a zero loss) does; "skip" changes nothing and keeps the weight version. No-op before
    # the first real step (Adam has no moments yet). tests/core/test_trl_parity.py shows the difference.
    no_signal_steps: Literal["momentum", "skip"] = "momentum"
    # Dynamic sampling (core/episodes/batching.py): "filter" keeps a group whose rewards tie (within tie_tolerance)
    # out of the trainer's batch, still scored, and refills its slot from the groups that keep arriving (DAPO);
    # after max_refills tied groups in a row the batch trains what it has: a saturated task cannot stall the run.
    dynamic_sampling: Literal["off", "filter"] = "off"
    tie_tolerance: float = Field(1e-6, ge=0)  # rewards within this of each other tie: float noise, not signal
    max_refills: int = Field(16, ge=0)  # = 4 batches of the default batch_groups: a task tied that often is saturated
    oversample: bool = False  # under filter: start the expected ties' refills beside the batch (no gain on CPU)
    # Warn when a step's train/mismatch_kl (k3 of the sampler against the trainer on the sampled tokens,
    # core/train/mismatch.py) exceeds this; "stop" also fails the step, so max_failed_steps such steps end
    # the run. None: not watched. prime-rl's FP8 regression moved it 0.0038 -> 0.0059; a sampler at the
    # wrong temperature moves it by orders of magnitude.
    mismatch_kl_bound: float | None = Field(None, gt=0)
    mismatch_action: Literal["warn", "stop"] = "warn"
    checkpoint_every: int = Field(0, ge=0)  # steps between checkpoints; 0: by time only (below)
    # Seconds between checkpoints, whatever the steps: a crash loses at most about this much of a run
    # (a step that runs longer is checkpointed when it ends). 0: by steps only, or on clean shutdown.
    checkpoint_every_s: float = Field(600.0, ge=0)
    checkpoint_dir: str = "checkpoints"
    keep_checkpoints: int | None = Field(3, ge=1)  # oldest removed first; None keeps all (SmolLM2 is ~0.5 GB each)
    seed: int = 0
    # Rewards beyond +-this are refused at finish (400): RL rewards are O(1), and 1e308 overflows a
    # group's mean. A million leaves room for any reward scale in use while keeping sums exact in float64.
    max_abs_reward: float = Field(1e6, gt=0)
    # This many failed train steps in a row end the run as FAILED (non-zero exit): one bad step is
    # logged and skipped, but a run whose every step fails must not report FINISHED.
    max_failed_steps: int = Field(3, ge=1)

    @model_validator(mode="after")
    def _options_fit(self) -> TrainerConfig:
        # Refused at load, naming the keys, rather than at the first step.
        if self.correction.endswith("_mis") and not (self.tis_cap or 0) > 1:
            raise ValueError(f"trainer.correction {self.correction} drops what leaves [1/C, C]: it needs trainer.tis_cap > 1")
        if self.correction.endswith("_tis") and self.tis_cap is None:
            raise ValueError(f"trainer.correction {self.correction} needs its bound trainer.tis_cap")
        if self.loss == "cispo" and (self.correction.endswith("_tis") or (self.correction == "none" and self.tis_cap)):
            raise ValueError("trainer.loss cispo already truncates its weight: use trainer.correction none or a *_mis")
        if self.credit == "turn" and self.advantage == "reinforce_pp":
            raise ValueError("trainer.credit turn works with trainer.advantage grpo or rloo (reinforce_pp scales by the batch)")
        return self


class ClientConfig(Strict):
    """A local client started by `swarm run`: an agent function or a sandbox folder."""

    agent: str  # "sandbox:NAME" (a folder under sandboxes/) or an importable module with tasks() and rollout()
    # Run as its own OS process (`swarm client`, in a working folder of its own, in the sandbox's own venv
    # when its sandbox.toml lists requirements) rather than inside the run: a crash, a hang or a
    # clashing dependency of agent code then stays out of the server. False: a thread of the run (cheaper).
    isolate: bool = True
    concurrency: int = Field(4, ge=1)  # episodes in flight
    group_size: int | None = Field(None, ge=1)  # None: trainer.group_size
    split: str = "train"
    mix: float = Field(1.0, gt=0)  # share of episode openings relative to other clients
    kind: Literal["train", "eval", "debug"] = "train"
    tasks: int | None = Field(None, ge=1)  # stop after this many tasks (None: cycle until the run ends)
    # Seconds a rollout may run before it is cancelled and its episode aborted, naming the sandbox file
    # (`swarm client --episode-timeout`); None: the runner's default (`core.clients.deadline.EPISODE_TIMEOUT_S`, 600), 0: none.
    episode_timeout: float | None = Field(None, ge=0)
    ray: ClientRay = Field(default_factory=ClientRay)  # its actors under Ray placement (isolate is then moot)

    @property
    def sandbox_name(self) -> str:
        """The name its episodes carry (groups and mix quotas key on it): the folder or module's last part."""
        return Path(self.agent.removeprefix("sandbox:")).name.rsplit(".", 1)[-1]


class ContainLimits(Strict):
    """Resource limits of one contained process (`core.contain.contained`), set between fork and exec."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cpu_s: int = Field(900, ge=0)  # CPU seconds of each process (a busy loop ends by SIGXCPU); 0: no limit
    address_space: int = Field(8 * GiB, ge=64 * 1024 ** 2)  # virtual memory, bytes (a memory hog gets MemoryError)
    file_size: int = Field(1 * GiB, ge=1)  # the largest file it may write, bytes
    processes: int = Field(256, ge=1)  # processes and threads beyond what the user runs already (a fork bomb stops)
    open_files: int = Field(1024, ge=16)
    # All its processes' memory together (pages, tmpfs, shared memory), bytes: a memory cgroup where the machine
    # allows one (`core.contain.memory_cgroup`), else only address_space per process holds
    memory: int = Field(8 * GiB, ge=64 * 1024 ** 2)


ContainMode = Literal["off", "auto", "required"]
CONTAIN_MODES: tuple[ContainMode, ...] = get_args(ContainMode)


class ContainmentConfig(Strict):
    """How `swarm run` starts its isolated client processes, which run sandbox code (docs/security.md).

    clients: off       as the run's own children: its environment, no limits (a person's own code).
             auto      each through `core.contain.contained`: an environment allowlist (no credential of the
                       run's), the limits below, its own process group signalled whole on stop, bubblewrap
                       when `bwrap` is on PATH (only its working folder writable); without bwrap a warning.
             required  as auto, but without bwrap the run refuses to start.
    Containment needs every client isolated and placed locally (a thread or a Ray actor cannot be).
    """

    clients: ContainMode = "off"

    @field_validator("clients", mode="before")
    @classmethod
    def _yaml_off(cls, value: Any) -> Any:
        return "off" if value is False else value  # YAML 1.1 reads a bare `off` (`--set containment.clients=off`) as false

    # A client lives as long as its run, so no CPU-time limit by default (its rollouts have deadlines);
    # memory, file size, processes and open files as for validation.
    limits: ContainLimits = Field(default_factory=lambda: ContainLimits(cpu_s=0))


# The per-step score of one code version of a sandbox during an A/B, over the (task, weights) cells both
# versions completed (`core.episodes.pairing`): logged by the run, judged by the researcher
# (which reads no core module but this and core.mlflow_history). One name, here.
AB_METRIC = "ab/{sandbox}/version/{version}"


def ab_metric(sandbox: str, version: str) -> str:
    return AB_METRIC.format(sandbox=sandbox, version=version)


class TelemetryConfig(Strict):
    tracking_uri: str | None = None  # None: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db
    experiment: str = "swarmrl"
    run_name: str | None = None
    tags: dict[str, str] = Field(default_factory=dict)
    trajectories_per_step: int = Field(4, ge=0)


class PlacementConfig(Strict):
    """Where the run's parts live (`core.run.placement`): this process, or actors on a Ray cluster."""

    kind: Literal["local", "ray"] = "local"  # local: nothing about Ray is imported or started
    # local: a private Ray instance in this process; auto: the cluster this machine joined (`ray start`);
    # else a cluster address (host:6379 or ray://host:10001).
    address: str = "auto"
    namespace: str = "swarmrl"  # Ray namespace of the run's actors
    # How often a lost model actor is restarted (weights and optimizer from the last checkpoint)
    # before the run fails; Ray restarts the process, the run restores its state.
    max_restarts: int = Field(3, ge=0)


class RunConfig(Strict):
    # The YAML file it was loaded from (None: a dict or the defaults). Not a setting, so never dumped:
    # `sandbox:NAME` clients resolve against that file's project (`core.clients.sandbox.sandbox_roots`).
    _source_file: Path | None = PrivateAttr(None)

    @property
    def source_file(self) -> Path | None:
        return self._source_file

    models: list[ModelConfig] = Field(default_factory=lambda: [ModelConfig()])
    engine: EngineConfig = Field(default_factory=EngineConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    clients: list[ClientConfig] = Field(default_factory=list)
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig)
    placement: PlacementConfig = Field(default_factory=PlacementConfig)
    containment: ContainmentConfig = Field(default_factory=ContainmentConfig)

    @model_validator(mode="after")
    def _containable_clients(self) -> RunConfig:
        """Contained clients must be processes this run starts (ContainmentConfig)."""
        if self.containment.clients == "off":
            return self
        if self.placement.kind != "local" and self.clients:
            raise ValueError(f"containment.clients {self.containment.clients} contains client processes that "
                             "`swarm run` starts itself; Ray actors cannot be: use placement.kind local or "
                             "containment.clients off")
        for i, c in enumerate(self.clients):
            if not c.isolate:
                raise ValueError(f"clients.{i}.isolate is false: a thread of the run cannot be contained "
                                 f"(containment.clients {self.containment.clients}); set isolate: true")
        return self

    @model_validator(mode="after")
    def _weights_seed(self) -> RunConfig:
        """A model that does not pin `seed` takes the run's `trainer.seed`: resolved here, so every process
        that loads it (trainer, replicas, Ray actors) builds the same weights."""
        for m in self.models:
            if m.seed is None:
                m.seed = self.trainer.seed
        return self

    @field_validator("models")
    @classmethod
    def _unique_names(cls, models: list[ModelConfig]) -> list[ModelConfig]:
        names = [m.name for m in models]
        if not models:
            raise ValueError("at least one model is required")
        if len(set(names)) != len(names):
            raise ValueError(f"model names must be unique, got {names}")
        return models
