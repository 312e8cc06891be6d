"""
How well does our tokenizer compress text? Bytes per token on a few kinds of text
(prose, code, math, several languages) and on the start of the validation shard,
side by side with GPT-2's and GPT-4's (cl100k_base) tokenizers when tiktoken has
them cached. More bytes per token = shorter sequences for the same text.

    python -m scripts.tok_eval
"""

import argparse

from nanochat.common import RenamedFlag, UserError, json_loads, print0, run_main
from nanochat.dataset import get_default_source, parquets_iter_batched
from nanochat.report import get_report
from nanochat.tokenizer import RustBPETokenizer, get_tokenizer

# Samples written for this script. They only need to look like their kind of text.
PROSE = """\
The lighthouse keeper had kept the same routine for thirty-one winters. Every evening at dusk she climbed
the ninety-four iron steps, wiped the salt from the lens with a soft cloth, and wrote the weather into a
ledger whose first pages had gone the colour of weak tea. Ships rarely passed any more; the new harbour
to the south had radar, and the fishing fleet had shrunk to three boats. Still, she said, a light that is
only lit when someone is watching is not really a light at all. On the night of the great storm, when the
power failed across the whole coast, hers was the only window shining between the two headlands.
"""

CODE = '''\
import json
from pathlib import Path


def load_scores(path: Path) -> dict[str, float]:
    """Read a JSON lines file of {"name": ..., "score": ...} records into a dict."""
    scores = {}
    with path.open(encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            line = line.strip()
            if not line:
                continue
            try:
                record = json_loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line_number}: {e}") from None
            scores[record["name"]] = float(record["score"])
    return scores


if __name__ == "__main__":
    best = max(load_scores(Path("scores.jsonl")).items(), key=lambda kv: kv[1])
    print(f"best: {best[0]} ({best[1]:.3f})")
'''

MATH = r"""
Let $f(x) = 3x^2 - 12x + 7$. Completing the square, $f(x) = 3(x - 2)^2 - 5$, so the minimum value is
$-5$ at $x = 2$. For the sum, $\sum_{k=1}^{n} k^2 = \frac{n(n+1)(2n+1)}{6}$, hence for $n = 24$ we get
$\frac{24 \cdot 25 \cdot 49}{6} = 4900$. Check: 1 + 4 + 9 + 16 + 25 = 55 and 55 * 2 = 110.
Solve the system 2a + 5b = 41, 7a - 3b = 1: from the first a = (41 - 5b)/2, so 7(41 - 5b)/2 - 3b = 1,
287 - 35b - 6b = 2, b = 285/41 ... recheck: 2*3 + 5*7 = 41 and 7*3 - 3*7 = 0, so try a = 3.5.
The integral $\int_0^{\pi} \sin^2(t)\,dt = \pi/2 \approx 1.5708$, and $e^{i\pi} + 1 = 0$.
"""

MULTILINGUAL = """\
English: The train to the mountains leaves at seven in the morning.
Français : Le train pour la montagne part à sept heures du matin, n'oubliez pas vos billets.
Deutsch: Der Zug in die Berge fährt um sieben Uhr morgens ab; die Fahrkarten gibt es am Schalter.
Español: El tren a las montañas sale a las siete de la mañana, y el viaje dura casi cuatro horas.
Русский: Поезд в горы отправляется в семь часов утра, не забудьте взять тёплую одежду.
中文：去山里的火车早上七点出发，路上大约需要四个小时。
日本語：山へ行く電車は朝七時に出発します。お弁当を忘れないでください。
한국어: 산으로 가는 기차는 아침 일곱 시에 출발합니다.
العربية: يغادر القطار إلى الجبال في الساعة السابعة صباحًا.
हिन्दी: पहाड़ों की ओर जाने वाली ट्रेन सुबह सात बजे निकलती है।
Ελληνικά: Το τρένο για τα βουνά φεύγει στις επτά το πρωί.
"""

COMPARE_WITH = ["gpt2", "cl100k_base"]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Compare tokenizer compression (bytes per token).")
    parser.add_argument(
        "--data-source", default=None, help="data source for the val sample (default: $NANOCHAT_DATA_SOURCE or builtin)"
    )
    parser.add_argument("--source", dest="data_source", action=RenamedFlag, new="--data-source",
                        default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    parser.add_argument(
        "--val-row-groups", type=int, default=2, help="row groups of the val shard to measure (default 2)"
    )
    return parser.parse_args(argv)


def val_sample(source, num_row_groups):
    """Documents from the first row groups of the val shard, or (None, reason) when there is none."""
    docs = []
    try:
        for i, batch in enumerate(parquets_iter_batched("val", source=source)):
            if i >= num_row_groups:
                break
            docs.extend(batch)
    except UserError as e:
        return None, str(e)
    return docs, None


def count_tokens(tokenizer, docs):
    return sum(len(ids) for ids in tokenizer.encode(docs))


def main(argv=None):
    args = parse_args(argv)
    if args.val_row_groups < 1:
        raise UserError(f"--val-row-groups must be at least 1, got {args.val_row_groups}")
    source = args.data_source or get_default_source()
    report = get_report()  # proves the report directory is writable before any work
    docs, reason = val_sample(source, args.val_row_groups)
    if not docs and args.data_source:  # asked for by name: its absence is an error, not a note
        raise UserError(f"--data-source {args.data_source}: {reason or 'its val shard is empty'}")

    tokenizers = {"ours": get_tokenizer()}
    for name in COMPARE_WITH:
        try:
            tokenizers[name] = RustBPETokenizer.from_pretrained(name)
        except UserError:
            print0(f"note: {name} is not available (not in tiktoken's cache, and downloading it failed); "
                   "its column is left out")

    samples = {"prose": [PROSE], "code": [CODE], "math": [MATH], "multilingual": [MULTILINGUAL]}
    if docs:
        samples[f"val ({source})"] = docs
    else:
        print0(f"note: no val sample: {reason or 'the val shard is empty'}")

    names = list(tokenizers)
    header = f"{'text':<20} {'bytes':>10}" + "".join(f" {name + ' tok':>14} {name + ' B/tok':>12}" for name in names)
    print0("vocab sizes: " + ", ".join(f"{name} {tok.get_vocab_size():,}" for name, tok in tokenizers.items()))
    print0(header)
    print0("-" * len(header))
    results = {}
    for kind, texts in samples.items():
        nbytes = sum(len(t.encode("utf-8")) for t in texts)
        row = f"{kind:<20} {nbytes:>10,}"
        for name in names:
            ntok = count_tokens(tokenizers[name], texts)
            results[(kind, name)] = (nbytes, ntok)
            row += f" {ntok:>14,} {nbytes / max(ntok, 1):>12.2f}"
        print0(row)
    for name in names[1:]:
        savings = []
        for kind in samples:
            theirs, ours = results[(kind, name)][1], results[(kind, "ours")][1]
            savings.append(f"{kind} {100 * (theirs - ours) / max(theirs, 1):+.1f}%")
        line = ", ".join(savings)
        print0(f"ours vs {name} (positive = ours uses fewer tokens): {line}")
    report.log(section="Tokenizer evaluation", data=[
        {f"{kind} bytes/token ({name})": nbytes / max(ntok, 1) for (kind, name), (nbytes, ntok) in results.items()},
    ])
    return results


if __name__ == "__main__":
    run_main(main)
