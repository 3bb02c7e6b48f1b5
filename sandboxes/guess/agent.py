"""A multi-turn task: guess a hidden number from 1 to 50 in three turns, with higher/lower hints.

Each episode is a real conversation through the OpenAI SDK: the model guesses, the environment
answers "Higher.", "Lower." or "Correct." and asks again, for exactly `TURNS` model calls (a correct
guess is answered "Correct." and the model is asked again, so a solved game shows as repeating the
number; every episode has the same number of calls, which keeps groups comparable).

Measured on the base SmolLM2-135M-Instruct (a probe of 12 games, 36 replies at T=1, with the range
1..100): it usually talks ("I'm guessing the number I am guessing", "My first guess: 450") and gave a
bare in-range number 4 times in 36; the first training step of `configs/smollm2-guess.yaml` scored
a mean reward of 0.03. Exact-win rewards would leave almost every group without variance, so the
reward is shaped per turn and averaged:

- 0 without a number; `MENTION` for a number inside other text or outside 1..50;
- `BARE` for a bare number in range;
- 1 for a bare number that is also consistent with every hint so far (inside the interval the hints
  leave open), which is the part that needs the earlier turns;

plus `CLOSENESS` x (1 - |last guess - secret| / 50) for a final bare guess. The reward lies in
[0, 1 + CLOSENESS]. It does not teach binary search as such: it rewards format and using the hints.
The sandbox is judged (sandbox.toml `judge`): the tasks and the score live in `game.py`, which the
judge imports; the server deals the tasks and scores the replies it recorded, whatever hints this file
sent (the judge narrows by the true secret); the reward returned here is only logged.
"""

from __future__ import annotations

from game import HIGH, LOW, parse_guess, score_game, tasks  # noqa: F401 (the judge's file: its tasks and score)

TURNS = 3  # model calls per episode: the issue asks for at least 3, with the environment's feedback between
MAX_TOKENS = 6  # a bare number is 1-3 tokens and the end token; chatter past that is cut (and costs CPU time)
SYSTEM = (f"Let's play a game. I picked a whole number from {LOW} to {HIGH}. Guess it. Reply with just the number. "
          "After each guess I say higher, lower or correct.")


def feedback(guess: int | None, secret: int) -> str:
    if guess is None:
        return "That is not a number. Reply with just the number."
    if guess < secret:
        return "Higher. Your next guess?"
    if guess > secret:
        return "Lower. Your next guess?"
    return "Correct. Your next guess?"


async def rollout(task, llm) -> float:
    # No temperature here: the server's engine.default_temperature applies, so studies can vary it.
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Your first guess?"}]
    replies: list[str] = []
    for _ in range(TURNS):
        reply = await llm.chat.completions.create(model=llm.model, messages=messages, max_tokens=MAX_TOKENS)
        text = reply.choices[0].message.content or ""
        replies.append(text)
        messages.append({"role": "assistant", "content": text})
        messages.append({"role": "user", "content": feedback(parse_guess(text)[0], task["secret"])})
    return score_game(replies, task["secret"])
