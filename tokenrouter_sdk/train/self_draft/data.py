"""Training data of the self-draft: templated prompts made in code.

Grade-school word problems with random names and numbers (each prefixed with `MATH_INSTRUCTION`)
and general instructions over a topic list. No text of the benchmark sets
(`tokenrouter_sdk.benchmarks`) is used, so nothing overlaps them.
"""

from __future__ import annotations

import random

NAMES = [
    "Ava",
    "Ben",
    "Carla",
    "Dev",
    "Elena",
    "Farid",
    "Grace",
    "Hiro",
    "Ines",
    "Jonas",
    "Kemi",
    "Liam",
    "Mara",
    "Nikhil",
    "Olga",
    "Pablo",
    "Quinn",
    "Rosa",
    "Sami",
    "Tara",
    "Umar",
    "Vera",
    "Wen",
    "Yusuf",
]
ITEMS = [
    ("apples", "basket"),
    ("pencils", "box"),
    ("stickers", "sheet"),
    ("cookies", "tray"),
    ("marbles", "bag"),
    ("books", "shelf"),
    ("eggs", "carton"),
    ("bottles", "crate"),
    ("cards", "pack"),
    ("flowers", "vase"),
    ("shirts", "drawer"),
    ("tiles", "row"),
]
JOBS = ["washing cars", "walking dogs", "babysitting", "tutoring", "mowing lawns", "selling lemonade"]
MATH_TEMPLATES = [
    "{a} has {x} {i}. {b} gives {a} {y} more {i}. How many {i} does {a} have now?",
    "{a} buys {x} {c}s of {i}. Each {c} holds {y} {i}. How many {i} does {a} buy in total?",
    "A {c} holds {y} {i}. {a} has {z} {i} to pack. How many full {c}s can {a} fill, and how many {i} are left?",
    "{a} earns ${x} per hour {j}. Last week {a} worked {y} hours and spent ${z} on lunch. How much money is left?",
    "{a} reads {x} pages a day. The book has {w} pages. How many days does it take to finish the book?",
    "{a} had ${w}. {a} spent {p}% of it on {i} and ${y} on a ticket. How much money does {a} have left?",
    "There are {x} students in a class. {p}% of them play soccer and {y} of the rest play chess. "
    "How many students play chess?",
    "{a} is {x} years old. {b} is {y} years older than twice {a}'s age. How old is {b}?",
    "A train travels {x} miles per hour for {y} hours, then {z} miles per hour for {u} hours. "
    "How far does it travel in total?",
    "{a} and {b} share {w} {i} in the ratio {u}:{v}. How many {i} does {b} get?",
    "A rectangle is {x} meters long and {y} meters wide. What is its area and its perimeter?",
    "{a} saves ${x} every week. How many weeks does {a} need to save ${w}?",
    "A shop sells {i} at ${u} each or {v} for ${x}. How much does {a} save buying {v} at once?",
    "{a} runs {u} kilometers on Monday, {v} on Tuesday and twice as much on Wednesday as on Monday. "
    "How many kilometers does {a} run in the three days?",
    "A recipe needs {u} cups of flour for {v} {i}. How many cups are needed for {x} {i}?",
    "{a} bought {x} {i} for ${y} each and sold them for ${z} each. What was the profit?",
]
TOPICS = [
    "photosynthesis",
    "the water cycle",
    "gravity",
    "volcanoes",
    "the moon",
    "electricity",
    "the human heart",
    "recycling",
    "the internet",
    "honey bees",
    "rainbows",
    "earthquakes",
    "the Roman Empire",
    "democracy",
    "compound interest",
    "fractions",
    "prime numbers",
    "healthy sleep",
    "learning a new language",
    "climate",
    "ocean tides",
    "the solar system",
    "vaccines",
    "bread baking",
    "chess",
    "the piano",
    "bicycles",
    "friendship",
    "saving money",
    "time management",
    "deserts",
    "rain forests",
    "penguins",
    "elephants",
    "coffee",
    "tea",
    "the printing press",
    "airplanes",
    "batteries",
    "magnets",
    "the seasons",
    "clouds",
    "sound waves",
    "light",
    "computers",
    "robots",
    "gardening",
    "mountains",
    "rivers",
    "maps",
]
GENERAL_TEMPLATES = [
    "Explain {t} in simple terms.",
    "Give three interesting facts about {t}.",
    "Write a short paragraph about {t}.",
    "Why is {t} important?",
    "What are the main ideas behind {t}?",
    "Describe {t} to a ten-year-old.",
    "Write a short story that involves {t}.",
    "What are common misconceptions about {t}?",
    "How would you teach someone about {t}?",
    "Summarize the history of {t} in a few sentences.",
]
# The instruction before each synthetic word problem (part of the recipe of the packaged draft;
# benchmark questions use their own template from `tokenrouter_sdk.benchmarks`).
MATH_INSTRUCTION = "Solve the problem. Give the final answer as a number at the end.\n\n"


def synthetic_prompts(n: int, seed: int = 0, math_fraction: float = 0.6) -> list[str]:
    """``n`` distinct prompts made from templates (``math_fraction`` word problems prefixed with
    `MATH_INSTRUCTION`, the rest general instructions). Deterministic in ``seed``."""
    rng, out, seen = random.Random(seed), [], set()
    while len(out) < n:
        if rng.random() < math_fraction:
            a, b = rng.sample(NAMES, 2)
            i, c = rng.choice(ITEMS)
            vals = dict(
                a=a,
                b=b,
                i=i,
                c=c,
                j=rng.choice(JOBS),
                x=rng.randint(2, 60),
                y=rng.randint(2, 30),
                z=rng.randint(2, 90),
                u=rng.randint(2, 9),
                v=rng.randint(2, 9),
                w=rng.choice([60, 84, 96, 120, 150, 180, 240, 300, 360, 420, 500]),
                p=rng.choice([10, 20, 25, 30, 40, 50, 60, 75]),
            )
            p = MATH_INSTRUCTION + rng.choice(MATH_TEMPLATES).format(**vals)
        else:
            p = rng.choice(GENERAL_TEMPLATES).format(t=rng.choice(TOPICS))
            if p in seen:
                continue
        seen.add(p)
        out.append(p)
    return out
