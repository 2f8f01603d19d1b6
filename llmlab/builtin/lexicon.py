"""The word tables behind :mod:`llmlab.builtin.stories`.

Written for llmlab (no dataset was copied). Entries may hold ``{slots}`` of the story's cast
(``{his}``, ``{name}``, ...), filled in when a story is told. Tables are written as
space-separated words, comma-separated phrases, or one entry per line.
"""

from __future__ import annotations


def _words(text: str) -> tuple[str, ...]:
    return tuple(text.split())


def _phrases(text: str) -> tuple[str, ...]:
    return tuple(" ".join(phrase.split()) for phrase in text.split(","))


def _lines(text: str) -> tuple[str, ...]:
    return tuple(line.strip() for line in text.strip().splitlines() if line.strip())


GIRL_NAMES = _words("""
    Lily Mia Emma Ava Sophie Lucy Anna Ella Grace Chloe Zoe Ruby Rosie Daisy Molly Amelia
    Olivia Isla Hannah Sarah Emily Maya Nora Leah Clara Alice Julia Eva Ivy Hazel Luna Stella
    Violet Willow Poppy Bella Nina Tina Lena Mila Kate Jane Amy Beth Jenny Holly Ellie Millie
    Katie Abby Sadie Josie Lola Layla Aria Iris Rose Fiona Greta Heidi Kira Lila Maria Rita
    Tara Vera Wendy Yara Zara Ada Bea Cora Dora Elsa Faye Gemma Hope Jade June Lara May Nell
    Opal Pearl Rhea Tess Wren Amara Esme Freya Gina Jasmine Kayla Lucia Megan Naomi Paula
    Rachel Tilly Nadia Lisa Mary Susie Penny Polly Dina Erin Fern Gwen Helen Irene Joy Linda
    Mira Nancy Ida Martha Sally Anya Priya Leila Suki Mei Rosa Carmen Frida Hattie Winnie
""")
BOY_NAMES = _words("""
    Tom Ben Max Sam Leo Jack Tim Noah Liam Oliver Jake Finn Luke Adam Alex Owen Ethan Lucas
    Henry Oscar Theo Ryan Dylan Evan Felix Hugo Joe Kai Leon Milo Nate Otto Paul Ray Rex Seth
    Toby Will Zack Arlo Bruno Carl Dan Eli Frank George Hank Ivan Jay Ken Levi Mark Ned Omar
    Pete Reid Sid Ted Wade Zane Aaron Billy Charlie Danny Eddie Freddie Harry Jamie Kevin
    Louis Marco Nico Ollie Percy Ricky Simon Teddy Victor Walter Ali Ari Bob Cole Dave Emil
    Gus Hal Jon Kurt Lars Matt Neil Pablo Rafi Roy Sean Troy Abel Benji Caleb David Elias Gabe
    Isaac Jonah Kofi Lenny Miles Nolan Peter Ralph Stan Tyler Yuri Arjun Hiro Mateo Diego Ravi
    Tariq Anton Basil Cyril Duncan Edgar Fritz Gilbert Homer Jasper Kenji Luca Magnus Rufus
""")
PET_NAMES = _words("""
    Spot Buddy Fluffy Whiskers Pip Bubbles Coco Patch Snowy Sunny Biscuit Muffin Pepper Ginger
    Socks Shadow Button Cookie Peanut Pumpkin Bean Nibbles Sparky Rusty Dusty Lucky Honey Toffee
    Pebble Fuzzy Bingo Daisy Mittens Waffles Noodle Pickles Tiny Goldie Bramble Cricket Clover
    Hopper Squeaky Marshmallow Sprout Puddle Twinkle Jelly Bouncer Scout Dots Oreo Pudding
""")

# Animals that can be the hero or a friend (they talk, play and have moms).
ANIMALS = _words("""
    dog puppy cat kitten bunny rabbit bear mouse fox duck frog pig owl squirrel turtle lion
    elephant monkey bird hedgehog horse pony cow goat sheep lamb penguin giraffe deer tiger
    chick hen panda koala zebra raccoon beaver otter badger mole donkey kangaroo hippo camel
    puffin seal dolphin goose parrot robin wolf moose llama chipmunk
""")
# Small creatures that get stuck, lost or hurt, and need help.
CREATURES = _words("""
    bird kitten puppy bunny duckling frog squirrel hedgehog turtle butterfly ladybug mouse owl
    lamb fawn chick snail bee beetle caterpillar sparrow robin mole lizard piglet calf foal
    gosling cub
""")
HERO_TRAITS = _words("""
    kind happy curious brave shy friendly clever gentle cheerful playful little small young
    sweet funny busy quiet smart helpful silly sleepy jolly lively polite careful bouncy tiny
    proud cheeky lovely bright merry eager sunny chatty dreamy
""")
FUR_TRAITS = _words("fluffy furry fuzzy spotted striped soft cuddly")
COLORS = _words("red blue green yellow pink purple orange white black brown gold silver gray")
THING_TRAITS = _words("""
    shiny little big soft old new tiny round pretty funny sparkly striped spotted fluffy
    magic special beautiful heavy bright small smooth fancy lovely strange bumpy
""")
THINGS = _phrases("""
    ball, kite, teddy bear, doll, toy car, toy boat, hat, box, book, drum, whistle, shell,
    stone, feather, marble, ring, key, crown, spoon, cup, blanket, balloon, bucket, shovel,
    robot, toy train, truck, puzzle, crayon, pencil, bell, button, coin, umbrella, scarf,
    mitten, sock, shoe, necklace, bracelet, star, map, jar, basket, bottle, lamp, clock,
    mirror, brush, ribbon, bow, block, spinning top, rope, bag, wagon, bike, sled, wand,
    mask, flag, rocket, toy plane, dinosaur, dragon, pillow, backpack, cape, boot, glove,
    pebble, acorn, pinecone, leaf, flower, bead, trumpet, guitar, flute, violin, piano,
    paintbrush, notebook, picture, postcard, letter, ticket, sticker, tent, telescope,
    camera, watch, compass, lantern, candle, tea set, music box, treasure chest, jack in the
    box, rubber duck, toy horse, toy soldier, stuffed bunny, stuffed dog, puppet, jump rope,
    hula hoop, skateboard, scooter, fishing rod, net, helmet, sweater, jacket, dress, bowl,
    plate, teapot, kettle, egg
""")
# (where the hero plays, the place as a noun phrase)
PLACES = (
    ("in the park", "the park"),
    ("in the garden", "the garden"),
    ("in the forest", "the forest"),
    ("at the beach", "the beach"),
    ("by the river", "the river"),
    ("near the lake", "the lake"),
    ("in the meadow", "the meadow"),
    ("in the backyard", "the backyard"),
    ("at the playground", "the playground"),
    ("on the hill", "the hill"),
    ("in the field", "the field"),
    ("in the yard", "the yard"),
    ("at school", "school"),
    ("by the pond", "the pond"),
    ("in the woods", "the woods"),
    ("on the farm", "the farm"),
    ("in the street", "the street"),
    ("by the sea", "the sea"),
    ("in the valley", "the valley"),
    ("near the old barn", "the old barn"),
    ("in the orchard", "the orchard"),
    ("by the big oak tree", "the big oak tree"),
    ("in the sandbox", "the sandbox"),
    ("near the little bridge", "the little bridge"),
    ("in the snow", "the snow"),
    ("at the zoo", "the zoo"),
    ("in the jungle", "the jungle"),
    ("by the fountain", "the fountain"),
    ("on the porch", "the porch"),
    ("in the attic", "the attic"),
)
HOMES = _lines("""
    in a small house by the sea
    in a big house on a hill
    in a little house in the woods
    in a cozy cottage near the forest
    in a tall tree in the forest
    on a farm with many animals
    in a busy town
    in a quiet village
    in a yellow house with a red door
    in a little blue house
    near a big river
    at the edge of a green meadow
    in a warm hole under a tree
    in a small flat in the city
    in a house with a big garden
""")
HIDING_SPOTS = _lines("""
    under a big tree
    behind a rock
    in the tall grass
    next to the pond
    under a pile of leaves
    near the old fence
    inside a hollow log
    in the sand
    under a bench
    beside a bush
    between two stones
    at the bottom of the hill
    in a patch of flowers
    near the swings
    under the slide
""")
SEARCH_SPOTS = _lines("""
    under the bed
    behind the sofa
    in the toy box
    in the kitchen
    under the table
    in the closet
    in the garden
    behind the door
    in the car
    on the shelf
    in the bathtub
    under the pillow
    in the basket
    behind the curtains
    in the shed
    on the stairs
""")
FOUND_SPOTS = _lines("""
    under the couch
    in the laundry basket
    behind a flower pot
    in {his} backpack
    on top of the fridge
    in the sandbox
    inside a boot
    under a big pile of clothes
    in the dog's bed
    behind the bookshelf
    in the garden, next to the roses
    in {his} coat pocket
""")
ACTIVITIES = _lines("""
    play with {his} toys
    draw pictures
    paint pictures of the sea
    sing songs
    dance
    read books
    run in the grass
    jump in puddles
    climb trees
    swing on the swings
    build towers with blocks
    look at the clouds
    watch the birds
    pick flowers
    ride {his} bike
    play hide and seek
    play ball
    chase butterflies
    splash in the water
    dig in the sand
    bake cookies with {his} {parent}
    help {his} {parent} in the garden
    count the stars
    tell funny stories
    play the drum
    make things out of clay
    collect shells
    collect pretty stones
    fly {his} kite
    feed the ducks
    roll down the hill
    play dress up
    skip and hop
    make sandcastles
    listen to music
    play with {his} friends
    look for bugs
    build forts with pillows
    water the flowers
    blow bubbles
    hum little songs
    play tag
    splash in the rain
    make paper boats
    play in the leaves
    look at picture books
    play with {his} ball
    walk in the woods
""")
FOODS = _lines("""
    an apple
    a banana
    some cookies
    a piece of cake
    a sandwich
    a carrot
    a pear
    some grapes
    some cherries
    some strawberries
    some bread
    some cheese
    a bowl of soup
    a slice of pie
    a muffin
    a pancake
    a cupcake
    some berries
    a peach
    a plum
    some honey
    some nuts
    some seeds
    some corn
    a bowl of rice
    some noodles
    a slice of pizza
    an ice cream
    a cup of milk
    some juice
    some toast with jam
    a boiled egg
    some popcorn
    a slice of watermelon
    an orange
    a cookie
    a cracker
    some soup
""")
FEELINGS_GOOD = _words("happy glad excited proud thankful cheerful joyful delighted")
FEELINGS_BAD = _words("sad worried upset scared lonely unhappy nervous grumpy")
SURPRISED = _words("surprised amazed excited curious happy")
ADVERBS = _words("carefully gently slowly quickly quietly softly happily bravely")
FINISHED = _words("beautiful perfect lovely wonderful")
SIBLINGS = _words("brother sister")
SOUNDS = _words("soft strange sad little funny loud squeaky tiny")
DAYS = _lines("""
    One day
    One morning
    One sunny morning
    One afternoon
    One sunny day
    One warm day
    One cold morning
    One rainy day
    One windy day
    One evening
    Later that week
    One bright day
    One summer day
    One winter morning
    One spring day
    One autumn afternoon
""")
WEATHER = _lines("""
    The sun was shining and the birds were singing.
    The sky was blue and the air was warm.
    A soft wind was blowing through the trees.
    It was a cold day, and snow covered the ground.
    The flowers were blooming and the air smelled sweet.
    Big gray clouds were moving across the sky.
    Little drops of rain were falling on the roof.
    The leaves were red and gold and orange.
    The grass was wet and green after the rain.
    It was a hot day, and the sun was very bright.
""")
# (the adult, how the hero addresses them, pronoun, possessive)
ADULTS = (
    ("mom", "Mom", "she", "her"),
    ("dad", "Dad", "he", "his"),
    ("grandma", "Grandma", "she", "her"),
    ("grandpa", "Grandpa", "he", "his"),
    ("mother", "Mother", "she", "her"),
    ("father", "Father", "he", "his"),
)
# (fear, the scene that brings it, what the hero bravely does)
FEARS = (
    ("the dark", "That night, the lights in the house went out.",
     "walked slowly to the window and looked at the moon"),
    ("thunder", "That night, there was a big storm with loud thunder.",
     "counted the seconds between the flashes and the booms"),
    ("the water", "{Day}, {his} family went to the lake to swim.",
     "put one foot in the water, then the other"),
    ("big dogs", "{Day}, a big dog came running down the street.",
     "held out {his} hand and let the dog sniff it"),
    ("the tall slide", "{Day}, {his} friends wanted to go down the tall slide.",
     "climbed up the ladder one step at a time"),
    ("bees", "{Day}, a bee flew into the garden.",
     "stood very still and watched the bee visit the flowers"),
    ("spiders", "{Day}, {he} saw a spider in the corner of {his} room.",
     "looked closely at the spider and its pretty web"),
    ("loud noises", "{Day}, a fire truck drove past with its siren on.",
     "covered {his} ears and waved at the firefighters"),
    ("the doctor", "{Day}, it was time to visit the doctor.",
     "sat on the big chair and let the doctor listen to {his} heart"),
    ("new places", "{Day}, it was {his} first day at a new school.",
     "walked into the classroom and said hello"),
)
# (what the hero makes, what it needs, what goes wrong)
GIFTS = (
    ("cake", "some flour, some eggs and a lot of sugar", "dropped the bowl on the floor"),
    ("birthday card", "some paper, some glue and {his} best crayons",
     "spilled water all over the paper"),
    ("paper hat", "a big sheet of paper and some tape", "tore the paper in half"),
    ("picture", "{his} paints and a big brush", "smudged the paint with {his} sleeve"),
    ("necklace", "a long string and many colorful beads", "let all the beads roll away"),
    ("little house of sticks", "some sticks and some string", "watched it fall down in the wind"),
    ("sandcastle", "a bucket and a shovel", "saw a wave wash it away"),
    ("flower crown", "many flowers from the meadow", "broke the stems by mistake"),
    ("bird feeder", "an old box, some string and some seeds", "could not make it hang straight"),
    ("batch of cookies", "some butter, some flour and some chocolate",
     "left the cookies in the oven too long"),
    ("kite", "some paper, two sticks and a long string", "saw the string break"),
    ("song", "{his} little drum and a lot of ideas", "forgot all the words"),
)
# (a place to visit, three sights there, something the hero does there)
TRIPS = (
    ("the zoo", ("lions", "elephants", "monkeys", "giraffes", "penguins", "zebras"),
     "watched the monkeys eat bananas"),
    ("the beach", ("shells", "crabs", "boats", "seagulls", "big waves", "starfish"),
     "built a big sandcastle"),
    ("the farm", ("cows", "pigs", "sheep", "horses", "chickens", "goats"),
     "fed a little goat some grass"),
    ("the forest", ("tall trees", "mushrooms", "squirrels", "deer", "owls", "wild flowers"),
     "found a path that led to a tiny waterfall"),
    ("the market", ("apples", "pumpkins", "flowers", "fresh bread", "cheese", "honey"),
     "helped carry a bag of oranges"),
    ("the library", ("books about dragons", "books about space", "maps", "comic books",
                     "picture books", "old globes"), "read a book about the moon"),
    ("the museum", ("dinosaur bones", "old coins", "paintings", "statues", "rockets", "masks"),
     "stood next to a giant dinosaur"),
    ("the lake", ("ducks", "swans", "fish", "boats", "frogs", "dragonflies"),
     "threw little stones into the water"),
    ("the mountains", ("snow", "rocks", "eagles", "goats", "streams", "pine trees"),
     "climbed to the top of a big rock"),
    ("the fair", ("balloons", "clowns", "ponies", "games", "music", "candy apples"),
     "rode on a merry go round"),
)
# (a skill, how trying it goes wrong)
SKILLS = (
    ("ride a bike", "{he} kept falling over"),
    ("swim", "{he} kept sinking"),
    ("whistle", "only air came out"),
    ("climb the big tree", "{he} kept slipping down"),
    ("tie {his} shoes", "the laces kept coming loose"),
    ("fly a kite", "the kite kept falling down"),
    ("jump rope", "{he} kept tripping on the rope"),
    ("read a book", "the words were very hard"),
    ("skate on the ice", "{he} kept sliding and falling"),
    ("play the flute", "it only made funny squeaks"),
    ("catch a ball", "the ball kept bouncing away"),
    ("do a cartwheel", "{he} kept landing on {his} back"),
    ("bake bread", "the bread came out flat"),
    ("paint a flower", "it looked like a big blob"),
)
# (what trouble a creature is in, how the hero gets it out)
RESCUES = (
    ("stuck in a thorny bush", "pulled the branches apart"),
    ("stuck in the mud", "lifted it out of the mud"),
    ("caught in an old net", "untangled the net"),
    ("that had hurt its leg", "wrapped its leg in a soft cloth"),
    ("that could not find its way home", "helped it look for its home"),
    ("that was very hungry", "gave it {food}"),
    ("that had fallen out of its nest", "put it back in its nest"),
    ("stuck up in a tall tree", "climbed up and carried it down"),
    ("trapped under a heavy branch", "pushed the branch away"),
    ("that was cold and wet", "wrapped it in {his} scarf"),
    ("stuck in a deep hole", "made a ramp out of sticks"),
)
CREATURE_THANKS = _lines("""
    licked {his} hand
    sang a happy song
    jumped up and down
    danced around {his} feet
    gave {him} a little kiss
    rubbed its head against {his} hand
    flapped its wings
    made a happy little noise
""")
