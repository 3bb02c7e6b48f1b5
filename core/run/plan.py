"""Where a run's parts live: the placement plan that `swarm run --dry-run` prints, checked before anything starts.

`plan(cfg)` reads a validated config and says what runs where with which resources: the gateway
and episode registry (always one HTTP service in the `swarm run` process, reached by URL), each
model's engine and trainer (colocated, in this process or in one Ray actor per model), and each
client (a thread, a process, or Ray actors). It checks what the schema alone cannot (a model on
`cuda` under Ray needs a GPU reserved for it) and raises `ConfigError` naming the key.

`PlacementError` lives here too: the Ray driver raises it, and this module imports nothing that
starts a run, so `core.ray` can import it without going round through `core.run.placement`.
This module deliberately starts nothing and does not know Ray's API; `core.run.placement` builds the run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from core.config import ModelConfig, RunConfig
from core.config_io import ConfigError
from core.engine.devices import child_env, local_device, model_devices, sleeping_replicas
from core.train.memory import (DeviceUse, Footprint, device_memory_gb, device_use, footprint, rank_gb, replica_use,
                               sharding_of)

LOOPBACK = ("127.0.0.1", "localhost", "::1")
REPLICA_ENGINES = ("hf", "vllm")
# The vLLM shares of a GPU a refused plan tries, largest first, to say what would fit.
UTILIZATION_STEPS = (0.35, 0.3, 0.25, 0.2, 0.15, 0.1)  # the engine kinds a replica process builds (`core.engine.replica_child.build_replica`)


class PlacementError(RuntimeError):
    """The placement could not be set up (the cluster cannot be reached, an actor does not start)."""


@dataclass(frozen=True)
class Placed:
    """One row of the plan: a part of the run, where it runs, and what it reserves."""

    part: str  # e.g. "model policy: engine hf + trainer"
    where: str  # e.g. "Ray actor swarm-model-policy" or "this process"
    cpus: float = 0.0
    gpus: float = 0.0
    note: str = ""


@dataclass(frozen=True)
class Plan:
    kind: str
    rows: list[Placed]
    warnings: list[str]
    episodes_in_flight: int  # most train/eval episodes the clients keep open at once

    @property
    def cpus(self) -> float:
        return sum(r.cpus for r in self.rows)

    @property
    def gpus(self) -> float:
        return sum(r.gpus for r in self.rows)


def plan(cfg: RunConfig) -> Plan:
    """The placement of `cfg`; raises ConfigError for a placement that cannot work."""
    ray = cfg.placement.kind == "ray"
    rows = [Placed("gateway + episode registry (HTTP)", "this process" + (" (the Ray driver)" if ray else ""),
                   note=f"clients reach it at http://{_shown_host(cfg.server.host)}:{cfg.server.port or '<free port>'}")]
    warnings: list[str] = []
    for i, m in enumerate(cfg.models):
        if m.replicas > 1 or m.trainer.world_size > 1:
            rows += _spread_model(cfg, i, m, ray, warnings)
            continue
        part = f"model {m.name} ({m.source}): engine {cfg.engine.kind}" + (" + trainer" if m.trainable else "")
        part += " (LoRA r=%d)" % m.lora.r if m.lora is not None else ""
        if ray:
            _check_ray_device(i, m.device, m.ray.num_gpus)
            extra = f", resources {m.ray.resources}" if m.ray.resources else ""
            rows.append(Placed(part, "a Ray actor", m.ray.num_cpus, m.ray.num_gpus,
                               f"device {m.device}{extra}; weight sync stays inside the actor"))
        else:
            rows.append(Placed(part, "this process", note=f"device {m.device}"))
    in_flight = 0
    for c in cfg.clients:
        part = f"client {c.agent} ({c.kind}, {c.concurrency} episodes in flight each)"
        if ray:
            extra = f", resources {c.ray.resources}" if c.ray.resources else ""
            rows.append(Placed(part, f"{c.ray.replicas} Ray actor(s)",
                               c.ray.num_cpus * c.ray.replicas, 0.0, f"{c.ray.num_cpus} CPU each{extra}"))
            in_flight += c.concurrency * c.ray.replicas
        else:
            contained = f", contained: {cfg.containment.clients}" if cfg.containment.clients != "off" else ""
            rows.append(Placed(part, f"its own process (swarm client{contained})" if c.isolate else "a thread of this process"))
            in_flight += c.concurrency
    if ray and cfg.clients and cfg.server.host in LOOPBACK and cfg.placement.address != "local":
        warnings.append(f"server.host is {cfg.server.host}: client actors on other nodes cannot reach it; "
                        "set server.host: 0.0.0.0 for a multi-node cluster")
    if in_flight > cfg.server.max_open_episodes:
        warnings.append(f"clients keep {in_flight} episodes in flight but server.max_open_episodes is "
                        f"{cfg.server.max_open_episodes}: the rest are refused and retried")
    return Plan(cfg.placement.kind, rows, warnings, in_flight)


def _spread_model(cfg: RunConfig, index: int, m: ModelConfig, ray: bool, warnings: list[str]) -> list[Placed]:
    """The rows of a model on several devices: its trainer ranks and its replicas, each device
    checked (it exists here, a replica and a rank share one only when colocated) and its memory summed."""
    key = f"models.{index}"
    gpus = torch.cuda.device_count()
    on_gpu = m.device.startswith("cuda") or (m.device == "auto" and gpus > 0) or m.trainer.devices is not None and \
        any(d.startswith("cuda") for d in m.trainer.devices)
    ranks, replicas = model_devices(m, gpus)
    if m.replicas > 1 and cfg.engine.kind not in REPLICA_ENGINES:
        raise ConfigError(f"{key}.replicas: replicas run the hf or vllm engine, not engine.kind {cfg.engine.kind!r} "
                          "(the instant engine generates nothing to spread)")
    if m.trainer.world_size > 1 and not m.trainable:
        raise ConfigError(f"{key}.trainer.world_size: {m.trainer.world_size} ranks for a model that does not train")
    if ray and on_gpu and m.ray.num_gpus < m.trainer.world_size:
        raise ConfigError(f"{key}.ray.num_gpus: {m.trainer.world_size} trainer ranks on GPUs live in the model's "
                          f"actor, which reserves {m.ray.num_gpus} GPU(s); reserve one per rank")
    if not ray:
        for d in ranks + replicas:
            if d.startswith("cuda") and (gpus == 0 or (":" in d and int(d.split(":")[1]) >= gpus)):
                raise ConfigError(f"{key}: device {d}, but this machine has {gpus} GPU(s)")
    shared = sorted(set(ranks) & set(replicas) - {"cpu"})
    if shared and m.layout == "split":
        warnings.append(f"{key}: layout split, yet {shared} hold both a trainer rank and a replica")
    if m.trainer.sharding == "fsdp2" and m.lora is not None:
        raise ConfigError(f"{key}.trainer.sharding: fsdp2 shards a full fine-tune; a LoRA model trains small "
                          "adapters (use replicate)")
    fp = footprint(cfg, m, on_gpu)
    sharding = sharding_of(cfg, m, ranks) if m.trainer.world_size > 1 else "replicate"
    per_rank = rank_gb(fp, sharding)
    if m.trainer.offload and sharding == "fsdp2":
        raise ConfigError(f"{key}.trainer.offload: sharding auto chose fsdp2 here, whose shards are not offloaded; "
                          "set trainer.sharding replicate, or drop offload")
    _check_memory(cfg, key, m, fp, ranks, replicas, per_rank, sharding, set() if ray else set(sleeping_replicas(m, gpus)))
    lora = f", LoRA r={m.lora.r}" if m.lora is not None else ""
    chosen = f"{sharding} (auto)" if m.trainer.sharding == "auto" else sharding
    other = (f"rank 0 + {_size(fp.replica_gb)} of full weights for engines; replicated {_size(fp.rank_gb)}"
             if sharding == "fsdp2" else f"fsdp2 would be {_size(fp.fsdp_rank_gb)}")
    memory = (f"{fp.parameters / 1e6:.1f}M params x {fp.weight_bytes} B; rank {_size(per_rank)} "
              f"({sharding}; {other}), replica {_size(fp.replica_gb)}")
    where_rank = "the model's Ray actor + its rank processes" if ray else "rank 0 here, the rest processes here"
    rows = [Placed(f"model {m.name} ({m.source}{lora}): trainer x{m.trainer.world_size} "
                   f"({'nccl' if on_gpu else 'gloo'} data-parallel, sharding {chosen})", where_rank,
                   m.ray.num_cpus if ray else 0.0, m.ray.num_gpus if ray else 0.0,
                   f"devices {','.join(ranks)}; {memory}" + ("" if ray else f"; {_processes('rank', ranks, 1)}"))]
    if m.replicas > 1:
        rows.append(Placed(f"model {m.name}: {m.replicas} {cfg.engine.kind} replicas ({m.layout})",
                           f"{m.replicas} Ray actors" if ray else f"{m.replicas} processes here",
                           m.ray.num_cpus * m.replicas if ray else 0.0, (1.0 if on_gpu else 0.0) * m.replicas if ray else 0.0,
                           f"devices {','.join(replicas) if not ray else ('1 GPU each' if on_gpu else 'cpu')}; "
                           "weights synced after each step (" + ("the LoRA adapters" if m.lora is not None else
                                                                 f"{_size(fp.replica_gb)} of weights") + " to each); "
                           + _sleeping(m, gpus, ray) + ("" if ray else f"; {_processes('replica', replicas, 0)}")))
    return rows


def _check_memory(cfg: RunConfig, key: str, m: ModelConfig, fp: Footprint, ranks: list[str], replicas: list[str],
                  per_rank: float, sharding: str, asleep: set[int]) -> None:
    """Raise ConfigError for a GPU of this machine whose need in either phase of a step
    (`core.train.memory.device_use`) exceeds its memory, saying what would fit."""
    def uses(offload: bool, utilization: float) -> dict[str, DeviceUse]:
        trainer_on: dict[str, float] = {}
        for i, d in enumerate(ranks):
            # An fsdp2 rank 0 also keeps the full weights the engines read (core.train.sharded).
            extra = fp.replica_gb if sharding == "fsdp2" and i == 0 else 0.0
            trainer_on[d] = trainer_on.get(d, 0.0) + per_rank + extra
        replicas_on: dict[str, list[tuple[float, float, bool]]] = {}
        for j, d in enumerate(replicas):
            awake, resting = replica_use(fp, cfg.engine.kind, utilization, device_memory_gb(d))
            replicas_on.setdefault(d, []).append((awake, resting, j in asleep))
        return {d: device_use(trainer_on.get(d, 0.0), offload, replicas_on.get(d, []))
                for d in dict.fromkeys([*ranks, *replicas])}

    def too_big(found: dict[str, DeviceUse]) -> list[tuple[str, DeviceUse, float]]:
        return [(d, u, have) for d, u in found.items() if (have := device_memory_gb(d)) is not None and u.peak_gb > have]

    utilization = cfg.engine.gpu_memory_utilization
    over = too_big(uses(m.trainer.offload, utilization))
    if not over:
        return
    d, use, have = over[0]
    fits = []
    can_offload = not m.trainer.offload and sharding != "fsdp2"
    candidates = ([(True, utilization)] if can_offload else []) + \
        [(o, u) for o in ([m.trainer.offload, True] if can_offload else [m.trainer.offload])
         for u in UTILIZATION_STEPS if cfg.engine.kind == "vllm" and u < utilization and u * have > fp.replica_gb]
    for offload, u in candidates:
        if not too_big(uses(offload, u)):
            change = [f"{key}.trainer.offload: true"] if offload != m.trainer.offload else []
            change += [f"engine.gpu_memory_utilization: {u:g}"] if u != utilization else []
            peak = max(x.peak_gb for x in uses(offload, u).values())
            fits.append(f"with {' and '.join(change)} the fullest GPU would hold {peak:.1f} GB")
            break
    hint = fits[0] if fits else "use LoRA, trainer.sharding fsdp2, fewer replicas on it, or more devices"
    raise ConfigError(f"{key}: {d} would hold {use.peak_gb:.1f} GB ({use.rollout_gb:.1f} GB during rollout, "
                      f"{use.step_gb:.1f} GB during the step: {'; '.join(use.parts)}; before activations) but has "
                      f"{have:.1f} GB; {hint}")


def _processes(kind: str, devices: list[str], first: int) -> str:
    """Each process's devices as it sees them (`core.engine.devices`): its GPU alone, as cuda:0. Rank 0
    (first=1 for ranks) is this process, which sees every GPU."""
    shown = [f"{kind} 0: this process" for _ in devices[:first]]
    for i, d in enumerate(devices[first:], start=first):
        seen = child_env(d)["CUDA_VISIBLE_DEVICES"] if d.startswith("cuda") else ""
        shown.append(f"{kind} {i}: CUDA_VISIBLE_DEVICES={seen} ({local_device(d)} inside)" if seen
                     else f"{kind} {i}: no GPU visible")
    return ", ".join(shown)


def _sleeping(m: ModelConfig, gpus: int, ray: bool) -> str:
    """Whether the replicas sleep during the trainer's step (`core.engine.replicas.ReplicaEngine.sleep_during_step`)."""
    if ray:
        return "not sleeping: each Ray replica holds a GPU of its own"
    asleep = sleeping_replicas(m, gpus)
    if asleep:
        return f"sleeping during the step: replica(s) {','.join(map(str, asleep))} share a trainer rank's GPU"
    if m.layout == "colocated":
        return "not sleeping: colocated on cpu, where host memory is not what a step runs short of"
    return "not sleeping: layout split"


def _size(gb: float) -> str:
    return f"{gb:.2f} GB" if gb >= 0.1 else f"{gb * 1000:.1f} MB"


def _shown_host(host: str) -> str:
    return "<this node's IP>" if host in ("0.0.0.0", "::", "") else host


def _check_ray_device(index: int, device: str, num_gpus: float) -> None:
    key = f"models.{index}"
    if device.startswith("cuda") and num_gpus < 1:
        raise ConfigError(f"{key}.ray.num_gpus: the model is on {device} but its actor reserves {num_gpus} GPUs; "
                          "Ray only shows an actor the GPUs it reserves")
    ordinal = re.fullmatch(r"cuda:(\d+)", device)
    if ordinal and int(ordinal.group(1)) >= num_gpus:
        raise ConfigError(f"{key}.device: {device} inside an actor that reserves {num_gpus} GPU(s); "
                          "an actor numbers its GPUs from cuda:0")
    if device == "cpu" and num_gpus > 0:
        raise ConfigError(f"{key}.ray.num_gpus: {num_gpus} GPUs reserved for a model on cpu")


def describe(cfg: RunConfig) -> str:
    """The plan as text: what `swarm run --dry-run` prints."""
    p = plan(cfg)
    where = f"Ray cluster at {cfg.placement.address}" if p.kind == "ray" else "this machine"
    lines = [f"placement: {p.kind} ({where})"]
    width = max(len(r.part) for r in p.rows)
    for r in p.rows:
        res = f"cpu {r.cpus:g} gpu {r.gpus:g}" if p.kind == "ray" else ""
        lines.append(f"  {r.part:<{width}}  {r.where}  {res}  {r.note}".rstrip())
    steps, groups, size = cfg.trainer.steps, cfg.trainer.batch_groups, cfg.trainer.group_size
    lines.append(f"training: {steps} steps x {groups} groups x {size} episodes; "
                 f"{p.episodes_in_flight} episodes in flight at most")
    if p.kind == "ray":
        lines.append(f"reserves: {p.cpus:g} CPUs, {p.gpus:g} GPUs (plus the driver's own process)")
    lines += [f"warning: {w}" for w in p.warnings]
    return "\n".join(lines)
