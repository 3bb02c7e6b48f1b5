"""Peak memory of one trainer forward and backward pass at 1k, 2k and 4k tokens: the full-vocabulary scoring it replaced against `core.train.packing.token_logprobs`.

Before: the model's full [B, T, V] logits, an fp32 copy, a tempered copy and a softmax for entropy,
at every position (the code as it was, kept here as `full_vocab_logprobs`). After: the decoder's
hidden states projected to the vocabulary only at loss positions, in checkpointed chunks.

The model is random-initialised with SmolLM2-135M's body (576 hidden, 9 heads, 3 KV heads) cut to
`--layers` layers, and Qwen2's 151,936-token vocabulary, which is where the logits dominate. Each
(arm, tokens) runs in a fresh process, so peaks do not mix; the figure is the process's peak RSS
less its RSS after the model and batch are built. One sample per size: a prompt of a quarter of
the tokens and a completion of the rest, all trained, at temperature 0.7 (the tempered path).

    .venv/bin/python bench/train_memory.py [--layers 4] [--vocab 151936]

It measures and prints; it asserts nothing. The last line: `train_memory: ratio_4k=<after/before>`.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SIZES = (1024, 2048, 4096)


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def full_vocab_logprobs(model, mb):
    """The scoring as it was before this change: full logits at every position (linear rows only)."""
    import torch

    out = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids, use_cache=False)
    logits = out.logits.float()
    has_predictor = mb.predictor_index >= 0
    source = mb.predictor_index.clamp(min=0)
    rows = torch.arange(logits.shape[0])[:, None]
    if bool((mb.temperatures != 1.0).any()):
        logits = logits[rows, source] / mb.temperatures[..., None]
        source = torch.arange(logits.shape[1]).expand_as(source)
    log_norm = torch.logsumexp(logits, dim=-1)
    token_logit = logits[rows, source, mb.input_ids]
    logprobs = torch.where(has_predictor, token_logit - log_norm[rows, source], torch.zeros_like(token_logit))
    with torch.no_grad():
        probs = torch.softmax(logits, dim=-1)
        entropy_at = log_norm - (probs * logits).sum(dim=-1)
        entropy = torch.where(has_predictor, entropy_at[rows, source], torch.zeros_like(entropy_at))
    return logprobs, entropy


def one(arm: str, tokens: int, layers: int, vocab: int) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from core.train.loss import policy_loss
    from core.train.packing import pack, token_logprobs
    from core.train.timelines import Sample

    torch.manual_seed(0)
    torch.set_num_threads(2)
    config = LlamaConfig(vocab_size=vocab, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                         tie_word_embeddings=True, attn_implementation="sdpa")
    model = LlamaForCausalLM(config).train()
    prompt = tokens // 4
    ids = torch.randint(1, vocab, (tokens,)).tolist()
    sample = Sample(input_ids=ids, loss_mask=[i >= prompt for i in range(tokens)],
                    logprobs=[-3.0 if i >= prompt else 0.0 for i in range(tokens)], position_ids=list(range(tokens)),
                    advantage=1.0, temperatures=[0.7 if i >= prompt else 1.0 for i in range(tokens)])
    (mb,) = pack([sample], token_budget=tokens)
    base = _rss_mib()
    if arm == "before":
        logp, _ = full_vocab_logprobs(model, mb)
    else:
        logp, _ = token_logprobs(model, mb, positions=mb.loss_mask)
    terms = policy_loss(logp, mb.old_logprobs, mb.advantages, mb.loss_mask, mb.weights, clip_low=0.2, clip_high=0.28,
                        normalizer=float(mb.loss_mask.sum()))
    terms.loss.backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return {"arm": arm, "tokens": tokens, "peak_mib": peak - base, "loss": float(terms.loss)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--one", nargs=2, metavar=("ARM", "TOKENS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one[0], int(args.one[1]), args.layers, args.vocab)))
        return
    results: dict[tuple[str, int], dict] = {}
    for tokens in SIZES:
        for arm in ("before", "after"):  # side by side, size by size
            out = subprocess.run([sys.executable, __file__, "--one", arm, str(tokens), "--layers", str(args.layers),
                                  "--vocab", str(args.vocab)], capture_output=True, text=True, check=True)
            results[arm, tokens] = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"model: {args.layers} layers x 576 hidden, vocabulary {args.vocab}; one sample, 3/4 of it trained")
    print(f"{'tokens':>7} {'before MiB':>11} {'after MiB':>10} {'after/before':>13} {'loss before':>12} {'loss after':>11}")
    for tokens in SIZES:
        b, a = results["before", tokens], results["after", tokens]
        print(f"{tokens:>7} {b['peak_mib']:>11.0f} {a['peak_mib']:>10.0f} {a['peak_mib'] / b['peak_mib']:>13.2f} "
              f"{b['loss']:>12.5f} {a['loss']:>11.5f}")
    ratio = results["after", 4096]["peak_mib"] / results["before", 4096]["peak_mib"]
    print(f"train_memory: ratio_4k={ratio:.2f}")


if __name__ == "__main__":
    main()
