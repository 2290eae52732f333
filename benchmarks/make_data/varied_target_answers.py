"""Target answers to varied assistant prompts, as chat shards for `edgespec distill --data` (§34).

    python benchmarks/make_data/varied_target_answers.py OUT_DIR --minutes 22 [--seed 1] [--prompts 3000]

distill's own prompts (edgespec/distill/prompts.py) come from 20 topic templates and quoted standard
library text; §23 found that more answers to those same templates barely moved agreement on other
prompts. These ten families (tips, lists, rewrites, short questions, concepts, JSON, summaries,
creative forms, small code tasks, arithmetic) vary the kind of request instead. Their subjects leave
out the built-in benchmark prompts' subjects, but several templates share those prompts' wording
("Rewrite this sentence in a formal tone: ...", "... Answer in one sentence."): §34 says what that
means for the agreement measured on them. Shards are numbered from 0 in OUT_DIR/chat; link them after
an earlier run's shards to train on both.
"""
import argparse
import random
import time
from pathlib import Path

ACTIVITIES = ["saving money", "learning a new language", "sleeping better", "training for a 10k run", "cooking for a family",
    "keeping houseplants alive", "writing a resume", "public speaking", "working from home", "traveling on a budget",
    "staying hydrated", "making friends in a new city", "organizing a closet", "preparing for a job interview",
    "starting a vegetable garden", "reducing stress at work", "taking better photos with a phone", "learning to draw",
    "writing clean code", "debugging a program", "reading more books", "waking up early", "eating less sugar",
    "learning to swim", "moving to a new apartment", "planning a wedding", "caring for a new puppy", "negotiating a salary",
    "writing a cover letter", "learning guitar", "keeping a journal", "reducing screen time", "packing for a long trip",
    "hosting a dinner party", "managing a small team", "giving feedback", "learning statistics", "staying safe online",
    "choosing a laptop", "baking sourdough", "riding a bike in the city", "camping in the rain"]
THINGS = ["famous painters", "types of clouds", "programming languages", "musical instruments", "rivers in Europe",
    "breakfast foods", "board games", "dog breeds", "renewable energy sources", "parts of a plant cell", "noble gases",
    "data structures", "Olympic sports", "spices used in Indian cooking", "kinds of triangles", "ocean animals",
    "vegetables that grow in winter", "Greek gods", "primary colors", "sorting algorithms", "HTTP status codes",
    "Linux commands", "SQL keywords", "fruits high in vitamin C", "famous scientists", "mountain ranges",
    "types of rock", "car brands", "yoga poses", "chess openings", "desert animals", "Shakespeare plays",
    "herbs for a kitchen garden", "git commands", "cloud providers", "units of length", "types of bread",
    "birds that cannot fly", "symptoms of dehydration", "ways to reuse glass jars"]
SENTENCES = ["the package didn't come yesterday and nobody told me why", "i think we should maybe move the launch to next month",
    "can you fix the bug before friday pls", "the new coffee machine is broken again", "our team won the match last night",
    "i'm not sure the budget covers the new laptops", "the train was late so i missed the first talk",
    "thanks for helping me with the move", "this report has too many typos", "we need more volunteers for saturday",
    "the app crashes every time i open the settings", "my flight got cancelled and i need a new one",
    "the kids loved the museum trip", "please stop leaving dishes in the sink", "the customer wants a refund",
    "i forgot my password again", "the soup was cold when it arrived", "let's grab lunch sometime next week",
    "the server went down at 3am", "we sold twice as many tickets as last year"]
STYLES = ["in a formal tone", "more politely", "in a friendly tone", "as a question", "more concisely",
    "for a ten-year-old", "in the passive voice", "with correct grammar and punctuation", "as a professional email opening",
    "in a cheerful tone"]
QUESTIONS = ["Why is the sky blue?", "How do airplanes stay in the air?", "What causes the seasons?",
    "Who wrote Romeo and Juliet?", "What is the boiling point of water at sea level?", "How many continents are there?",
    "What does a CPU do?", "Why do leaves change color in autumn?", "How does a refrigerator keep food cold?",
    "What is the difference between weather and climate?", "How far is the Moon from the Earth?",
    "What is the largest ocean?", "Why do we have leap years?", "What is an atom made of?", "How do vaccines work?",
    "What is the tallest mountain in the world?", "Why does ice float?", "What language has the most native speakers?",
    "How long does light from the Sun take to reach Earth?", "What is inflation?", "Who invented the telephone?",
    "What is the main ingredient in guacamole?", "How many bones are in the adult human body?",
    "What is the difference between a virus and a bacterium?", "What does RAM stand for?", "Why do cats purr?",
    "What is the speed of sound?", "How do bees make honey?", "What year did the Second World War end?",
    "What is the chemical symbol for gold?"]
CONSTRAINTS = ["Answer in one sentence.", "Answer in two sentences.", "Keep it short.", "Explain briefly.",
    "Answer for a child.", "", "Give the answer first, then one sentence of explanation."]
CONCEPTS = ["a linked list", "an API", "a compiler", "interest rates", "a neural network", "DNS", "a mortgage",
    "a database index", "recursion", "object-oriented programming", "the greenhouse effect", "a blockchain",
    "a budget", "a credit score", "a firewall", "machine translation", "a function in mathematics",
    "supply chains", "a REST API", "cache memory", "photosynthesis", "an operating system", "encryption",
    "a binary tree", "big O notation", "a virtual machine", "unit tests", "a regular expression"]
JSON_THINGS = [("movie", "title, director and year"), ("person", "name, age and city"), ("car", "make, model and year"),
    ("recipe", "name, ingredients and minutes"), ("city", "name, country and population"),
    ("product", "name, price and in_stock"), ("song", "title, artist and duration"),
    ("restaurant", "name, cuisine and rating"), ("laptop", "brand, memory and price"),
    ("course", "title, teacher and credits"), ("employee", "name, role and salary"),
    ("event", "name, date and location"), ("pet", "name, species and age"), ("flight", "number, origin and destination")]
NOTES = ["The delivery of the new chairs is delayed by two weeks because the supplier ran out of stock, so the office will keep the old ones until then.",
    "Sam finished the first draft of the website, but the images are still missing and the contact form does not send emails yet.",
    "The library will close at 5 pm on Fridays during the summer, and the reading room will be closed for repairs in August.",
    "Our electricity bill doubled this winter, mostly because the old heater runs all day; a new one would pay for itself in two years.",
    "The school trip to the zoo is on the 14th; children need a packed lunch, a water bottle and a signed permission slip.",
    "Sales in the north region rose by 12 percent, while the south stayed flat because two large customers postponed their orders.",
    "The bug only appears when the user has more than 100 items in the cart, because the page loads them all at once.",
    "Maria will take over the newsletter from next month, and Tom will help her with the layout for the first two issues.",
    "The hiking trail is closed after the storm; rangers expect to reopen it next week once fallen trees are cleared.",
    "The survey shows most customers like the app but find the checkout slow and want more payment options.",
    "Our neighbor's dog barks every night around midnight, and we have asked them twice to keep it inside.",
    "The new train timetable adds an early service at 5:40 but removes the last train after 11 pm."]
FORMS = ["limerick", "two-sentence story", "product description", "short poem", "motivational quote", "thank-you note",
    "slogan", "riddle", "short dialogue", "birthday message", "joke", "short speech"]
SUBJECTS = ["a lost umbrella", "a robot chef", "the first day of spring", "a cat who loves boxes", "a rainy Monday",
    "a new smartphone", "a lighthouse keeper", "coffee", "a retiring teacher", "an old bicycle", "the ocean at night",
    "a hardworking ant", "a small bakery", "winning a chess game", "a broken clock", "friendship", "a mountain village"]
CODE = ["Write a Python function that {job}.", "Write a JavaScript function that {job}.", "Write a Bash one-liner that {shell}.",
    "Write a Python script that {job}, with comments.", "How do I {pyhow} in Python?", "Fix this Python code: {bug}",
    "What is the difference between {a} and {b} in Python?"]
JOBS = ["counts vowels in a string", "returns the second largest number in a list", "capitalizes every word in a sentence",
    "checks whether two strings are anagrams", "converts a list of tuples into a dictionary", "rounds a price to two decimals",
    "computes the area of a circle", "returns the number of days between two dates", "generates a random password",
    "splits a list into chunks of size n", "transposes a matrix", "removes punctuation from a text",
    "finds all even numbers in a list", "converts minutes into hours and minutes", "checks whether a year is a leap year",
    "reads a JSON file and prints its keys", "sums the digits of a number", "merges two dictionaries"]
SHELL = ["counts the lines in all .txt files", "finds files larger than 100 MB", "renames every .jpeg file to .jpg",
    "shows the ten largest folders", "prints the current date in ISO format"]
PYHOW = ["read a file line by line", "sort a dictionary by value", "make an HTTP request", "handle an exception",
    "copy a list", "format a string", "measure how long code takes", "write to a CSV file", "parse command-line arguments"]
BUGS = ["def add(a, b): return a - b", "for i in range(10) print(i)", "x = [1, 2, 3]\nprint(x[3])",
    "def greet(name):\nprint('Hello', name)", "total = 0\nfor n in [1, 2, 3]:\n    total = n\nprint(total)"]
PAIRS = [("a list", "a tuple"), ("== ", "is"), ("append", "extend"), ("a function", "a method"), ("a set", "a list"),
    ("break", "continue"), ("deepcopy", "copy")]
MATH = ["What is {p}% of {n}?", "Convert {n} miles to kilometers.", "What is {a} times {b}?", "If a shirt costs {n} dollars and is {p}% off, what is the new price?",
    "Convert {n} degrees Fahrenheit to Celsius.", "What is the square root of {sq}?", "A train travels {n} km in {h} hours. What is its average speed?"]


def _tips(rng, n):
    return rng.choice(["Give me {n} tips for {a}.", "How can I get better at {a}?", "What are common mistakes when {a}?",
                       "Make a simple plan for {a}.", "What should a beginner know about {a}?"]).format(
        n=n(), a=rng.choice(ACTIVITIES))


def _lists(rng, n):
    return rng.choice(["List {n} {t}.", "Name {n} {t} and describe each in one sentence.", "List some {t}.",
                       "Give me a numbered list of {n} {t}."]).format(n=n(), t=rng.choice(THINGS))


def _rewrite(rng, n):
    return f"Rewrite this sentence {rng.choice(STYLES)}: {rng.choice(SENTENCES)}"


def _question(rng, n):
    return f"{rng.choice(QUESTIONS)} {rng.choice(CONSTRAINTS)}".strip()


def _concept(rng, n):
    return rng.choice(["Explain what {c} is to a beginner.", "What is {c}? Give an example.",
                       "Explain {c} in simple terms.", "Describe {c} in three sentences."]).format(c=rng.choice(CONCEPTS))


def _json(rng, n):
    kind, fields = rng.choice(JSON_THINGS)
    return rng.choice(["Write a JSON object describing a {k} with {f}.", "Give me a JSON example of a {k} with the fields {f}.",
                       "Create a JSON array of two {k}s, each with {f}."]).format(k=kind, f=fields)


def _summary(rng, n):
    return rng.choice(["Summarize this: {x}", "Summarize this in one sentence: {x}", "What is the main point here? {x}",
                       "Turn this into a short bulleted list: {x}"]).format(x=rng.choice(NOTES))


def _creative(rng, n):
    return f"Write a {rng.choice(FORMS)} about {rng.choice(SUBJECTS)}."


def _code(rng, n):
    template, job, shell, pyhow, bug = (rng.choice(CODE), rng.choice(JOBS), rng.choice(SHELL), rng.choice(PYHOW),
                                        rng.choice(BUGS))
    a, b = rng.choice(PAIRS)
    return template.format(job=job, shell=shell, pyhow=pyhow, bug=bug, a=a, b=b)


def _math(rng, n):
    template = rng.choice(MATH)
    return template.format(p=rng.choice([10, 15, 20, 25, 30]), n=rng.randint(3, 200), a=rng.randint(3, 40),
                           b=rng.randint(3, 40), sq=rng.choice([16, 49, 81, 144, 225]), h=rng.randint(2, 5))


FAMILIES = ((_tips, 3), (_lists, 3), (_rewrite, 2), (_question, 3), (_concept, 2), (_json, 2), (_summary, 2),
            (_creative, 2), (_code, 3), (_math, 1))


def varied_prompts(count: int, seed: int) -> list[str]:
    """`count` distinct prompts, families drawn by weight."""
    rng = random.Random(seed)

    def n():
        return rng.choice(["three", "four", "five", "3", "5", "two"])

    makers, weights = zip(*FAMILIES)
    out, seen = [], set()
    for _ in range(count * 30):
        if len(out) == count:
            break
        prompt = rng.choices(makers, weights)[0](rng, n)
        if prompt not in seen:
            seen.add(prompt)
            out.append(prompt)
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--target", default="default")
    parser.add_argument("--minutes", type=float, required=True)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=3000)
    args = parser.parse_args()

    import torch
    from edgespec.distill import data
    from edgespec.exporters.sources import resolve_source

    from edgespec.defaults import cache_dir

    torch.set_num_threads(2)
    torch.manual_seed(args.seed)
    model, tokenizer = resolve_source(args.target, cache_dir()).load()
    texts = varied_prompts(args.prompts, args.seed)
    written = data.generate_shards(model, tokenizer, texts, args.out_dir / "chat", data.DataConfig(),
                                   time.time() + args.minutes * 60)
    print(f"{written} chat shards written to {args.out_dir / 'chat'}")
