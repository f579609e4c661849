"""Generate ``corpus.txt``: a few hundred KB of simple English-like prose for the GPT demo.

The text is produced by a small random grammar with a fixed seed, so it is reproducible and
free of any licence question (no downloads). It has enough structure (words, agreement,
punctuation, recurring characters) that a byte-level model's loss drops visibly within a few
hundred steps. Run ``python examples/data/make_corpus.py`` to regenerate it.
"""

from __future__ import annotations

import random
from pathlib import Path

NAMES = ["Ada", "Bram", "Cora", "Dmitri", "Elena", "Finn", "Greta", "Hugo", "Iris", "Jonas"]
ADJ = ["old", "quiet", "bright", "small", "cold", "green", "tall", "gentle", "dark", "busy"]
NOUN = [
    "harbor",
    "garden",
    "village",
    "river",
    "forest",
    "market",
    "library",
    "bridge",
    "tower",
    "meadow",
    "kitchen",
    "station",
]
THING = [
    "a lantern",
    "an apple",
    "a letter",
    "a map",
    "a basket of bread",
    "a wooden box",
    "a silver key",
    "a blue kite",
    "an old book",
    "a cup of tea",
]
VERB_PAST = [
    "walked to",
    "ran past",
    "looked at",
    "painted",
    "visited",
    "left",
    "crossed",
    "remembered",
    "cleaned",
    "found",
]
FEEL = ["happy", "tired", "curious", "worried", "calm", "hungry", "proud", "sleepy"]
TIME = [
    "In the morning",
    "At noon",
    "Later that day",
    "In the evening",
    "At night",
    "The next day",
    "After the rain",
    "Before sunrise",
]
WEATHER = [
    "the wind was soft",
    "the sky was grey",
    "the sun was warm",
    "snow fell slowly",
    "rain tapped on the roof",
    "the air smelled of salt",
]


def sentence(rng: random.Random) -> str:
    n1, n2 = rng.sample(NAMES, 2)
    kind = rng.randrange(7)
    if kind == 0:
        return f"{rng.choice(TIME)}, {n1} {rng.choice(VERB_PAST)} the {rng.choice(ADJ)} {rng.choice(NOUN)}."
    if kind == 1:
        return f"{n1} gave {n2} {rng.choice(THING)}, and {n2} felt {rng.choice(FEEL)}."
    if kind == 2:
        return f"{rng.choice(TIME)}, {rng.choice(WEATHER)}."
    if kind == 3:
        return f'"Where is the {rng.choice(NOUN)}?" asked {n1}. "Near the {rng.choice(ADJ)} {rng.choice(NOUN)}," said {n2}.'
    if kind == 4:
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        return f"{n1} counted {a} boats and {b} birds, {a + b} things in all."
    if kind == 5:
        return f"The {rng.choice(NOUN)} was {rng.choice(ADJ)}, so {n1} was {rng.choice(FEEL)}."
    return f"{n1} and {n2} {rng.choice(VERB_PAST)} the {rng.choice(NOUN)} with {rng.choice(THING)}."


def make(size: int = 300_000, seed: int = 1234) -> str:
    rng = random.Random(seed)
    out, total = [], 0
    while total < size:
        para = " ".join(sentence(rng) for _ in range(rng.randint(3, 7))) + "\n\n"
        out.append(para)
        total += len(para)
    return "".join(out)


if __name__ == "__main__":
    path = Path(__file__).with_name("corpus.txt")
    path.write_text(make(), encoding="ascii")
    print(f"wrote {path} ({path.stat().st_size} bytes)")
