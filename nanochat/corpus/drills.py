"""
Arithmetic and spelling documents for the built-in corpus: worked sums and products, word problems,
words spelled letter by letter and letter counts. The chat tasks reuse the word list and the number
helpers so their questions look like what pretraining showed.
"""

# -----------------------------------------------------------------------------
# Arithmetic documents. Every "a op b = c" written here is a single true equation (never a
# chain like "a + b + c = d"), so the text can be checked mechanically.

_ITEMS = ["apples", "coins", "books", "stamps", "marbles", "pencils", "shells", "cards"]


def _number(rng):
    digits = rng.choice([1, 1, 2, 2, 2, 3, 3, 4, 5])
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10 ** digits - 1)


def _equation(rng, op):
    if op == "+":
        a, b = _number(rng), _number(rng)
        return a, b, a + b
    if op == "-":
        a, b = _number(rng), _number(rng)
        if rng.random() < 0.85:
            a, b = max(a, b), min(a, b)
        return a, b, a - b
    if op == "*":
        a, b = rng.randint(0, 99), rng.choice([rng.randint(0, 12), rng.randint(0, 999)])
        return a, b, a * b
    b, c = rng.randint(1, 99), rng.randint(0, 99)  # exact division
    return b * c, b, c


def _equation_with_op(rng, op):
    a, b, c = _equation(rng, op)
    return a, op, b, c


OP_SYMBOLS = {"+": ["+"], "-": ["-"], "*": ["*", "×"], "/": ["/", "÷"]}
_OP_PHRASES = {
    "+": ["The sum of {a} and {b} is {c}.", "{a} plus {b} equals {c}.", "Adding {a} and {b} gives {c}."],
    "-": ["The difference between {a} and {b} is {c}.", "{a} minus {b} equals {c}.", "Taking {b} away from {a} leaves {c}."],
    "*": ["The product of {a} and {b} is {c}.", "{a} times {b} equals {c}.", "Multiplying {a} by {b} gives {c}."],
    "/": ["{a} divided by {b} is {c}.", "Dividing {a} by {b} gives {c}.", "{a} split into {b} equal parts gives {c} each."],
}


def _symbolic(rng, a, op, b, c):
    return f"{a} {rng.choice(OP_SYMBOLS[op])} {b} = {c}"


def _column_addition(rng):
    a, b = rng.randint(100, 99999), rng.randint(100, 9999)
    lines = [f"Let's add {a} and {b} column by column."]
    carry, place_names = 0, ["ones", "tens", "hundreds", "thousands", "ten thousands", "hundred thousands"]
    da, db = str(a)[::-1], str(b)[::-1]
    for i in range(max(len(da), len(db))):
        x, y = int(da[i]) if i < len(da) else 0, int(db[i]) if i < len(db) else 0
        step = f"{place_names[i].capitalize()}: {x} + {y} = {x + y}"
        total = x + y + carry
        if carry:
            step += f", plus the carried 1 makes {total}"
        carry = total // 10
        step += f", write {total % 10}" + (" and carry 1." if carry else ".")
        lines.append(step)
    if carry:
        lines.append("Write the final carried 1 in front.")
    lines.append(f"So {a} + {b} = {a + b}.")
    return "\n".join(lines)


def _long_multiplication(rng):
    a, b = rng.randint(11, 999), rng.randint(11, 99)
    tens, ones = b - b % 10, b % 10
    parts = [f"To work out {a} × {b}, split {b} into {tens} and {ones}." if ones else
             f"To work out {a} × {b}, multiply by {b // 10} and then by 10."]
    if ones:
        parts.append(f"First {a} × {tens} = {a * tens}, then {a} × {ones} = {a * ones}.")
        parts.append(f"Adding the two parts, {a * tens} + {a * ones} = {a * b}.")
    else:
        parts.append(f"First {a} × {b // 10} = {a * (b // 10)}, then {a * (b // 10)} × 10 = {a * b}.")
    parts.append(f"So {a} × {b} = {a * b}.")
    return " ".join(parts)


def _word_problem(rng, world):
    p = rng.choice(world.people)
    item = rng.choice(_ITEMS)
    kind = rng.randint(0, 3)
    if kind == 0:
        a, b = rng.randint(2, 500), rng.randint(2, 500)
        return f"{p.first} had {a} {item} and got {b} more. {a} + {b} = {a + b}, so {p.first} now has {a + b} {item}."
    if kind == 1:
        a = rng.randint(10, 900)
        b = rng.randint(1, a)
        return f"{p.first} had {a} {item} and gave away {b}. {a} - {b} = {a - b}, so {a - b} {item} are left."
    if kind == 2:
        n, k = rng.randint(2, 30), rng.randint(2, 40)
        return f"{p.first} packed {n} boxes with {k} {item} in each. {n} × {k} = {n * k}, so there are {n * k} {item} in all."
    c1, c2, c3 = rng.sample(world.countries, 3)
    a, b = rng.randint(20, 900), rng.randint(20, 900)
    return (f"The road from {c1.capital} to {c2.capital} is {a} km long, and from {c2.capital} to {c3.capital} "
            f"it is {b} km. The whole trip is {a} + {b} = {a + b} km.")


def arithmetic_document(rng, world):
    style = rng.randint(0, 5)
    ops = ["+", "-", "*", "/"]
    if style == 0:
        title = rng.choice(["Practice sums", "Arithmetic drill", "Exercises with answers", "Quick maths"])
        lines = [_symbolic(rng, *_equation_with_op(rng, rng.choice(ops))) for _ in range(rng.randint(6, 16))]
        return title + "\n\n" + "\n".join(lines)
    if style == 1:
        sentences = []
        for _ in range(rng.randint(4, 10)):
            op = rng.choice(ops)
            a, b, c = _equation(rng, op)
            sentences.append(rng.choice(_OP_PHRASES[op]).format(a=a, b=b, c=c))
        return " ".join(sentences)
    if style == 2:
        lines = []
        for _ in range(rng.randint(4, 10)):
            a, op, b, c = _equation_with_op(rng, rng.choice(ops))
            word = {"+": "plus", "-": "minus", "*": "times", "/": "divided by"}[op]
            lines += [rng.choice([f"Q: What is {a} {word} {b}?", f"Q: What is {a} {rng.choice(OP_SYMBOLS[op])} {b}?"]),
                      f"A: {_symbolic(rng, a, op, b, c)}."]
        return "\n".join(lines)
    if style == 3:
        return _column_addition(rng)
    if style == 4:
        return _long_multiplication(rng)
    return "\n".join(_word_problem(rng, world) for _ in range(rng.randint(2, 5)))


# -----------------------------------------------------------------------------
# Spelling documents

SPELLING_WORDS = """
apple banana cherry orange lemon melon grape peach river mountain valley island forest garden
window kitchen table chair pencil paper letter number circle square triangle bridge castle
tower village market doctor teacher farmer sailor painter animal rabbit turtle dolphin giraffe
elephant monkey spider butterfly penguin falcon kitten puppy mirror ladder blanket pillow basket
bottle candle button pocket jacket sweater umbrella bicycle rocket planet comet galaxy weather
thunder rainbow sunshine shadow morning evening midnight summer winter autumn spring holiday
birthday journey picture history science music dinner breakfast supper cookie butter cheese
pepper tomato potato carrot onion garlic noodle coffee sugar strawberry blueberry pineapple
coconut avocado mississippi committee balloon bookkeeper address possess success tomorrow
parallel accommodate assessment raspberry excellent necessary occasion beginning
different education important question language library mathematics neighbour remember sentence
together vegetable wonderful yellow zebra alphabet chocolate dictionary engineer
""".split()


def spell_out(word, sep="-"):
    return sep.join(word)


def spelling_document(rng, world):
    style = rng.randint(0, 4)
    if style == 0:
        words = rng.sample(SPELLING_WORDS, rng.randint(5, 10))
        if rng.random() < 0.5:  # names from the world are words too
            words.append(rng.choice(world.countries + world.people).name.split()[0])
        lines = [rng.choice(["Spelling list", "How to spell these words", "Spelling practice"]), ""]
        lines += [f"{w} is spelled {spell_out(w)}." for w in words]
        return "\n".join(lines)
    if style == 1:
        return "\n".join(f"Spelling {w} letter by letter: {spell_out(w, ', ')}. The word {w} has {len(w)} letters."
                         for w in rng.sample(SPELLING_WORDS, rng.randint(3, 6)))
    if style == 2:
        out = []
        for w in rng.sample(SPELLING_WORDS, rng.randint(3, 6)):
            letter = rng.choice(w) if rng.random() < 0.85 else rng.choice("abcdefghijklmnopqrstuvwxyz")
            k = w.count(letter)
            out.append(rng.choice([f"The word {w} has {k} letter {letter}.",
                                   f"The letter {letter} appears {k} {'time' if k == 1 else 'times'} in {w}.",
                                   f"How many {letter}'s are in {w}? {spell_out(w)}. The word {w} has {k} letter {letter}."]))
        return "\n".join(out)
    if style == 3:
        w = rng.choice(SPELLING_WORDS)
        letter = rng.choice(w)
        steps, k = [], 0
        for ch in w:
            if ch == letter:
                k += 1
                steps.append(f"{ch} ({k})")
            else:
                steps.append(ch)
        return (f"Let's count the letter {letter} in {w}. Going letter by letter: {', '.join(steps)}. "
                f"The word {w} has {k} letter {letter}.")
    return "\n".join(rng.choice([f"{w} backwards is {w[::-1]}.", f"The first letter of {w} is {w[0]}.",
                                 f"The last letter of {w} is {w[-1]}.", f"The word {w} has {len(w)} letters."])
                     for w in rng.sample(SPELLING_WORDS, rng.randint(4, 8)))
