"""Timeline merging: actor-update tokens and time, unmerged against merged, on recorded episodes.

Records multi-turn tool-use episodes of 5, 10 and 20 turns from a live server running
`smollm2-135m` (the agent offers an `add` tool, runs whatever the model calls, and feeds results
back). "Branching" episodes also retry one turn, as agent frameworks do, which breaks the straight
line. For each set it reports the actor-update tokens of every mode against the prefix tree's
unique-token lower bound, and times one actor update (forward + backward over the packed
micro-batches) unmerged against linear-merged, in the same process, back to back.

With `--sandbox NAME` it records that sandbox's own episodes instead (its first `--episodes` tasks,
run by its `rollout` through an episode), e.g. the multi-turn `guess` game.

    .venv/bin/python bench/merge.py [--turns 5 10 20] [--episodes 2] [--max-tokens 16] [--kinds linear branching] [--repeats 2]
    .venv/bin/python bench/merge.py --sandbox guess --episodes 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from core.clients.sdk import SwarmClient  # noqa: E402
from core.config_io import load_config  # noqa: E402
from core.clients.sandbox import Agent, load_agent  # noqa: E402
from core.serve.server import Server  # noqa: E402
from core.train.timelines import merge_calls, merge_stats  # noqa: E402
from core.train.packing import pack, token_logprobs  # noqa: E402

TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}]
TOKEN_BUDGET = 2048  # padded tokens per micro-batch: SmolLM2's 49k-entry logits make bigger ones memory-bound


async def episode(client: SwarmClient, turns: int, max_tokens: int, branch: bool, seed: int) -> str:
    async with client.aepisode(task_id=f"t{turns}-{seed}", sandbox="merge-bench", group_size=1) as ep:
        messages = [{"role": "system", "content": "You are a calculator agent. Use the add tool."},
                    {"role": "user", "content": f"Add up 3, 4, 5 and {seed}, one step at a time."}]
        for turn in range(turns):
            if branch and turn == turns // 2:  # a framework retry: same context sampled again, result dropped
                await ep.openai.chat.completions.create(model="policy", messages=messages, tools=TOOLS,
                                                        max_tokens=max_tokens)
            # No request seed: a train episode's calls are sampled by the server's seeds (a request's own is a 400).
            r = await ep.openai.chat.completions.create(model="policy", messages=messages, tools=TOOLS,
                                                        max_tokens=max_tokens)
            msg = r.choices[0].message
            messages.append(msg.model_dump(exclude_none=True))
            for call in msg.tool_calls or []:
                try:
                    args = json.loads(call.function.arguments)
                    result = str(int(args.get("a", 0)) + int(args.get("b", 0)))
                except (ValueError, TypeError, AttributeError):
                    result = "error: add takes integers a and b"
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
            if not msg.tool_calls:
                messages.append({"role": "user", "content": "Continue."})
        await ep.finish(0.0)
        return ep.id


async def sandbox_episode(client: SwarmClient, agent: Agent, task: dict) -> str:
    async with client.aepisode(task_id=str(task["id"]), sandbox=agent.name, group_size=1) as ep:
        await ep.finish((await agent.rollout(task, ep.openai)).reward)  # a checked Outcome (core.clients.sandbox)
        return ep.id


def actor_update_seconds(model, samples, repeats: int = 2) -> float:
    for s in samples:
        s.advantage = 1.0
    best = float("inf")
    for _ in range(repeats):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        for mb in pack(samples, TOKEN_BUDGET):
            logp, _ = token_logprobs(model, mb)
            (-(logp * mb.loss_mask).sum()).backward()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--turns", type=int, nargs="+", default=[5, 10, 20])
    ap.add_argument("--episodes", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--kinds", nargs="+", choices=["linear", "branching"], default=["linear", "branching"])
    ap.add_argument("--repeats", type=int, default=2, help="timed updates per mode; the best counts")
    ap.add_argument("--sandbox", help="record this sandbox's episodes instead of the tool-use agent's")
    args = ap.parse_args()
    agent = load_agent(f"sandbox:{args.sandbox}") if args.sandbox else None
    cfg = load_config(overrides=[f"models=[{{name: policy, source: {args.model}}}]", "server.port=0", "server.lease_s=3600",
                                 "trainer.batch_groups=1"])
    server = Server(cfg)
    server.start()
    client = SwarmClient(server.url)
    rows = []
    try:
        sets = [(turns, branch) for turns in args.turns for branch in [k == "branching" for k in args.kinds]]
        for turns, branch in ([("sandbox", False)] if agent else sets):
            async def record():
                if agent:
                    tasks = list(agent.tasks("train"))[: args.episodes]
                    return await asyncio.gather(*(sandbox_episode(client, agent, t) for t in tasks))
                return await asyncio.gather(*(episode(client, turns, args.max_tokens, branch, s) for s in range(args.episodes)))
            ids = asyncio.run(record())
            finished = {}
            while (batch := server.registry.take_batch(server.versions(), max_staleness=0)) is not None:
                finished.update({e.id: e for e in batch.episodes})  # group_size 1: each episode is a ready group
            logs = [finished[i].calls for i in ids]
            stats = [merge_stats(c) for c in logs]
            unmerged = sum(s["unmerged_tokens"] for s in stats)
            linear = sum(s["linear_tokens"] for s in stats)
            tree = sum(s["tree_tokens"] for s in stats)
            model = server.policies["policy"].model
            model.train()
            t_none, t_linear, t_tree = (
                actor_update_seconds(model, [x for c in logs for x in merge_calls(c, mode)], args.repeats)
                for mode in ("none", "linear", "tree")
            )
            model.eval()
            kind = args.sandbox if agent else ("branching" if branch else "linear")
            rows.append((turns, kind, sum(len(c) for c in logs), unmerged, linear, tree,
                         t_none, t_linear, t_tree))
            print("measured", rows[-1], flush=True)
    finally:
        client.close()
        server.stop()
    print("tokens: unmerged | linear merge | tree merge, which packs each unique prefix-tree token once: the lower bound")
    print("time: one actor update, seconds; x = unmerged / merged; eff = time x / token x (target >= 0.8)")
    print(f"{'turns':>5} {'episode':>9} {'calls':>5} {'unmerged':>8} {'linear':>6} {'tree=bound':>10} "
          f"{'lin/bnd':>7} {'tree/bnd':>8} {'t_unm':>6} {'t_lin':>6} {'t_tree':>6} {'lin x':>6} {'lin eff':>7} "
          f"{'tree x':>6} {'tree eff':>8}")
    for turns, kind, n, un, lin, tree, tn, tl, tt in rows:
        print(f"{turns:>5} {kind:>9} {n:>5} {un:>8} {lin:>6} {tree:>10} {lin / tree:>7.3f} {1.0:>8.3f} "
              f"{tn:>6.2f} {tl:>6.2f} {tt:>6.2f} {un / lin:>6.2f} {(tn / tl) / (un / lin):>7.2f} "
              f"{un / tree:>6.2f} {(tn / tt) / (un / tree):>8.2f}")
    print(f"torch threads {torch.get_num_threads()}; update = forward + backward over micro-batches of {TOKEN_BUDGET} padded tokens")


if __name__ == "__main__":
    main()
