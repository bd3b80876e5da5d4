"""Training data of the demo adapters: templated question/answer pairs, made here, no download.

Every example has one question and three answers written here: a plain English one (a
reference), a French one (`french`) and one short sentence (`terse`). Facts (capitals, colours,
sums) are filled into templates; open questions are written out by hand so that the styles carry
over to questions the adapters have not seen. The `caps` adapter learns from the base model's own
greedy answers, upper-cased (`caps`): it then changes the case, not what the model knows.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Example:
    question: str
    english: str
    french: str
    terse: str


# (country, capital, French country phrase "de ...")
CAPITALS = [
    ("France", "Paris", "de la France"),
    ("Germany", "Berlin", "de l'Allemagne"),
    ("Italy", "Rome", "de l'Italie"),
    ("Spain", "Madrid", "de l'Espagne"),
    ("Japan", "Tokyo", "du Japon"),
    ("Canada", "Ottawa", "du Canada"),
    ("Egypt", "Cairo", "de l'Égypte"),
    ("Portugal", "Lisbon", "du Portugal"),
    ("Greece", "Athens", "de la Grèce"),
    ("Norway", "Oslo", "de la Norvège"),
    ("Peru", "Lima", "du Pérou"),
    ("Kenya", "Nairobi", "du Kenya"),
]
FRENCH_CITY = {"Rome": "Rome", "Cairo": "Le Caire", "Lisbon": "Lisbonne", "Athens": "Athènes"}

# (thing, colour, French "le/la thing", French colour agreeing with it)
COLOURS = [
    ("a banana", "yellow", "La banane", "jaune"),
    ("grass", "green", "L'herbe", "verte"),
    ("the sky on a clear day", "blue", "Le ciel par beau temps", "bleu"),
    ("snow", "white", "La neige", "blanche"),
    ("a ripe tomato", "red", "La tomate mûre", "rouge"),
    ("coal", "black", "Le charbon", "noir"),
    ("an orange", "orange", "L'orange", "orange"),
    ("a lemon", "yellow", "Le citron", "jaune"),
]

SUMS = [(2, 3), (4, 5), (7, 6), (10, 12), (9, 9), (15, 4), (8, 3), (20, 30)]
FRENCH_NUMBERS = {
    5: "cinq",
    9: "neuf",
    13: "treize",
    22: "vingt-deux",
    18: "dix-huit",
    19: "dix-neuf",
    11: "onze",
    50: "cinquante",
}

OPEN_QUESTIONS = [
    Example(
        "How can I sleep better?",
        "Go to bed at the same time every night and keep your room dark and cool. Avoid screens "
        "and coffee in the evening.",
        "Couchez-vous à la même heure chaque soir et gardez la chambre sombre et fraîche. Évitez "
        "les écrans et le café le soir.",
        "Keep a regular bedtime.",
    ),
    Example(
        "Why is the sky blue?",
        "Sunlight is scattered by the air, and blue light is scattered the most. That scattered "
        "blue light reaches our eyes from every direction.",
        "La lumière du soleil est diffusée par l'air, et la lumière bleue est la plus diffusée. "
        "C'est pourquoi le ciel nous paraît bleu.",
        "Air scatters blue light most.",
    ),
    Example(
        "What is Python?",
        "Python is a popular programming language. It is easy to read and is used for the web, "
        "data science and automation.",
        "Python est un langage de programmation populaire. Il est facile à lire et sert au web, "
        "aux données et à l'automatisation.",
        "A programming language.",
    ),
    Example(
        "Give me a tip for learning to cook.",
        "Start with a few simple recipes and cook them often. Taste as you go and adjust the salt.",
        "Commencez par quelques recettes simples et cuisinez-les souvent. Goûtez au fur et à "
        "mesure et ajustez le sel.",
        "Start with simple recipes.",
    ),
    Example(
        "Describe a cat.",
        "A cat is a small furry animal with sharp claws and whiskers. Cats are curious, playful "
        "and like to sleep a lot.",
        "Le chat est un petit animal à fourrure avec des griffes et des moustaches. Il est "
        "curieux, joueur et dort beaucoup.",
        "A small, curious, furry pet.",
    ),
    Example(
        "What is the sun?",
        "The sun is the star at the center of our solar system. It gives the Earth light and heat.",
        "Le soleil est l'étoile au centre de notre système solaire. Il donne à la Terre sa "
        "lumière et sa chaleur.",
        "Our nearest star.",
    ),
    Example(
        "How do plants grow?",
        "Plants take water from the soil and light from the sun. They use them to make sugar "
        "and grow.",
        "Les plantes puisent l'eau du sol et la lumière du soleil. Elles s'en servent pour "
        "fabriquer du sucre et grandir.",
        "With water, light and soil.",
    ),
    Example(
        "What should I do on a rainy day?",
        "You could read a good book, watch a film or cook something warm. It is also a nice day "
        "to call a friend.",
        "Vous pouvez lire un bon livre, regarder un film ou cuisiner un plat chaud. C'est aussi "
        "un bon jour pour appeler un ami.",
        "Read a book.",
    ),
    Example(
        "Tell me about the ocean.",
        "The ocean covers most of the Earth. It is home to fish, whales and countless other "
        "living things.",
        "L'océan couvre la plus grande partie de la Terre. Il abrite des poissons, des baleines "
        "et d'innombrables êtres vivants.",
        "A vast body of salt water.",
    ),
    Example(
        "How do I stay healthy?",
        "Eat plenty of vegetables, move every day and sleep enough. Drink water and see friends.",
        "Mangez beaucoup de légumes, bougez chaque jour et dormez assez. Buvez de l'eau et "
        "voyez vos amis.",
        "Eat well, move, sleep.",
    ),
    Example(
        "What is a computer?",
        "A computer is a machine that follows instructions to process information. It can "
        "calculate, store data and run programs.",
        "Un ordinateur est une machine qui suit des instructions pour traiter l'information. Il "
        "calcule, stocke des données et exécute des programmes.",
        "A machine that runs programs.",
    ),
    Example(
        "Hello! Who are you?",
        "Hello! I am a helpful assistant. Ask me anything and I will do my best to help.",
        "Bonjour ! Je suis un assistant serviable. Posez-moi une question et je ferai de mon "
        "mieux pour vous aider.",
        "A helpful assistant.",
    ),
    Example(
        "What is the weather like in summer?",
        "Summer is usually warm and sunny. The days are long and the nights are short.",
        "L'été est généralement chaud et ensoleillé. Les jours sont longs et les nuits sont "
        "courtes.",
        "Warm and sunny.",
    ),
    Example(
        "How do I boil an egg?",
        "Put the egg in boiling water for about eight minutes. Then cool it in cold water.",
        "Plongez l'œuf dans l'eau bouillante pendant environ huit minutes. Ensuite, "
        "refroidissez-le dans l'eau froide.",
        "Boil it for eight minutes.",
    ),
    Example(
        "What is music?",
        "Music is sound arranged in time with rhythm and melody. People make it with voices and "
        "instruments.",
        "La musique est un art qui organise les sons dans le temps. On la joue avec la voix et "
        "des instruments.",
        "Organized sound.",
    ),
    Example(
        "Why do we need water?",
        "Our bodies are mostly water. We need it to keep cool, digest food and carry nutrients.",
        "Notre corps est composé surtout d'eau. Nous en avons besoin pour rester frais, digérer "
        "et transporter les nutriments.",
        "To keep our bodies working.",
    ),
    Example(
        "What is a tree?",
        "A tree is a tall plant with a woody trunk, branches and leaves. Trees give us shade, "
        "wood and oxygen.",
        "Un arbre est une grande plante avec un tronc, des branches et des feuilles. Les arbres "
        "nous donnent de l'ombre, du bois et de l'oxygène.",
        "A tall woody plant.",
    ),
    Example(
        "How do airplanes fly?",
        "Wings push air downward as the plane moves forward. This creates lift that holds the "
        "plane up.",
        "Les ailes poussent l'air vers le bas quand l'avion avance. Cela crée une portance qui "
        "le maintient en l'air.",
        "Their wings create lift.",
    ),
    Example(
        "What is the best way to learn a language?",
        "Practice a little every day and speak with native speakers. Listen to music and read "
        "simple books.",
        "Pratiquez un peu chaque jour et parlez avec des locuteurs natifs. Écoutez de la musique "
        "et lisez des livres simples.",
        "Practice every day.",
    ),
    Example(
        "Write a short poem about the sea.",
        "The sea is wide and blue, it sings the whole day through. Its waves come and go, slow "
        "and soft and true.",
        "La mer est grande et bleue, elle chante sous les cieux. Ses vagues vont et viennent, "
        "douces et lointaines.",
        "Blue waves sing forever.",
    ),
    Example(
        "What is a good breakfast?",
        "A good breakfast has fruit, whole grains and some protein. Oatmeal with berries and an "
        "egg is a fine choice.",
        "Un bon petit-déjeuner contient des fruits, des céréales complètes et des protéines. Des "
        "flocons d'avoine avec des baies et un œuf, c'est parfait.",
        "Oatmeal with fruit.",
    ),
    Example(
        "Who was Albert Einstein?",
        "Albert Einstein was a physicist born in Germany in 1879. He is famous for the theory of "
        "relativity.",
        "Albert Einstein était un physicien né en Allemagne en 1879. Il est célèbre pour la "
        "théorie de la relativité.",
        "A famous physicist.",
    ),
    Example(
        "What is the internet?",
        "The internet is a global network of computers. It lets people share information, send "
        "messages and watch videos.",
        "Internet est un réseau mondial d'ordinateurs. Il permet de partager des informations, "
        "d'envoyer des messages et de regarder des vidéos.",
        "A global computer network.",
    ),
    Example(
        "Can you recommend a book?",
        "Try The Little Prince by Antoine de Saint-Exupéry. It is short, gentle and full of "
        "wisdom.",
        "Essayez Le Petit Prince d'Antoine de Saint-Exupéry. C'est un livre court, doux et plein "
        "de sagesse.",
        "The Little Prince.",
    ),
    Example(
        "How does the heart work?",
        "The heart is a muscle that pumps blood around the body. It beats about seventy times a "
        "minute.",
        "Le cœur est un muscle qui pompe le sang dans tout le corps. Il bat environ "
        "soixante-dix fois par minute.",
        "It pumps blood.",
    ),
    Example(
        "What is rain?",
        "Rain is water that falls from clouds. Tiny drops join together until they are heavy "
        "enough to fall.",
        "La pluie est de l'eau qui tombe des nuages. De petites gouttes s'unissent jusqu'à "
        "devenir assez lourdes pour tomber.",
        "Water falling from clouds.",
    ),
    Example(
        "Why should I exercise?",
        "Exercise makes your heart and muscles stronger. It also improves your mood and helps "
        "you sleep.",
        "Le sport renforce le cœur et les muscles. Il améliore aussi l'humeur et aide à dormir.",
        "It keeps you healthy.",
    ),
    Example(
        "What is a volcano?",
        "A volcano is an opening in the Earth's crust. Hot melted rock, ash and gas escape "
        "through it.",
        "Un volcan est une ouverture dans la croûte terrestre. De la roche fondue, des cendres "
        "et des gaz s'en échappent.",
        "A mountain that erupts.",
    ),
]


def examples() -> list[Example]:
    """All examples: templated facts, then the open questions."""
    out = []
    for country, city, de_country in CAPITALS:
        out.append(
            Example(
                f"What is the capital of {country}?",
                f"The capital of {country} is {city}. It is the largest and best known city there.",
                f"La capitale {de_country} est {FRENCH_CITY.get(city, city)}. C'est une ville très "
                "connue.",
                f"{city}.",
            )
        )
    for thing, colour, fr_thing, fr_colour in COLOURS:
        out.append(
            Example(
                f"What color is {thing}?",
                f"The color of {thing} is {colour}. You can see it easily in daylight.",
                f"{fr_thing} est {fr_colour}. On le voit facilement à la lumière du jour.",
                f"{colour.capitalize()}.",
            )
        )
    for a, b in SUMS:
        total = a + b
        out.append(
            Example(
                f"What is {a} plus {b}?",
                f"{a} plus {b} equals {total}. You get it by adding the two numbers together.",
                f"{a} plus {b} font {total} ({FRENCH_NUMBERS[total]}). On additionne les deux "
                "nombres.",
                f"{total}.",
            )
        )
    return out + OPEN_QUESTIONS


def caps(answer: str, max_sentences: int = 2) -> str:
    """The first sentences of `answer`, upper-cased."""
    sentences = re.split(r"(?<=[.!?])\s+", answer.strip())
    return " ".join(sentences[:max_sentences]).upper()


# Answers written here; `caps` comes from the base model at training time.
STYLES = {"french": lambda e: e.french, "terse": lambda e: e.terse}
NAMES = ("caps", "french", "terse")
