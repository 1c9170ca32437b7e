"""Write examples/reviews.jsonl: 240 product reviews to label and summarise, in the OpenAI Batch
API format, all sharing one instruction with three worked examples (so the prefix cache computes
it once), and examples/reviews.labels.jsonl: the true label of each, by custom_id (the fragments
a review is made of decide it), for `tokenmill choose --expected` (see the Makefile's demo).

Reviews are put together from hand-written fragments, deterministically: re-running this script
gives the same files, byte for byte.

    python examples/make_reviews.py            # writes examples/reviews.jsonl and reviews.labels.jsonl
"""

from __future__ import annotations

import json
from pathlib import Path

# One instruction shared by every request: a system message and three worked examples. It is the
# same prefix on every line, so the engine's prefix cache computes it once for the whole job.
INSTRUCTION = (
    "You label product reviews as positive, negative or mixed and summarise each in a few words, "
    "in the form: label | summary"
)
EXAMPLES = [
    ("The blender is powerful and easy to clean. Love it.", "positive | powerful blender, easy to clean"),
    ("The strap broke on day two and support ignored me.", "negative | strap broke quickly, support never answered"),
    ("Great screen, but the battery dies by lunchtime.", "mixed | great screen, battery dies too fast"),
]

# product, what it was bought for, two things people like, two things people dislike
PRODUCTS = [
    ("pair of wireless earbuds", "my commute", "The sound is clear and the bass is punchy without being muddy.",
     "Pairing with my phone took two seconds.", "The left bud keeps dropping out after about an hour.",
     "The charging case scratches if you look at it wrong."),
    ("standing desk", "working from home", "It goes from sitting to standing height in about ten seconds.",
     "Assembly took under an hour with the included tools.", "It wobbles noticeably at full standing height.",
     "The motor makes a grinding noise on the way down."),
    ("espresso machine", "morning coffee", "The crema is thick and the shots taste as good as my local cafe.",
     "It heats up in under a minute.", "The steam wand sputters and barely froths milk.",
     "Water leaks from under the drip tray every few days."),
    ("hiking backpack", "a week in the mountains", "The hip belt carries the weight so my shoulders never hurt.",
     "There are pockets exactly where you want them.", "The rain cover tore on the second day.",
     "One of the zips jammed and would not close."),
    ("robot vacuum", "a flat with two cats", "It picks up cat hair from the rug better than my old upright.",
     "The app lets me schedule cleaning while I am at work.", "It gets stuck under the sofa almost every run.",
     "The bin is tiny and fills up before it finishes one room."),
    ("electric kettle", "tea at the office", "It boils a full litre in about three minutes.",
     "The temperature presets are great for green tea.", "The lid spring broke after a month.",
     "It has a plastic smell that has not gone away."),
    ("mechanical keyboard", "programming", "The switches feel crisp and every key registers.",
     "The keycaps have not gone shiny after months of use.", "The backlight software only runs on Windows.",
     "The space bar rattles loudly."),
    ("air fryer", "quick weeknight dinners", "Chips come out crispy with a spoon of oil.",
     "The basket goes straight in the dishwasher.", "The nonstick coating started peeling within weeks.",
     "It is much louder than I expected."),
    ("pair of running shoes", "marathon training", "They are light and the cushioning stays bouncy after 300 km.",
     "No blisters even on long runs.", "The sole wore through at the heel surprisingly fast.",
     "They run half a size small."),
    ("phone case", "a clumsy teenager", "It survived several drops onto concrete without a mark on the phone.",
     "The buttons are still easy to press.", "The edges turned yellow after a few weeks.",
     "It is so bulky the phone no longer fits in a pocket."),
    ("4K monitor", "photo editing", "Colours are accurate straight out of the box.",
     "The stand adjusts in height and tilts easily.", "There is visible backlight bleed in the corners.",
     "It arrived with a dead pixel near the centre."),
    ("camping tent", "family camping", "It went up in ten minutes on the first try.",
     "We stayed completely dry through a night of heavy rain.", "Two of the poles bent in moderate wind.",
     "The stuff sack is far too small to repack it."),
    ("yoga mat", "daily practice", "It has great grip even when my hands are sweaty.",
     "It is thick enough to protect my knees.", "It still smells of rubber after two weeks of airing.",
     "The surface started flaking at the edges."),
    ("smart thermostat", "cutting the heating bill", "Our gas bill dropped noticeably in the first month.",
     "The schedule learns when we are home.", "It loses its Wi-Fi connection every few days.",
     "Installation instructions were confusing and missed a wire."),
    ("blender", "smoothies", "It crushes ice and frozen fruit in seconds.",
     "Cleaning is easy with a drop of soap and a quick spin.", "The jug cracked at the base after a month.",
     "It is loud enough to wake the whole house."),
    ("office chair", "long workdays", "My back pain is gone after a week of using it.",
     "The armrests adjust in every direction.", "The seat cushion flattened within two months.",
     "One wheel squeaks and the gas lift sinks slowly."),
    ("e-reader", "reading on holiday", "The screen is easy on the eyes even in bright sun.",
     "The battery lasted the whole two-week trip.", "Page turns lag noticeably.",
     "It froze and needed a reset twice in the first week."),
    ("bike helmet", "commuting by bike", "It is light and I forget I am wearing it.",
     "The built-in rear light is a great touch.", "The strap buckle pinches my chin.",
     "The vents are too small and my head overheats in summer."),
    ("cast iron skillet", "searing steaks", "It came well seasoned and nothing sticks.",
     "It holds heat beautifully for a great crust.", "It arrived with rust spots on the handle.",
     "The surface is rougher than the one my parents have."),
    ("pair of noise-cancelling headphones", "open-plan office",
     "The noise cancelling blocks out the air conditioning completely.",
     "They are comfortable for a whole day of calls.", "The microphone makes me sound like I am in a tunnel.",
     "The headband cracked where it folds."),
    ("portable charger", "travelling", "It charges my phone three times over.",
     "It is small enough for a jacket pocket.", "It takes all night to recharge itself.",
     "It gets worryingly hot while charging a laptop."),
    ("desk lamp", "late-night studying", "The light is even and does not flicker.",
     "The arm stays exactly where I put it.", "The touch control turns on by itself sometimes.",
     "The base is too light and the lamp tips over."),
    ("insulated water bottle", "the gym", "Water stays ice cold for a whole day.",
     "It does not leak even upside down in my bag.", "The paint chipped the first time I dropped it.",
     "The lid is hard to clean and started to smell."),
    ("kids' tablet", "our six-year-old", "The parental controls are simple to set up.",
     "The rubber case has survived plenty of drops.", "The battery barely lasts a car journey.",
     "It is slow to open even the built-in apps."),
]

OPENERS = {
    "positive": ["Bought this {product} for {purpose} and I am really pleased.",
                 "Honestly the best {product} I have owned.",
                 "I was sceptical, but this {product} won me over.", "Got the {product} as a gift for {purpose}."],
    "negative": ["I wanted to like this {product}, bought for {purpose}.", "Really disappointed with this {product}.",
                 "Do not buy this {product}.", "Returned the {product} after three weeks."],
    "mixed": ["Mixed feelings about this {product}.", "I use the {product} for {purpose} every day.",
              "The {product} is fine, with caveats.", "Some good and some bad with this {product}."],
}
CLOSERS = {
    "positive": ["Would buy again.", "Five stars.", "Worth every penny.", "Already recommended it to friends.", ""],
    "negative": ["Asking for a refund.", "One star.", "Customer service never replied.", "Avoid.", ""],
    "mixed": ["Three stars.", "Okay for the price.", "Might buy a different brand next time.",
              "Good, but not great.", ""],
}


PROMPT_PREFIX = [{"role": "system", "content": INSTRUCTION}] + [
    {"role": role, "content": content}
    for review_text, answer in EXAMPLES
    for role, content in (("user", review_text), ("assistant", answer))
]


def review(index: int) -> tuple[str, str]:
    """The `index`-th review: (sentiment, text). Cycles products, sentiments and fragments."""
    product, purpose, pro1, pro2, con1, con2 = PRODUCTS[index % len(PRODUCTS)]
    sentiment = ("positive", "negative", "mixed")[(index // len(PRODUCTS)) % 3]
    variant = index // (3 * len(PRODUCTS))
    opener = OPENERS[sentiment][(index + variant) % 4].format(product=product, purpose=purpose)
    closer = CLOSERS[sentiment][(index * 7 + variant) % 5]
    if sentiment == "positive":
        body = [pro1, pro2] if variant % 2 == 0 else [pro2, pro1]
    elif sentiment == "negative":
        body = [con1, con2] if variant % 2 == 0 else [con2, con1]
    else:
        body = [pro1, "However, " + _lower_first(con1)]
        if variant % 2:
            body = [con2, "On the plus side, " + _lower_first(pro2)]
    return sentiment, " ".join(part for part in [opener, *body, closer] if part)


def _lower_first(sentence: str) -> str:
    return sentence[0].lower() + sentence[1:]


def custom_id(index: int) -> str:
    return f"review-{index + 1:03d}"


def batch_line(index: int) -> dict:
    _, text = review(index)
    return {
        "custom_id": custom_id(index),
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": "SmolLM2-135M-Instruct",
            "messages": [*PROMPT_PREFIX, {"role": "user", "content": text}],
        },
    }


def label_line(index: int) -> dict:
    sentiment, _ = review(index)
    return {"custom_id": custom_id(index), "label": sentiment}


def main(count: int = 240) -> None:
    requests = Path(__file__).with_name("reviews.jsonl")
    labels = Path(__file__).with_name("reviews.labels.jsonl")
    with requests.open("w") as f:
        for i in range(count):
            f.write(json.dumps(batch_line(i), ensure_ascii=False) + "\n")
    with labels.open("w") as f:
        for i in range(count):
            f.write(json.dumps(label_line(i)) + "\n")
    print(f"wrote {count} requests to {requests} and their labels to {labels}")


if __name__ == "__main__":
    main()
