"""What the spec_decode modes share: the grounded (copy the prompt) and chat prompts, the
n-gram and layer-skip speculative configs, and acceptance figures from the spec-decode
counters."""

from __future__ import annotations

TEXTS = [
    "The library opens at nine in the morning and closes at six in the evening. "
    "On Saturdays it closes at noon, and on Sundays it is closed all day. Members can "
    "borrow up to five books at a time for three weeks, and renew them twice online.",
    "To make the bread, mix the flour, the salt and the yeast in a large bowl. Add the "
    "warm water slowly and knead the dough for ten minutes until it is smooth. Leave it "
    "to rise for an hour, shape it, and bake it for thirty minutes at two hundred degrees.",
    "The meeting on Tuesday covered three topics: the budget for next year, the new "
    "office in Lyon, and the hiring plan. The budget was approved, the office opens in "
    "March, and the hiring plan will be discussed again at the next meeting.",
    "Our train leaves the central station at eight fifteen and arrives in the city at "
    "ten forty. Tickets cost twenty euros each way, and children under twelve travel "
    "free when they are with an adult who holds a ticket.",
]
TASKS = [
    "Correct any mistakes in the text below and return the whole corrected text.",
    "Rewrite the text below exactly, as it is, in one paragraph.",
    "Summarise the text below, keeping its sentences as they are.",
]
QUESTIONS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a bicycle works to a ten year old.",
    "What are three good habits for staying healthy?",
    "Describe a walk along a beach at sunset.",
]
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 2,
    "prompt_lookup_max": 4,
}
LAYER_SKIP = {"method": "layer_skip", "num_layers": 29, "num_speculative_tokens": 2}
KEY_LEN = 8  # replay prompts differ in their first KEY_LEN tokens: the replay's lookup key


def grounded_messages(count: int) -> list[list[dict]]:
    return [
        [{"role": "user", "content": f"{TASKS[i % len(TASKS)]}\n\n{TEXTS[i % len(TEXTS)]}"}]
        for i in range(count)
    ]


def chat_messages(count: int) -> list[list[dict]]:
    return [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(count)]


def draft_counts(stats) -> tuple[int, int, int]:
    """(verify steps, draft tokens, accepted tokens) of spec-decode stats (None: zeros)."""
    if stats is None:
        return 0, 0, 0
    return stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens


def spec_delta(after: tuple, before: tuple) -> dict:
    """Acceptance figures between two draft_counts."""
    steps, drafted, accepted = (a - b for a, b in zip(after, before))
    return {
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "verify_steps": steps,
        "acceptance": accepted / drafted if drafted else None,
        "mean_accepted_length": 1 + accepted / steps if steps else None,
    }
