"""A small built-in English corpus for training the tiny models' tokenizer offline.

The text is original and deliberately varied (weather, cooking, travel, machines, numbers,
dialogue) so byte-pair merges reach whole common words well before a 2,048-entry vocab is
full. :func:`corpus_lines` adds templated sentences from a fixed seed for extra word
variety; the output is identical on every run, so tokenizers are reproducible.
"""

from __future__ import annotations

import random

PARAGRAPHS = """
The morning was cold and clear, and the river below the bridge moved slowly past the old mill.
A small boat waited near the bank while two children counted the ducks that swam in circles.
Their grandmother called from the kitchen window that breakfast was ready: warm bread, honey,
fresh apples and a pot of strong black tea. Nobody wanted to leave the water, but hunger won.
After breakfast the family walked to the market in the centre of the town. Farmers sold
potatoes, carrots, onions, cabbages and pumpkins from wooden carts; a baker shouted prices
for cakes and pies; a man with a long grey beard repaired watches at a folding table.
The youngest child asked why the clock tower always showed the wrong time, and the watchmaker
laughed and said that the tower had been ten minutes late for nearly forty years.
In the afternoon it started to rain. Heavy clouds rolled over the hills, thunder echoed in
the valley, and the streets turned into shining mirrors. People hurried under umbrellas,
shop owners pulled their awnings down, and a dog sheltered beneath a parked bicycle.
Computers follow instructions exactly, which is both their strength and their weakness.
A program that adds two numbers will add them a billion times without complaint, yet a single
missing character can stop it from running at all. Engineers write tests to catch such
mistakes early, and they measure memory, latency and throughput before every release.
Language models predict the next token from the tokens that came before it. During training
they read large amounts of text; during inference they generate one token at a time, reusing
cached keys and values so that each new step does not repeat the work of the previous ones.
A scheduler decides which requests run together in a batch, and a block manager hands out
pages of memory for the cache, much like an operating system manages virtual memory.
To make soup, chop an onion and two cloves of garlic, soften them in olive oil, then add
diced tomatoes, a handful of lentils, vegetable stock, salt and pepper. Simmer for thirty
minutes, stir occasionally, and serve with a squeeze of lemon and some crusty bread.
The train left the station at seven fifteen and crossed the plains towards the mountains.
Passengers read newspapers, played cards, slept against the windows or watched the fields of
wheat and sunflowers slide past. In the dining car a waiter balanced six cups of coffee on a
silver tray and did not spill a single drop, even when the carriage swayed around a curve.
One, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve, twenty, thirty,
forty, fifty, sixty, seventy, eighty, ninety, hundred, thousand, million, first, second,
third, fourth, fifth, half, quarter, double, triple, zero, number, count, total, sum.
Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and Sunday; January, February, March,
April, May, June, July, August, September, October, November and December; spring, summer,
autumn and winter; north, south, east and west; red, orange, yellow, green, blue and purple.
"Where are you going?" she asked. "To the library," he answered, "to return these books
before they close." "Could you bring me something about stars and planets?" "Of course.
Would you prefer a story or a textbook?" "A story, please, with maps and pictures."
The museum opened a new exhibition about ancient ships. Visitors saw anchors, ropes, sails,
compasses and a wooden figure of a sailor holding a lantern. A guide explained how crews
navigated by the sun during the day and by the stars at night, long before satellites.
Scientists observe, measure, compare and explain. They form a hypothesis, design an
experiment, collect data, analyse the results and share their conclusions with others, who
try to reproduce the findings and sometimes discover that the original idea was wrong.
The garden needed water after the long dry week. She filled the watering can, checked the
roses, tied the beans to their poles, picked ripe strawberries and pulled weeds from between
the rows of lettuce, while a robin watched from the fence, hoping for a worm.
Winter arrived early in the northern province. Snow covered the roofs, icicles hung from the
gutters, and the lake froze so thickly that villagers skated across it to visit relatives on
the opposite shore. Fishermen drilled holes through the ice, lowered their lines patiently,
and traded stories about enormous pike that nobody had ever actually managed to catch.
The hospital corridor smelled of soap and coffee. Nurses checked temperatures, adjusted
pillows, recorded medicines in thick folders and reassured worried parents. A surgeon
finished a difficult operation shortly after midnight, thanked her colleagues, and drove
home through empty streets illuminated by flickering yellow lamps.
Mathematics describes patterns: triangles, circles, squares, spirals, fractions, equations,
probability, symmetry, infinity, vectors, matrices, derivatives and integrals. Students often
fear it at first, then slowly discover that careful reasoning turns confusion into clarity.
The orchestra rehearsed a symphony by a forgotten composer. Violins, cellos, flutes, oboes,
clarinets, trumpets, trombones, drums and a harp filled the theatre with sound while the
conductor waved her baton energetically and occasionally stopped them to correct the rhythm.
Economists argue about inflation, interest rates, employment, taxes, trade, investment and
growth. Merchants worry about customers, suppliers, invoices, warehouses and transport costs.
Meanwhile ordinary households simply hope that groceries, rent and electricity stay affordable.
Volcanoes, earthquakes, hurricanes, floods, droughts and wildfires reshape landscapes and
communities. Geologists study rocks, minerals, fossils, glaciers and canyons to understand
how continents drifted apart over hundreds of millions of years.
The detective examined the footprints, photographed the muddy gloves, interviewed the nervous
butler and quietly concluded that the missing necklace had never left the mansion at all.
Elephants, giraffes, zebras, lions, tigers, monkeys, wolves, foxes, rabbits, squirrels,
owls, eagles, parrots, penguins, dolphins, whales, turtles, frogs, spiders and butterflies
appear in children's encyclopaedias alongside forests, deserts, jungles, oceans and islands.
Please remember to switch off the lights, lock the door, feed the cat, water the plants,
empty the dishwasher, recycle the newspapers, and telephone your uncle about Saturday's picnic.
Architects sketch buildings, bridges, towers, stadiums, libraries and apartments; carpenters
measure timber, plumbers install pipes, electricians connect cables and painters finish walls.
Athletes practise sprinting, jumping, swimming, cycling, rowing, climbing and wrestling;
coaches design exercises, analyse performances and encourage teammates during competitions.
Philosophers ask whether knowledge, freedom, justice, beauty and happiness can be defined,
and whether anyone can be certain of anything beyond their own thoughts and perceptions.
""".strip()

_SUBJECTS = (
    "the teacher",
    "a farmer",
    "my neighbour",
    "the engineer",
    "our captain",
    "the doctor",
    "a student",
    "the musician",
    "his brother",
    "her sister",
    "the driver",
    "a painter",
    "the cook",
    "the pilot",
    "an old friend",
    "the gardener",
    "the writer",
    "a child",
)
_VERBS = (
    "found",
    "carried",
    "opened",
    "painted",
    "repaired",
    "described",
    "borrowed",
    "noticed",
    "cleaned",
    "planted",
    "measured",
    "followed",
    "remembered",
    "ordered",
    "visited",
    "wrapped",
    "collected",
    "explained",
    "built",
    "washed",
    "answered",
    "watched",
)
_OBJECTS = (
    "a heavy wooden box",
    "the broken window",
    "seven green bottles",
    "an empty notebook",
    "the silver key",
    "a basket of plums",
    "the narrow staircase",
    "two yellow kites",
    "a letter from abroad",
    "the quiet harbour",
    "a bright lamp",
    "the frozen pond",
    "an unusual machine",
    "the stone wall",
    "a bowl of rice",
    "the northern road",
)
_ENDINGS = (
    "before sunrise",
    "after dinner",
    "near the station",
    "during the storm",
    "without a word",
    "on a Thursday",
    "in the village",
    "behind the school",
    "with great care",
    "for the second time",
    "at the weekend",
    "under the bridge",
)


def corpus_lines(num_generated: int = 600) -> list[str]:
    """The paragraphs' lines plus ``num_generated`` seeded template sentences."""
    rng = random.Random(1234)
    generated = [
        f"{rng.choice(_SUBJECTS).capitalize()} {rng.choice(_VERBS)} "
        f"{rng.choice(_OBJECTS)} {rng.choice(_ENDINGS)}."
        for _ in range(num_generated)
    ]
    return PARAGRAPHS.splitlines() + generated
