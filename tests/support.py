"""Shared test helpers: starting servers and whole runs in-process, and teaching the tiny model to call a tool."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from filelock import FileLock

from core.serve.chat import ChatRenderer
from core.config_io import load_config
from core.engine.factory import make_engine
from core.episodes.wire import ClientGrant
from core.models import build_tiny
from core.serve.server import Policy, Server

ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                       "required": ["a", "b"]},
    },
}
TOOL_CALL_TEXT = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
ANSWER_TEXT = "The sum is 5."
GREEDY_MARGIN = 3.0  # logits: far above kernel rounding (~1e-4), so no near-tie can flip on another CPU
CHECK_EVERY = 25  # a margin check costs about one training step over all examples
MAX_FIT_STEPS = 2000  # it fits in ~200-400 steps here; 2000 only bounds a machine where it never would
USER_PROMPTS = ["What is 2 + 3?", "Add 2 and 3.", "Please compute 2+3", "2 plus 3?", "sum of two and three"]


def train_in_process(core, on_step=None) -> None:
    """A `core.run.loop.CoreRun` from start to end in this process, as `swarm run` drives it: its server
    and clients up, trained to its last step (or its failure), then both stopped whatever happened."""
    core.server.start()
    try:
        core.start_clients()
        core.train(on_step=on_step)
    finally:
        core.stop_clients()
        core.server.stop()


def serve_policies(policies: dict[str, Policy] | None = None, **overrides) -> Server:
    sets = [f"{k.replace('__', '.')}={json.dumps(v)}" for k, v in overrides.items()]
    cfg = load_config(overrides=["server.port=0", "engine.default_max_tokens=16", *sets])
    server = Server(cfg, policies=policies)
    server.start()
    return server


def credential(server: Server, sandbox: str = "default", *, version: str = "", kind: str = "train",
               split: str = "train", group_size: int | None = None, concurrency: int = 1, seed: str | None = None) -> str:
    """A client credential `server` issued (as a run does for each client it launches), for a test that opens
    episodes itself on a server that takes no anonymous opens: `SwarmClient(url, credential=...)`."""
    return server.credentials.issue(ClientGrant(sandbox=sandbox, version=version, kind=kind, split=split,
                                                group_size=group_size or server.cfg.trainer.group_size,
                                                concurrency=concurrency, seed=seed))


def tiny_policy(model, tok, name: str = "policy", engine: str = "hf") -> Policy:
    cfg = load_config()
    return Policy(name, model, tok, ChatRenderer(tok), make_engine(engine, model, tok, cfg.engine, 2048))


def tool_calling_tiny_shared(folder: Path):
    """`tool_calling_tiny()`, trained once per test session however many pytest-xdist workers ask.

    The first worker trains it (tens of seconds) and saves the weights in `folder`, which all workers
    of one session share; the others wait on the lock and load the very same weights.
    """
    weights = folder / "tool-calling-tiny.pt"
    with FileLock(str(weights) + ".lock"):
        if weights.is_file():
            model, tok = build_tiny(seed=0)
            model.load_state_dict(torch.load(weights))
            model.eval()
            return model, tok
        model, tok = tool_calling_tiny()
        torch.save(model.state_dict(), weights)
        return model, tok


def tool_calling_tiny(seed: int = 0):
    """Overfit the tiny model on a two-step tool conversation until greedy decoding provably reproduces it.

    Training stops once every target token wins by `GREEDY_MARGIN` logits, checked every
    `CHECK_EVERY` steps, so the fixture does not depend on how fast one CPU's float kernels make it
    converge; it raises (failing the fixture, not the tests) if `MAX_FIT_STEPS` are not enough.
    Returns (model, tokenizer).
    """
    model, tok = build_tiny(seed=seed)
    examples = []
    # The same tool as LangChain renders it (key order differs, so the prompt text differs): the
    # LangGraph client test sends that schema, and a model this small does not generalise to it.
    langchain_add = {"type": "function", "function": {
        "name": "add", "description": "Add two integers.",
        "parameters": {"properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"],
                       "type": "object"}}}
    variants = [(ADD_TOOL if i % 2 == 0 else {"type": "function", "function": {**ADD_TOOL["function"], "description": "adds"}},
                 prompt) for i, prompt in enumerate(USER_PROMPTS)]
    variants += [(langchain_add, prompt) for prompt in USER_PROMPTS]
    for tool, prompt in variants:
        tools = [tool]
        user = [{"role": "user", "content": prompt}]
        call_msg = {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]}
        after_tool = user + [call_msg, {"role": "tool", "tool_call_id": "c1", "content": "5"}]
        for msgs, target in ((user, TOOL_CALL_TEXT), (after_tool, ANSWER_TEXT)):
            prompt_text = tok.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True)
            p = tok(prompt_text, add_special_tokens=False)["input_ids"]
            t = tok(target, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            examples.append((p, t))
    opt = torch.optim.Adam(model.parameters(), lr=5e-3)
    g = torch.Generator().manual_seed(seed)
    for step in range(1, MAX_FIT_STEPS + 1):
        model.train()
        idx = torch.randperm(len(examples), generator=g)[:4].tolist()
        loss = sum(torch.nn.functional.cross_entropy(_target_logits(model, *examples[i]), torch.tensor(examples[i][1]))
                   for i in idx)
        opt.zero_grad()
        (loss / len(idx)).backward()
        opt.step()
        if step % CHECK_EVERY == 0 and _weakest_margin(model, examples) >= GREEDY_MARGIN:
            model.eval()
            return model, tok
    raise RuntimeError(f"the tool-calling fixture did not fit: after {MAX_FIT_STEPS} steps greedy decoding still does not "
                       f"reproduce every training example with a logit margin of {GREEDY_MARGIN} (weakest "
                       f"{_weakest_margin(model, examples):.2f}); the tests that use it cannot run on this machine")


def _target_logits(model, prompt: list[int], target: list[int]) -> torch.Tensor:
    return model(torch.tensor([prompt + target])).logits[0, len(prompt) - 1 : -1]


@torch.no_grad()
def _weakest_margin(model, examples: list[tuple[list[int], list[int]]]) -> float:
    """Smallest (target logit - best other logit) over every target token of every example.

    Positive everywhere means greedy decoding reproduces each example; a margin well above the
    float noise of another CPU's kernels (incremental decoding, other SIMD paths) means it does so
    on any machine, which is what the tests relying on exact tool-call text need.
    """
    model.eval()
    worst = float("inf")
    for prompt, target in examples:
        logits = _target_logits(model, prompt, target).float()
        tgt = torch.tensor(target)
        chosen = logits.gather(1, tgt[:, None])[:, 0]
        others = logits.scatter(1, tgt[:, None], float("-inf")).max(dim=1).values
        worst = min(worst, float((chosen - others).min()))
    return worst
