"""A corpus the project generates itself, so that training runs and tests need no download.

Documents are short stories from a small grammar over a fixed vocabulary of a few hundred
words, with patterns a tiny GPT learns within a hundred steps: counting sequences, small
arithmetic, the days of the week, a cast of names and a saying that recur within a document
(so attention pays off). The text depends only on (count, seed): randomness comes from
random.Random(seed).random() alone, whose Mersenne Twister stream is the same on every
platform and Python version (choice, randrange and shuffle have changed across versions).
"""
from __future__ import annotations

import random

NAMES = ("Alice", "Bruno", "Clara", "Dmitri", "Elena", "Farid", "Greta", "Hugo", "Ines", "Jonas", "Kira",
         "Leo", "Maya", "Nils", "Olga", "Pablo", "Quinn", "Rosa", "Sami", "Tara", "Umar", "Vera", "Wes",
         "Xenia", "Yusuf", "Zoe", "Anton", "Bea", "Cyrus", "Dora", "Emil", "Fay", "Gus", "Hana", "Ivo",
         "Juno", "Karl", "Lena", "Milo", "Nora")
VERBS = ("found", "lost", "painted", "carried", "opened", "closed", "cleaned", "broke", "fixed", "bought",
         "sold", "hid", "washed", "dropped", "lifted", "pushed", "pulled", "repaired", "wrapped", "moved",
         "borrowed", "returned", "built", "filled", "emptied", "kicked", "threw", "caught", "polished",
         "measured", "weighed", "drew", "sorted", "stacked", "folded", "shook", "tied", "buried", "watered",
         "admired")
OBJECTS = ("lamp", "box", "chair", "table", "book", "kettle", "basket", "ladder", "bucket", "rope", "coin",
           "key", "map", "clock", "mirror", "blanket", "bottle", "candle", "drum", "flute", "hat", "kite",
           "ball", "shoe", "spoon", "plate", "cup", "jar", "bell", "brush", "comb", "glove", "ring", "sack",
           "stone", "shell", "feather", "apple", "pear", "lemon", "carrot", "onion", "loaf", "cake", "pot",
           "pan", "knife", "fork", "hammer", "nail", "saw", "wheel", "cart", "boat", "sail", "net", "fence",
           "gate", "door", "window")
ADJECTIVES = ("red", "blue", "green", "yellow", "black", "white", "old", "new", "small", "big", "heavy",
              "light", "shiny", "dusty", "wooden", "broken", "round", "square", "soft", "hard", "warm",
              "cold", "wet", "dry", "clean", "dirty", "tall", "short", "long", "strange", "lucky", "quiet",
              "loud", "bright", "dark", "sweet", "sour", "golden", "silver", "tiny")
PLACES = ("kitchen", "garden", "market", "harbor", "forest", "library", "school", "bakery", "station",
          "castle", "village", "meadow", "river", "bridge", "tower", "cellar", "attic", "barn", "square",
          "museum", "hospital", "theater", "farm", "mill", "beach", "island", "valley", "hill", "cave",
          "lighthouse")
TIMES = ("in the morning", "at noon", "in the evening", "at night", "after lunch", "before dinner",
         "on monday", "on friday", "last week", "yesterday")
FEELINGS = ("happy", "sad", "tired", "hungry", "curious", "proud", "afraid", "surprised", "calm", "angry")
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
                "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen",
                "nineteen", "twenty")
DAYS = ("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday")

MIN_CHARS, MAX_CHARS = 500, 2000
LONGEST_SENTENCE = 150  # a document stops growing once past its target, which is this far below MAX_CHARS


def _below(rng: random.Random, n: int) -> int:
    return int(rng.random() * n)


def _plural(noun: str) -> str:
    return noun + ("es" if noun.endswith(("s", "x", "sh", "ch")) else "s")


def _pick(rng: random.Random, items):
    return items[_below(rng, len(items))]


class _Story:
    """One document: a cast, a home and a saying that recur, and sentences about them."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        cast = []
        while len(cast) < 2 + _below(rng, 3):
            name = _pick(rng, NAMES)
            if name not in cast:
                cast.append(name)
        self.cast = cast
        self.home = _pick(rng, PLACES)
        self.saying = (f"a {_pick(rng, ADJECTIVES)} {_pick(rng, OBJECTS)} is better than "
                       f"a {_pick(rng, ADJECTIVES)} {_pick(rng, OBJECTS)}")

    def name(self) -> str:
        # Mostly the cast, now and then a passer-by.
        return _pick(self.rng, self.cast) if self.rng.random() < 0.85 else _pick(self.rng, NAMES)

    def thing(self) -> str:
        return f"{_pick(self.rng, ADJECTIVES)} {_pick(self.rng, OBJECTS)}"

    def sentence(self) -> str:
        rng = self.rng
        kind = _below(rng, 10)
        if kind == 0:
            start = 1 + _below(rng, 6)
            stop = min(len(NUMBER_WORDS), start + 4 + _below(rng, 8))
            return f"{self.name()} counted {' '.join(NUMBER_WORDS[start:stop])} ."
        if kind == 1:
            a, b = _below(rng, 13), _below(rng, 13)
            op = _below(rng, 3)
            if op == 0:
                return f"{a} plus {b} is {a + b} ."
            if op == 1:
                return f"{max(a, b)} minus {min(a, b)} is {max(a, b) - min(a, b)} ."
            return f"{a} times {b} is {a * b} ."
        if kind == 2:
            start = _below(rng, 7)
            days = [DAYS[(start + i) % 7] for i in range(3 + _below(rng, 5))]
            return f"{self.name()} worked on {' and then '.join(days)} ."
        if kind == 3:
            return f"as {self.cast[0]} always says , {self.saying} ."
        if kind == 4:
            return f"{self.name()} went back to the {self.home} with {self.name()} {_pick(rng, TIMES)} ."
        if kind == 5:
            return (f"{self.name()} was {_pick(rng, FEELINGS)} because the {_pick(rng, OBJECTS)} "
                    f"was {_pick(rng, ADJECTIVES)} .")
        if kind == 6:
            giver, taker = self.name(), self.name()
            taker = taker if taker != giver else "everyone"
            return f"{giver} gave {taker} {_pick(rng, NUMBER_WORDS[2:10])} {_plural(_pick(rng, OBJECTS))} ."
        if kind == 7:
            return f"{self.name()} {_pick(rng, VERBS)} the {self.thing()} in the {_pick(rng, PLACES)} ."
        return f"{self.name()} {_pick(rng, VERBS)} the {self.thing()} ."

    def text(self) -> str:
        rng = self.rng
        target = MIN_CHARS + _below(rng, MAX_CHARS - LONGEST_SENTENCE - MIN_CHARS)
        text = f"the story of {' and '.join(self.cast)} in the {self.home} ."
        while len(text) < target:
            paragraph = self.sentence()
            for _ in range(1 + _below(rng, 4)):
                if len(text) + 1 + len(paragraph) >= target:
                    break
                paragraph += " " + self.sentence()
            text += "\n" + paragraph
        return text


def synthetic_documents(count: int, seed: int = 0) -> list[str]:
    """`count` documents of 500 to 2000 characters, the same for the same (count, seed);
    the first k documents of a larger count are those of count k."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"synthetic_documents: count must be a non-negative int, got {count!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"synthetic_documents: seed must be an int, got {seed!r}")
    rng = random.Random(seed)
    return [_Story(rng).text() for _ in range(count)]
