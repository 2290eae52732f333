"""Short everyday chat requests: the kind of message a chat assistant mostly gets.

The composed prompts of prompts.py are explain/list/code tasks over a list of topics; the drafts trained
on them agreed with the target far less on short chat questions than on their own held-out answers
(history.md §52). These families widen that: facts, advice, tone rewrites, small JSON records, ordered
lists, short texts to summarize. The benchmark prompts are never made here: `chat_prompt` is filtered by
prompts.training_prompts against the evaluation sets that ship with the package.
"""
from __future__ import annotations

import random

PLACES = (
    "Japan", "Canada", "Brazil", "Kenya", "Norway", "Australia", "Mexico", "Egypt", "India", "Spain",
    "Peru", "Vietnam", "Morocco", "Iceland", "Argentina", "Sweden", "Portugal", "Chile", "Thailand", "Ghana",
)
ACTIVITIES = (
    "sleeping better", "saving money", "learning to cook", "starting to run", "writing clearly",
    "keeping a plant alive", "working from home", "preparing for an exam", "travelling light",
    "making new friends", "reading more books", "staying hydrated", "getting up early", "learning guitar",
    "organizing a small kitchen", "reducing screen time", "giving feedback", "planning a trip",
    "taking better notes", "staying calm before a presentation",
)
CONCEPTS = (
    "a linked list", "an API", "a compiler", "a neural network", "a spreadsheet formula", "inflation",
    "a mortgage", "a vaccine", "an algorithm", "a binary number", "a database index", "a firewall",
    "a search engine", "an election", "a metaphor", "an ecosystem", "a variable in programming",
    "a recipe's yield", "a credit score", "an operating system", "cloud storage", "a time zone",
)
QUESTIONS = (
    "What is the capital of {place}?", "What language is spoken in {place}?",
    "What currency is used in {place}?", "What is {place} famous for?",
    "Name three dishes from {place}.", "What is the weather like in {place} in winter?",
    "How many continents are there, and which one is {place} in?",
)
ADVICE = (
    "Give me three tips for {activity}.", "Give me five tips for {activity}.",
    "What is the best way to start {activity}?", "What mistakes do people make when {activity}?",
    "Make a one-week plan for {activity}.", "I keep failing at {activity}. Any advice?",
)
EXPLAIN = (
    "Explain what {concept} is to a beginner.", "What is {concept}? Keep it simple.",
    "Explain {concept} with an everyday example.", "How does {concept} work?",
    "Describe {concept} in two sentences.",
)
SENTENCES = (
    "hey, can u check the numbers again before friday?", "we need the room for 2 hours tmrw, is that ok",
    "sorry i missed the call, my train was late", "the app keeps crashing when i open settings",
    "thx for the help yesterday, it really saved me", "pls send me the invoice for march",
    "cant make it to the party, something came up", "the package arrived but the box was damaged",
    "our team finished the release early this week", "i think the price is too high for what it is",
)
TONES = ("formal", "friendly", "polite", "professional", "casual", "enthusiastic")
REWRITES = (
    "Rewrite this sentence in a {tone} tone: {sentence}", "Make this message more {tone}: {sentence}",
    "Fix the grammar in this sentence: {sentence}", "Turn this into a {tone} email: {sentence}",
)
RECORDS = (
    ("a movie", "title, director and year"), ("a city", "name, country and population"),
    ("a person", "name, age and job"), ("a product", "name, price and category"),
    ("a song", "title, artist and length"), ("a recipe", "name, servings and ingredients"),
    ("a car", "make, model and year"), ("an event", "name, date and place"),
    ("a restaurant", "name, cuisine and rating"), ("a course", "title, teacher and credits"),
)
ORDERED = (
    "List the days of the week.", "List the months of the year.", "List the colours of the rainbow in order.",
    "List the first ten prime numbers.", "List the continents from largest to smallest.",
    "List the steps to boil an egg.", "List the stages of the water cycle in order.",
    "List the layers of the Earth from the outside in.", "List the noble gases.",
    "List the oceans of the world from largest to smallest.", "List the steps to change a bicycle tyre.",
)
NOTES = (
    "The bus to the airport now leaves at 7:15 instead of 7:00, and tickets must be bought online.",
    "Lena finished the report, but the charts still need new colours before the client sees them on Thursday.",
    "The library will close early on Friday for maintenance, so returns go in the box by the door.",
    "Our flat's heating was fixed today; the engineer says the boiler needs a full check in spring.",
    "The football match was postponed because of the storm, and the new date is announced next week.",
    "Sam ordered the wrong cables, so the office setup moves to Monday and Priya will call the supplier.",
    "The bakery on Main Street starts selling sourdough on weekends and takes orders by phone.",
    "The team agreed to move the weekly meeting to Tuesday mornings and to keep it under thirty minutes.",
)
SUFFIXES = ("", " Answer in one sentence.", " Keep it short.", " Be brief.", " Use a numbered list.")


def chat_prompt(rng: random.Random) -> str:
    """One short chat request, from one of the families above."""
    family = rng.randrange(7)
    if family == 0:
        text = rng.choice(QUESTIONS).format(place=rng.choice(PLACES))
    elif family == 1:
        text = rng.choice(ADVICE).format(activity=rng.choice(ACTIVITIES))
    elif family == 2:
        text = rng.choice(EXPLAIN).format(concept=rng.choice(CONCEPTS))
    elif family == 3:
        text = rng.choice(REWRITES).format(tone=rng.choice(TONES), sentence=rng.choice(SENTENCES))
    elif family == 4:
        thing, fields = rng.choice(RECORDS)
        text = f"Write a JSON object describing {thing} with {fields}."
    elif family == 5:
        text = rng.choice(ORDERED)
    else:
        text = rng.choice(("Summarize this: ", "Summarize this in one sentence: ",
                           "What is the key point here? ", "Turn this into a to-do list: ")) + rng.choice(NOTES)
    return text + rng.choice(SUFFIXES)
