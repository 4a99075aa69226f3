"""Built-in translation tasks, generated on the fly (no download), deterministic by seed.

``dates``: an English date in one of many surface forms -> its ISO form::

    "the twenty-first of March, nineteen ninety-nine" -> "1999-03-21"
    "3/21/1999", "21.03.1999", "Sun, Mar. 21 1999", "MARCH 21ST, 1999" -> "1999-03-21"

``numbers``: a number written out in English words -> its digits::

    "three hundred and forty-two thousand, one hundred five" -> "342105"

The held-out test split is drawn from values (dates, numbers) that never occur in the
training split, so no training source or target ever appears among the test pairs.
"""
import datetime
import random
from typing import Callable, Dict, List, Sequence, Tuple

Pair = Tuple[str, str]

_ONES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
         "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen",
         "nineteen"]
_TENS = ["", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]
_ORDINAL_ONES = ["zeroth", "first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth",
                 "ninth", "tenth", "eleventh", "twelfth", "thirteenth", "fourteenth", "fifteenth",
                 "sixteenth", "seventeenth", "eighteenth", "nineteenth"]
_ORDINAL_TENS = ["", "", "twentieth", "thirtieth", "fortieth", "fiftieth", "sixtieth", "seventieth",
                 "eightieth", "ninetieth"]
_MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September",
           "October", "November", "December"]
_WEEKDAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]


def words_below_100(n: int) -> str:
    """0..99 in words: 'seven', 'forty', 'forty-two'."""
    if n < 20:
        return _ONES[n]
    tens, ones = divmod(n, 10)
    return _TENS[tens] + ("-" + _ONES[ones] if ones else "")


def ordinal_words(n: int) -> str:
    """1..99 as an ordinal in words: 'first', 'twelfth', 'twenty-first', 'thirtieth'."""
    if n < 20:
        return _ORDINAL_ONES[n]
    tens, ones = divmod(n, 10)
    return _TENS[tens] + "-" + _ORDINAL_ONES[ones] if ones else _ORDINAL_TENS[tens]


def ordinal_suffix(n: int) -> str:
    """1 -> '1st', 2 -> '2nd', 11 -> '11th', 23 -> '23rd'."""
    if 10 <= n % 100 <= 20:
        return f"{n}th"
    return f"{n}" + {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")


def words_below_1000(n: int, rng: random.Random) -> str:
    """0..999 in words, with or without the British 'and': 'one hundred (and) five'."""
    hundreds, rest = divmod(n, 100)
    if not hundreds:
        return words_below_100(rest)
    head = _ONES[hundreds] + " hundred"
    if not rest:
        return head
    return head + (" and " if rng.random() < 0.5 else " ") + words_below_100(rest)


def number_words(n: int, rng: random.Random) -> str:
    """0..999,999,999 in words, e.g. 'three hundred forty-two thousand, one hundred five'."""
    if n == 0:
        return "zero"
    parts = []
    for value, name in ((1_000_000, "million"), (1_000, "thousand")):
        if n >= value:
            parts.append(words_below_1000(n // value, rng) + " " + name)
            n %= value
    if n:
        last = words_below_1000(n, rng)
        if parts and n < 100 and rng.random() < 0.5:
            last = "and " + last
        parts.append(last)
    sep = ", " if rng.random() < 0.3 else " "
    return sep.join(parts)


def year_words(year: int, rng: random.Random) -> str:
    """A year as people say it: 'nineteen ninety-nine', 'nineteen oh five', 'two thousand and
    eight', 'twenty twenty-three' (1100 <= year <= 9999)."""
    century, rest = divmod(year, 100)
    if year % 1000 < 10 and (year % 1000 == 0 or rng.random() < 0.7):
        # 2000 -> two thousand, 2005 -> two thousand (and) five
        head = _ONES[year // 1000] + " thousand"
        if year % 1000 == 0:
            return head
        return head + (" and " if rng.random() < 0.5 else " ") + _ONES[year % 1000]
    if century % 10 == 0 and rest >= 10 and rng.random() < 0.3:
        # 2015 -> two thousand (and) fifteen
        return (_ONES[year // 1000] + " thousand" + (" and " if rng.random() < 0.5 else " ")
                + words_below_100(rest))
    head = words_below_100(century)
    if rest == 0:
        return head + " hundred"
    if rest < 10:
        return head + " oh " + _ONES[rest]
    return head + " " + words_below_100(rest)


def _month(date: datetime.date, rng: random.Random) -> str:
    name = _MONTHS[date.month - 1]
    r = rng.random()
    if r < 0.6 or len(name) <= 4:
        return name
    return name[:3] + ("." if r < 0.8 else "")


def _day(date: datetime.date, rng: random.Random, words_ok: bool) -> str:
    r = rng.random()
    if words_ok and r < 0.4:
        return ordinal_words(date.day)
    if r < 0.7:
        return ordinal_suffix(date.day)
    return str(date.day)


def _year(date: datetime.date, rng: random.Random, words_ok: bool) -> str:
    if words_ok and rng.random() < 0.5:
        return year_words(date.year, rng)
    return str(date.year)


def _weekday(date: datetime.date, rng: random.Random) -> str:
    if rng.random() < 0.75:
        return ""
    name = _WEEKDAYS[date.weekday()]
    return (name if rng.random() < 0.6 else name[:3]) + ", "


def _numeric_form(date: datetime.date, rng: random.Random) -> str:
    pad = rng.random() < 0.5
    d = f"{date.day:02d}" if pad else str(date.day)
    m = f"{date.month:02d}" if pad else str(date.month)
    style = rng.randrange(3)
    if style == 0:
        return f"{m}/{d}/{date.year}"  # US order with slashes
    if style == 1:
        return f"{d}.{m}.{date.year}"  # European order with dots
    return f"{date.year}/{date.month:02d}/{date.day:02d}"


def _month_first_form(date: datetime.date, rng: random.Random) -> str:
    words_ok = rng.random() < 0.5
    comma = "," if rng.random() < 0.6 else ""
    return f"{_weekday(date, rng)}{_month(date, rng)} {_day(date, rng, words_ok)}{comma} {_year(date, rng, words_ok)}"


def _day_first_form(date: datetime.date, rng: random.Random) -> str:
    words_ok = rng.random() < 0.5
    day = _day(date, rng, words_ok)
    if day[0].isalpha() or rng.random() < 0.5:
        if day.isdigit():
            day = ordinal_suffix(date.day)  # "the 16th of May", never "the 16 of May"
        lead = "the " if rng.random() < 0.5 else ""
        comma = "," if rng.random() < 0.5 else ""
        body = f"{lead}{day} of {_month(date, rng)}{comma} {_year(date, rng, words_ok)}"
    else:
        body = f"{day} {_month(date, rng)} {_year(date, rng, words_ok)}"
    return _weekday(date, rng) + body


def date_surface_form(date: datetime.date, rng: random.Random) -> str:
    """One random English surface form of ``date`` (numeric, month-first, day-first; digits or
    words; abbreviations, weekday prefix, letter case)."""
    r = rng.random()
    if r < 0.25:
        text = _numeric_form(date, rng)
    elif r < 0.6:
        text = _month_first_form(date, rng)
    else:
        text = _day_first_form(date, rng)
    case = rng.random()
    if case < 0.2:
        text = text.lower()
    elif case < 0.3:
        text = text.upper()
    return text


def _split_values(values: Sequence, n_test: int, rng: random.Random) -> Tuple[List, List]:
    if not 0 < n_test < len(values):
        raise ValueError(f"n_test must be in [1, {len(values) - 1}] for this task, got {n_test}")
    order = list(values)
    rng.shuffle(order)
    return order[n_test:], order[:n_test]


def dates(n_train: int = 60000, n_test: int = 1000, seed: int = 0,
          first_year: int = 1900, last_year: int = 2099) -> Tuple[List[Pair], List[Pair]]:
    """The dates task: ``(train_pairs, test_pairs)``.

    Test pairs are one surface form each of ``n_test`` dates that the training pairs never use;
    training pairs are ``n_train`` random surface forms of the remaining dates.
    """
    rng = random.Random(f"dates-{seed}")
    start, end = datetime.date(first_year, 1, 1), datetime.date(last_year, 12, 31)
    days = [start + datetime.timedelta(days=i) for i in range((end - start).days + 1)]
    train_days, test_days = _split_values(days, n_test, rng)
    test = [(date_surface_form(d, rng), d.isoformat()) for d in test_days]
    train = []
    for _ in range(n_train):
        d = train_days[rng.randrange(len(train_days))]
        train.append((date_surface_form(d, rng), d.isoformat()))
    return train, test


def numbers(n_train: int = 60000, n_test: int = 1000, seed: int = 0,
            max_value: int = 999_999) -> Tuple[List[Pair], List[Pair]]:
    """The numbers task: English words -> digits, for 0..max_value, test values held out."""
    rng = random.Random(f"numbers-{seed}")
    test_values = set()
    while len(test_values) < n_test:
        test_values.add(rng.randrange(max_value + 1))
    test = [(number_words(n, rng), str(n)) for n in sorted(test_values)]
    rng.shuffle(test)
    train = []
    while len(train) < n_train:
        n = rng.randrange(max_value + 1)
        if n not in test_values:
            train.append((number_words(n, rng), str(n)))
    return train, test


TASKS: Dict[str, Callable[..., Tuple[List[Pair], List[Pair]]]] = {"dates": dates, "numbers": numbers}


def make_task(name: str, n_train: int, n_test: int, seed: int) -> Tuple[List[Pair], List[Pair]]:
    """``(train_pairs, test_pairs)`` of built-in task ``name`` (one of :data:`TASKS`)."""
    if name not in TASKS:
        raise ValueError(f"task must be one of {sorted(TASKS)}, got {name!r}")
    return TASKS[name](n_train=n_train, n_test=n_test, seed=seed)
