"""Synthetic children's stories from a seeded grammar: the built-in model's training text.

Every story is told by llmlab itself from the plot grammar below and the word tables in
:mod:`llmlab.builtin.lexicon` (both written for llmlab; nothing is copied from a
dataset). A story draws a cast (a hero with a name and consistent pronouns, an adult, a
friend, a favourite thing, a place, ...) and one of nine plots, each a sequence of beats with
several wordings, so the same character is referred to coherently from the first sentence to
the last. Most stories start "Once upon a time".

The text is identical for the same ``(n, seed)`` on every machine (``random.Random`` with an
integer seed is stable across CPython versions), so the corpus, tokenizer and models can be
rebuilt exactly. :func:`vocabulary` lists every word the grammar can produce.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator

import attrs

from llmlab.builtin import lexicon as lx


@attrs.frozen
class OneOf:
    """One option, uniformly or by ``weights``; an option is text or a tuple of parts."""

    options: tuple
    weights: tuple[float, ...] | None = None


def one_of(*options: object) -> OneOf:
    return OneOf(options)


def maybe(probability: float, part: object) -> OneOf:
    return OneOf((part, ""), (probability, 1.0 - probability))


OPENING = OneOf(
    (
        one_of(
            "Once upon a time, there was {a_hero} named {name}.",
            "Once upon a time, there was {a_hero} called {name}.",
            "Once upon a time, there lived {a_hero} named {name}.",
            "Once upon a time, {a_hero} named {name} lived {home}.",
            "Once upon a time, there was {a_hero} named {name} who lived {home}.",
            "Once upon a time, in a land far away, there lived {a_hero} named {name}.",
        ),
        one_of(
            "There was once {a_hero} named {name}.",
            "{name} was {a_hero} who lived {home}.",
            "Long ago, there was {a_hero} named {name}.",
        ),
    ),
    (0.85, 0.15),
)
HABIT = (
    one_of(
        "{He} liked to {activity}.",
        "{He} loved to {activity}.",
        "Every day, {he} went {place} to {activity}.",
        "{His} favorite thing to do was to {activity}.",
        "{name} was always {good} when {he} could {activity}.",
    ),
    maybe(0.4, one_of(
        "{He} was very {trait} and everyone liked {him}.",
        "{He} lived with {his} {parent} and {his} little {sibling}.",
        "{He} had a lot of friends.",
    )),
    maybe(0.3, "{weather}"),
)

FOUND = (
    one_of(
        "{Day}, {name} was playing {place}.",
        "{Day}, {name} went {place} to {activity}.",
        "{Day}, {name} went out to play {place}.",
    ),
    one_of(
        "Suddenly, {he} saw {a_thing} {hiding}.",
        "{He} found {a_thing} {hiding}.",
        "Something was shining {hiding}. It was {a_thing}!",
    ),
    one_of(
        '"Wow!" said {name}. "Look at this {thing_trait} {thing}!"',
        "{name} was very {surprised}.",
        "{name} picked up the {thing} and looked at it {adverb}.",
    ),
    one_of(
        (
            "{He} ran home to show {his} {parent}.",
            '"Look what I found!" {he} said. "Can I keep it?"',
            one_of(
                '{His} {parent} smiled and said, "Yes, you can keep it. '
                'But you must take good care of it."',
                '"Of course," said {his} {parent}. "It is a very {thing_trait} {thing}."',
            ),
            one_of(
                "{name} played with the {thing} every day.",
                "From then on, {name} took the {thing} everywhere {he} went.",
                "{name} put the {thing} next to {his} bed, so {he} could see it every night.",
            ),
        ),
        (
            one_of(
                "Then {he} saw {a_friend} named {friend} sitting all alone.",
                "Just then, {a_friend} named {friend} came by. {fHe} looked very {bad}.",
            ),
            '"Did you lose something?" asked {name}.',
            '"Yes," said {friend}. "I lost my {thing}."',
            "{name} smiled and gave the {thing} to {friend}.",
            one_of(
                '"Thank you so much!" said {friend}.',
                "{friend} was so {good} that {fhe} gave {name} a big hug.",
            ),
            "From that day on, {name} and {friend} were best friends.",
        ),
    ),
)
HELP = (
    one_of(
        "{Day}, {name} was walking {place} when {he} heard a {sound} noise.",
        "{Day}, {name} was playing {place}. Then {he} heard a {sound} cry.",
    ),
    one_of(
        "It was {a_creature} {trouble}.",
        "{He} looked around and saw {a_creature} {trouble}.",
    ),
    maybe(0.5, one_of("The {creature} looked very {bad}.", "The poor {creature} was shaking.")),
    one_of(
        '"Do not worry, little {creature}," said {name}. "I will help you."',
        "{name} wanted to help.",
        '"Poor little {creature}," said {name}.',
    ),
    "{He} {adverb} {rescue}.",
    one_of("The {creature} was very {good}.", "The {creature} felt much better."),
    "It {thanks}.",
    one_of(
        "After that, the {creature} came to visit {name} every day.",
        "Then the {creature} went back home to its family.",
        "The {creature} and {name} became good friends.",
    ),
    maybe(0.5, "{name} learned that it feels good to help others."),
)
LOST = (
    one_of(
        "{name} had {a_thing} that {he} loved very much.",
        "{name} had a favorite toy. It was {a_thing}.",
        "{His} favorite thing in the world was {a_thing}.",
    ),
    maybe(0.5, "{He} took it everywhere {he} went."),
    one_of(
        "{Day}, {name} could not find {his} {thing}.",
        "{Day}, {his} {thing} was gone!",
    ),
    one_of(
        "{He} looked {spot}. {He} looked {spot2}. But the {thing} was not there.",
        "{He} looked {spot} and {spot2}, but {he} could not find it.",
    ),
    one_of(
        "{name} felt so {bad} that {he} started to cry.",
        "{name} sat down and felt very {bad}.",
    ),
    one_of(
        (
            "Then {his} friend {friend} came to play.",
            '"Why are you sad?" asked {friend}.',
            '"I lost my {thing}," said {name}.',
            '"Let us look together," said {friend}.',
            "They looked everywhere. At last, {friend} found the {thing} {found_spot}!",
        ),
        (
            "{His} {parent} came and gave {him} a big hug.",
            '"Let us look together," said {his} {parent}.',
            "They looked and looked. At last, {name} found the {thing} {found_spot}!",
        ),
    ),
    one_of(
        '"Thank you!" said {name}, and {he} held the {thing} tight.',
        "{name} was so {good}. {He} hugged the {thing} and smiled.",
    ),
    maybe(0.4, "From then on, {name} always kept {his} {thing} in a safe place."),
)
FEAR = (
    "{name} was afraid of {fear}.",
    maybe(0.4, one_of(
        "{He} did not like to talk about it.",
        "Even thinking about {fear} made {him} feel {bad}.",
    )),
    "{fear_scene}",
    one_of(
        "{name} was very scared.",
        "{name} felt {his} heart beat fast.",
        "{name} wanted to run away and hide.",
    ),
    one_of(
        '"I am scared," {he} said to {his} {parent}.',
        '"{Parent}, I am scared," {he} said.',
    ),
    one_of(
        '{His} {parent} held {his} hand and said, "It is okay to be scared. '
        'I am right here with you."',
        '{His} {parent} smiled and said, "Being brave means doing something even when you '
        'are scared."',
        '"You are braver than you think," said {his} {parent}.',
    ),
    "{name} took a deep breath.",
    "Then {he} {brave_act}.",
    one_of(
        "It was not so scary after all!",
        "Soon, {he} was not afraid anymore.",
        "{He} felt {his} fear go away.",
    ),
    one_of(
        "{name} felt brave and proud.",
        '"I did it!" said {name}. {His} {parent} gave {him} a big hug.',
    ),
)
MAKE = (
    one_of(
        "{Day}, {name} wanted to make {a_gift} for {his} {parent}.",
        "{Day}, {name} decided to make {a_gift} for {his} {parent}.",
    ),
    one_of("{He} got {materials}.", "{He} found {materials}."),
    "{He} worked very hard.",
    "But then {he} {mistake}.",
    one_of(
        "{name} was so {bad} that {he} wanted to give up.",
        "{name} felt like crying.",
    ),
    one_of(
        'Then {he} remembered what {his} {parent} always said: "If at first you do not '
        'succeed, try again."',
        "But {name} did not give up.",
        "{He} took a deep breath and started again.",
    ),
    "This time, {he} worked slowly and carefully.",
    "At last, the {gift} was ready. It was {beautiful}.",
    "When {his} {parent} saw the {gift}, {phe} smiled a big smile.",
    one_of(
        '"This is the best {gift} ever!" {phe} said.',
        '"Thank you, {name}. I love it!" {phe} said.',
    ),
    "{name} felt warm and happy inside.",
)
TRIP = (
    one_of(
        "{Day}, {name} and {his} {parent} went to {dest}.",
        "{Day}, {his} {parent} took {him} to {dest}.",
    ),
    one_of(
        "{name} was so excited that {he} could not stop smiling.",
        "{name} had never been to {dest} before.",
        "{He} was very {good}.",
    ),
    "There, they saw {sight}, {sight2} and {sight3}.",
    "{name} liked the {sight2} most of all.",
    "Then {he} {dest_act}.",
    maybe(0.5, one_of(
        "Suddenly, the wind blew {his} hat away! {His} {parent} ran and caught it.",
        "Suddenly, it started to rain, so they hid under a big umbrella.",
        "{name} got lost for a moment, but {his} {parent} found {him} quickly.",
    )),
    one_of("When the sun went down, they went home.", "In the evening, it was time to go home."),
    one_of(
        "{name} was tired but happy.",
        "That night, {name} dreamed about the {sight2}.",
        "{He} could not wait to go back to {dest} again.",
    ),
)
SHARE = (
    one_of("{name} had {a_thing}.", "{name} got {a_thing} for {his} birthday."),
    "{He} loved it very much.",
    "{Day}, {his} friend {friend} came to play.",
    "{friend} wanted to play with the {thing} too.",
    one_of('"No, it is mine!" said {name}.', '"No, you cannot have it," said {name}.'),
    "{friend} felt {bad} and went to sit {hiding}.",
    one_of("{name} played alone, but it was not fun.", "Soon, {name} felt lonely."),
    '{He} walked over to {friend} and said, "I am sorry. Do you want to play with my {thing}?"',
    "{friend} smiled.",
    one_of(
        "They played with the {thing} together all afternoon.",
        "They took turns with the {thing} and laughed a lot.",
    ),
    maybe(0.6, "{name} learned that sharing makes playing more fun."),
)
SKILL = (
    "{name} wanted to learn how to {skill}.",
    one_of(
        "{He} tried and tried, but {skill_fail}.",
        "It was hard. Every time {he} tried, {skill_fail}.",
    ),
    one_of("{name} felt {bad}.", '"I will never learn," said {name}.'),
    one_of(
        (
            '{His} friend {friend} said, "Do not give up! I will help you."',
            "Every day, {name} and {friend} practiced {place}.",
        ),
        (
            '{His} {parent} said, "Everyone needs practice. Let us try together."',
            "Every day, {name} and {his} {parent} practiced {place}.",
        ),
    ),
    one_of("At last, {name} could {skill}!", "After many days, {name} could finally {skill}!"),
    one_of('"I did it!" {he} shouted.', "{He} was so {good}."),
)
FRIEND = (
    "{Day}, {a_friend} named {friend} came to {the_place}.",
    "{friend} looked shy and stood all alone.",
    '{name} walked up to {fhim} and said, "Hello! My name is {name}. Do you want to play?"',
    '{friend} smiled and said, "Yes, please!"',
    one_of(
        "{name} showed {friend} how to {activity}.",
        "They played together all day long.",
    ),
    "{friend} was very {good}.",
    "From that day on, {name} and {friend} were best friends.",
)
PLOTS = (FOUND, HELP, LOST, FEAR, MAKE, TRIP, SHARE, SKILL, FRIEND)
ENDING = maybe(0.5, one_of(
    "It was the best day ever.",
    "{name} went to bed with a big smile on {his} face.",
    "And they all lived happily ever after.",
    "{He} would never forget that day.",
    "The end.",
))

PRONOUNS = {"he": ("he", "him", "his"), "she": ("she", "her", "her")}
CAST_WORDS = "girl boy a an"  # words the cast adds outside the tables


def _article(phrase: str) -> str:
    return ("an " if phrase[0] in "aeiou" else "a ") + phrase


def _character(rng: random.Random, avoid: str = "") -> tuple[str, str, str]:
    """(name, description such as "little girl", pronoun "he" or "she")."""
    pronoun = rng.choice(("he", "she"))
    if rng.random() < 0.6:
        names, kind = (lx.BOY_NAMES, "boy") if pronoun == "he" else (lx.GIRL_NAMES, "girl")
        trait = rng.choice(lx.HERO_TRAITS)
    else:
        names = rng.choice((lx.PET_NAMES, lx.BOY_NAMES if pronoun == "he" else lx.GIRL_NAMES))
        kind = rng.choice(lx.ANIMALS)
        trait = rng.choice(lx.HERO_TRAITS + lx.FUR_TRAITS)
    name = rng.choice([n for n in names if n != avoid])
    return name, f"{trait} {kind}", pronoun


def _cast(rng: random.Random) -> dict[str, str]:
    """Every slot a story can mention, drawn once so references stay consistent."""
    name, hero, pronoun = _character(rng)
    friend, friend_kind, friend_pronoun = _character(rng, avoid=name)
    he, him, his = PRONOUNS[pronoun]
    fhe, fhim, fhis = PRONOUNS[friend_pronoun]
    parent, parent_address, phe, _ = rng.choice(lx.ADULTS)
    thing = rng.choice(lx.THINGS)
    thing_trait = rng.choice(lx.THING_TRAITS)
    color = rng.choice(lx.COLORS)
    described = rng.choice((thing_trait, color, f"{thing_trait} {color}"))
    place, the_place = rng.choice(lx.PLACES)
    spot, spot2 = rng.sample(lx.SEARCH_SPOTS, 2)
    fear, fear_scene, brave_act = rng.choice(lx.FEARS)
    gift, materials, mistake = rng.choice(lx.GIFTS)
    dest, sights, dest_act = rng.choice(lx.TRIPS)
    sight, sight2, sight3 = rng.sample(sights, 3)
    skill, skill_fail = rng.choice(lx.SKILLS)
    trouble, rescue = rng.choice(lx.RESCUES)
    creature = rng.choice(lx.CREATURES)
    return {
        "name": name, "a_hero": _article(hero), "trait": hero.split()[0],
        "he": he, "He": he.capitalize(), "him": him, "his": his, "His": his.capitalize(),
        "friend": friend, "a_friend": _article(friend_kind),
        "fhe": fhe, "fHe": fhe.capitalize(), "fhim": fhim, "fhis": fhis,
        "parent": parent, "Parent": parent_address, "phe": phe,
        "thing": thing, "a_thing": _article(f"{described} {thing}"), "thing_trait": thing_trait,
        "place": place, "the_place": the_place, "home": rng.choice(lx.HOMES),
        "hiding": rng.choice(lx.HIDING_SPOTS), "spot": spot, "spot2": spot2,
        "found_spot": rng.choice(lx.FOUND_SPOTS), "sibling": rng.choice(lx.SIBLINGS),
        "activity": rng.choice(lx.ACTIVITIES),
        "food": rng.choice(lx.FOODS), "Day": rng.choice(lx.DAYS), "weather": rng.choice(lx.WEATHER),
        "good": rng.choice(lx.FEELINGS_GOOD), "bad": rng.choice(lx.FEELINGS_BAD),
        "surprised": rng.choice(lx.SURPRISED), "adverb": rng.choice(lx.ADVERBS),
        "sound": rng.choice(lx.SOUNDS), "beautiful": rng.choice(lx.FINISHED),
        "fear": fear, "fear_scene": fear_scene, "brave_act": brave_act,
        "gift": gift, "a_gift": _article(gift), "materials": materials, "mistake": mistake,
        "dest": dest, "sight": sight, "sight2": sight2, "sight3": sight3, "dest_act": dest_act,
        "skill": skill, "skill_fail": skill_fail,
        "creature": creature,
        "a_creature": _article(f"{rng.choice(lx.THING_TRAITS[:7])} {creature}"),
        "trouble": trouble, "rescue": rescue, "thanks": rng.choice(lx.CREATURE_THANKS),
    }


def _expand(part: object, rng: random.Random) -> Iterator[str]:
    if isinstance(part, str):
        if part:
            yield part
    elif isinstance(part, OneOf):
        if part.weights is None:
            yield from _expand(rng.choice(part.options), rng)
        else:
            yield from _expand(rng.choices(part.options, part.weights)[0], rng)
    else:
        for each in part:
            yield from _expand(each, rng)


def _fill(template: str, cast: dict[str, str]) -> str:
    text = template.format_map(cast)
    # Table entries carry slots of their own ("{his} backpack"): one more pass fills them.
    return text.format_map(cast) if "{" in text else text


def story(rng: random.Random) -> str:
    """One story, drawn from ``rng``."""
    cast = _cast(rng)
    plot = rng.choice(PLOTS)
    parts = (OPENING, HABIT, plot, ENDING)
    return " ".join(_fill(sentence, cast) for sentence in _expand(parts, rng))


def stories(n: int, seed: int = 0) -> list[str]:
    """``n`` stories from ``seed``; the same arguments always give the same text."""
    rng = random.Random(seed)
    return [story(rng) for _ in range(n)]


_WORD = re.compile(r"[A-Za-z]+")
_SLOT = re.compile(r"\{[A-Za-z_0-9]+\}")


def words(text: str) -> list[str]:
    """The lowercased words of ``text``, split the way :func:`vocabulary` counts them."""
    return [w.lower() for w in _WORD.findall(text)]


def vocabulary() -> frozenset[str]:
    """Every word a story can contain: the words of all tables and templates, minus slots."""
    found: set[str] = set()

    def walk(value: object) -> None:
        if isinstance(value, str):
            found.update(words(_SLOT.sub(" ", value)))
        elif isinstance(value, OneOf):
            walk(value.options)
        elif isinstance(value, dict):
            walk(tuple(value.values()))
        elif isinstance(value, (tuple, list)):
            for each in value:
                walk(each)

    for module_globals in (vars(lx), globals()):
        for key, value in module_globals.items():
            if key.isupper() and not key.startswith("_"):
                walk(value)
    return frozenset(found)
