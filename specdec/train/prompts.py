"""An offline, diverse set of chat prompts for training a draft head, with a held-out split.

No network: prompts are composed from topics x task kinds (explanations, lists, how-tos,
comparisons, stories, poems, advice, dialogue), concrete programming tasks in several
languages, arithmetic word problems with random numbers, and rewriting tasks. The held-out
split owns whole topics, programming tasks and problem seeds, so no held-out prompt shares its
subject with a training prompt. `self_instruct_requests` asks the target itself for more
questions (specdec/train/distill.py answers them).

Everything is a function of the seed: the same seed gives the same prompts, in the same order.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass

TOPICS = """photosynthesis; black holes; the water cycle; volcanoes; plate tectonics; the immune system; DNA replication;
vaccines; climate change; renewable energy; nuclear fission; electric cars; the internet; how search engines work;
machine learning; neural networks; cryptography; blockchains; quantum computing; the Roman Empire; ancient Egypt;
the French Revolution; the Industrial Revolution; World War I; the Cold War; the printing press; the Renaissance;
the Silk Road; the Apollo moon landing; the human heart; sleep; nutrition; meditation; running a marathon; yoga;
chess; soccer; basketball; tennis; the Olympic Games; jazz music; classical music; learning the guitar; painting
with watercolors; photography; film making; writing a novel; poetry; the history of cinema; baking bread;
making pasta; coffee; tea; wine tasting; vegetarian cooking; gardening; composting; houseplants; keeping bees;
dogs; cats; birds; whales; honeybees; rainforests; deserts; coral reefs; the Arctic; the Moon; Mars; Jupiter; the
Sun; comets; telescopes; gravity; electricity; magnetism; light; sound; thermodynamics; chemistry of cooking;
acids and bases; the periodic table; plastics and recycling; water purification; bridges; skyscrapers; airplanes;
trains; bicycles; sailing; maps and navigation; GPS; smartphones; batteries; solar panels; 3D printing; robots;
personal finance; budgeting; saving for retirement; the stock market; inflation; interest rates; starting a small
business; marketing; negotiation; job interviews; writing a resume; public speaking; time management; learning a
new language; studying for exams; teaching children to read; parenting toddlers; friendship; moving to a new
city; travel in Japan; travel in Italy; camping; hiking safety; first aid; the common cold; allergies; dental care;
volunteering; democracy; elections; human rights; the United Nations; urban planning; public transport; libraries;
museums; architecture of cathedrals; origami; knitting; woodworking; home repair; saving energy at home; cybersecurity;
passwords; email etiquette; remote work; open source software; databases; operating systems; computer networks;
cloud computing; video games; board games; mythology; Greek philosophy; ethics; logic puzzles; probability;
statistics; prime numbers; geometry; calculus; the history of mathematics; economics of supply and demand;
globalization; agriculture; fishing; forests; rivers; earthquakes; hurricanes; weather forecasting; the ocean tides;
dinosaurs; evolution; the human brain; memory; emotions; habits; motivation; creativity; humor; kindness""".replace("\n", " ")

TASKS = [
    "Explain {t} to a complete beginner.",
    "What is {t}? Answer in a short paragraph.",
    "Give me a list of five interesting facts about {t}.",
    "Write a short poem about {t}.",
    "Write a very short story that involves {t}.",
    "What are the most common misconceptions about {t}?",
    "Summarize the key ideas of {t} in three bullet points.",
    "How would you explain {t} to a ten-year-old?",
    "What are the pros and cons of {t}?",
    "Give me step-by-step advice for getting started with {t}.",
    "Why does {t} matter in everyday life?",
    "Write a haiku about {t}.",
    "Create a quiz with three questions about {t}, with answers.",
    "What is the history of {t}, briefly?",
    "Describe {t} in one sentence, then in one paragraph.",
    "What questions should I ask an expert on {t}?",
    "Write a friendly email to a colleague recommending they learn about {t}.",
    "What are three books or resources for learning about {t}?",
    "Compare {t} and {u}.",
    "What do {t} and {u} have in common?",
    "I'm curious about {t}. Where should I start?",
    "Can you tell me something surprising about {t}?",
    "Write a dialogue between a teacher and a student about {t}.",
    "List the main vocabulary words someone should know about {t}, with definitions.",
    "Give an analogy that helps explain {t}.",
    "Hi! Let's chat about {t}. What do you find most interesting about it?",
]

CODE_TASKS = """reverse a string; check whether a number is prime; compute the factorial of n; compute the nth Fibonacci
number; find the largest element of a list; remove duplicates from a list; count the words in a sentence; check if a
string is a palindrome; sort a list with bubble sort; implement binary search; merge two sorted lists; flatten a
nested list; compute the greatest common divisor of two numbers; convert Celsius to Fahrenheit; read a text file and
count its lines; parse a CSV line into fields; validate an email address; compute the mean and median of numbers;
find the second largest number in a list; rotate a list by k positions; check whether two strings are anagrams;
generate all permutations of a string; compute the sum of digits of a number; convert a decimal number to binary;
implement a stack class; implement a queue using two stacks; count vowels in a string; find common elements of two
lists; capitalize the first letter of every word; compute the power set of a set; check balanced parentheses;
implement FizzBuzz; find the longest word in a sentence; compute the dot product of two vectors; transpose a matrix;
multiply two matrices; implement a simple linked list; find the missing number in 1..n; compute compound interest;
shuffle a list randomly; group words by their first letter; compute a running average; implement a word frequency
counter; convert a Roman numeral to an integer; check for a leap year; compute the area of a circle; find all
divisors of a number; implement insertion sort; implement quicksort; measure how long a function takes""".replace("\n", " ")

LANGUAGES = ["Python", "Python", "Python", "JavaScript", "C", "Java", "Rust", "Go", "SQL-free pseudocode", "C++"]

CODE_TEMPLATES = [
    "Write a {lang} function to {c}.",
    "How do I {c} in {lang}? Show a short example.",
    "Write {lang} code to {c}, and explain how it works.",
    "Write a {lang} program that can {c}. Include a usage example.",
]

SENTENCES = [
    "the meeting has been moved to thursday because the room was double booked",
    "our team finished the project two weeks early and under budget",
    "i think we should consider a different approach to the marketing plan",
    "the weather was terrible but we still enjoyed the hike",
    "please remember to submit your expense reports by friday",
    "the new library opens next month with a large children's section",
    "he forgot his keys again so he had to wait outside for an hour",
    "the restaurant was crowded, the food was cold, and the service was slow",
]

REWRITES = [
    "Fix the grammar and punctuation: \"{s}\"",
    "Rewrite this sentence to sound more formal: \"{s}\"",
    "Make this sentence more friendly and casual: \"{s}\"",
    "Translate this sentence into French: \"{s}\"",
    "Summarize in five words: \"{s}\"",
]

MATH_TEMPLATES = [
    "A shop sells pencils for {a} cents each. How much do {b} pencils cost? Explain your reasoning.",
    "If a train travels {a} kilometers in {b} hours, what is its average speed?",
    "What is {a} multiplied by {b}? Show the steps.",
    "I have {a} apples and give away {b}. Then I buy twice as many as I have left. How many apples do I have?",
    "A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
    "What is {a} percent of {b}?",
    "Solve for x: {a}x + {b} = {c}.",
]


@dataclass(frozen=True)
class PromptSet:
    train: list[str]
    heldout: list[str]


def _items(text: str) -> list[str]:
    return [s.strip() for s in text.split(";") if s.strip()]


def _is_heldout(key: str, fraction: float) -> bool:
    # A stable hash, so the split never changes with the seed or the Python version.
    return zlib.crc32(key.encode()) % 1000 < fraction * 1000


def build_prompts(seed: int = 0, heldout_fraction: float = 0.15) -> PromptSet:
    """Every topic with every task kind, every programming task in a few languages, word problems and
    rewrites; shuffled by the seed. Held-out topics, programming tasks and sentences never reach train."""
    rng = random.Random(seed)
    topics, code = _items(TOPICS), _items(CODE_TASKS)
    train: list[str] = []
    heldout: list[str] = []
    for t in topics:
        dest = heldout if _is_heldout(t, heldout_fraction) else train
        peers = [u for u in topics if _is_heldout(u, heldout_fraction) == (dest is heldout) and u != t]
        for task in TASKS:
            dest.append(task.format(t=t, u=rng.choice(peers)))
    for c in code:
        dest = heldout if _is_heldout(c, heldout_fraction) else train
        for lang in rng.sample(LANGUAGES, 4):
            dest.append(rng.choice(CODE_TEMPLATES).format(lang=lang, c=c))
    for s in SENTENCES:
        dest = heldout if _is_heldout(s, heldout_fraction) else train
        dest.extend(r.format(s=s) for r in REWRITES)
    for i in range(40 * len(MATH_TEMPLATES)):
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        prompt = MATH_TEMPLATES[i % len(MATH_TEMPLATES)].format(a=a, b=b, c=a * rng.randint(1, 9) + b)
        (heldout if _is_heldout(prompt, heldout_fraction) else train).append(prompt)
    train, heldout = list(dict.fromkeys(train)), list(dict.fromkeys(heldout))
    rng.shuffle(train)
    rng.shuffle(heldout)
    return PromptSet(train, heldout)


# Only question templates: asked for a "request", SmolLM2 answers "I'm ready to assist..." instead.
SELF_INSTRUCT = [
    "Write one question that a curious person might ask an AI assistant about {t}. Reply with the question only.",
    "Write one question that a student might ask a teacher about {t}. Reply with the question only.",
    "Write one practical question that a beginner might ask about {t}. Reply with the question only.",
    "Write one question asking an expert for advice about {t}. Reply with the question only.",
]


def self_instruct_requests(seed: int, n: int, heldout_fraction: float = 0.15) -> list[str]:
    """n prompts that ask the target to write a user question about a TRAINING topic."""
    rng = random.Random(seed + 1)
    topics = [t for t in _items(TOPICS) if not _is_heldout(t, heldout_fraction)]
    return [rng.choice(SELF_INSTRUCT).format(t=rng.choice(topics)) for _ in range(n)]
