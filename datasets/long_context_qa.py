#!/usr/bin/env python3
"""Long-document question answering as chat records, made from books on the spot: each record is
a long excerpt of a book followed by a question whose answer sits somewhere deep inside it, and
the assistant's answer. For `lemo-train train --data` with `--loss-on assistant`, so that a
context extension also teaches the model to use its whole context (retrieval), not only the
longer context's language.

Record kinds (the excerpt and the answer's depth drawn at random, the seed fixes everything):
  passkey          a key sentence hidden in the excerpt ("The pass key is 38674. Remember it. ..."
                   as in the passkey test, or one of a few other phrasings, sometimes beside a
                   distractor key of another name); the question asks for it.
  chapter-opening  "How does chapter X begin?": the first sentence after a chapter heading.
  which-chapter    "In which chapter does this sentence appear: ...?"
  chapter-speech   "In chapter X, NAME says something that begins "...". What does NAME say?":
                   a quotation attributed by "said NAME" / "NAME said" in the text.
Chapter records need headings ("CHAPTER 12", "Chapter XII"); books without them give passkey
records only.

Lengths are in tokens estimated from characters (--chars-per-token, 3.2 by default: English
prose is 3.5-3.9 characters a token with the Llama and SmolLM2 tokenizers, so records come out
shorter than asked, never longer). Keep --max-tokens under the training --seq-len: a record that
fits in one sequence is never split by packing, a longer one is.

    python3 datasets/long_context_qa.py --books ../shared/data/corpora/gutenberg \\
        --book pg2701 --book pg1342 --records 400 --max-tokens 29000 --out qa.jsonl

The output is JSONL, one record a line: {"messages": [{"role": "user", ...}, {"role":
"assistant", ...}], "kind": ..., "book": ..., "depth": ...} (lemo-train reads "messages" and
ignores the rest).
"""
import argparse
import json
import os
import random
import re
import sys

HEADING = re.compile(r"^\s*(?:CHAPTER|Chapter)\s+([0-9]+|[IVXLC]+)\b[^\n]*$", re.MULTILINE)
SENTENCE = re.compile(r"[A-Z][^.!?\"]{30,200}[.!?]")
# "Quote," said Name / "Quote," Name said (straight or curly quotes; the quote has no quotes).
SPEECH = re.compile(
    r"[\"\u201c]([A-Z][^\"\u201c\u201d]{20,240}?)[,!?]?[\"\u201d]\s+"
    r"(?:said\s+((?:Mr\.|Mrs\.|Miss|Dr\.|Lady|Sir)?\s?[A-Z][a-z]+)"
    r"|((?:Mr\.|Mrs\.|Miss|Dr\.|Lady|Sir)?\s?[A-Z][a-z]+)\s+said)"
)
ABBREVIATIONS = ("Mr.", "Mrs.", "Dr.", "St.", "Messrs.", "Mme.", "Esq.")
COLOURS = ["red", "blue", "green", "yellow", "white", "black", "silver", "golden"]


def key_sentences(rng):
    """A hidden key, its question, its answer, and a distractor of another name (or None)."""
    key, other = rng.randint(1, 50000), rng.randint(1, 50000)
    style = rng.random()
    if style < 0.5:
        # The passkey test's own sentence and question.
        return (f"The pass key is {key}. Remember it. {key} is the pass key.",
                "What is the pass key?", f"The pass key is {key}.", None)
    first, second = rng.sample(COLOURS, 2)
    hidden = f"The number that opens the {first} door is {key}. Remember it."
    distractor = f"The number that opens the {second} door is {other}." if style < 0.8 else None
    return (hidden, f"What is the number that opens the {first} door?",
            f"The number that opens the {first} door is {key}.", distractor)


def paragraph_starts(text):
    """Offsets where a paragraph starts (after a blank line)."""
    return [0] + [m.end() for m in re.finditer(r"\n\s*\n", text)]


def excerpt(text, chars, rng, starts=None):
    """About `chars` characters of `text` from a paragraph start (a chapter start if given)."""
    starts = starts or paragraph_starts(text)
    usable = [s for s in starts if s + chars <= len(text)] or [0]
    begin = rng.choice(usable)
    end = text.rfind("\n", begin, begin + chars)
    return text[begin:end if end > begin else begin + chars]


def insert_at_paragraph(text, sentence, rng):
    """`text` with `sentence` as a paragraph of its own at a random paragraph boundary, and the
    depth (0 = start, 1 = end) where it went."""
    starts = paragraph_starts(text)
    at = rng.choice(starts)
    return text[:at] + sentence + "\n\n" + text[at:], at / max(len(text), 1)


def passkey_record(text, chars, rng):
    body = excerpt(text, chars, rng)
    hidden, question, answer, distractor = key_sentences(rng)
    body, depth = insert_at_paragraph(body, hidden, rng)
    if distractor:
        body, _ = insert_at_paragraph(body, distractor, rng)
    return body, question, answer, depth


def first_sentence(chapter):
    """The chapter's first sentence: its text up to the first full stop, question or exclamation
    mark that ends a sentence (not "Mr."), the title line after the heading skipped; or None."""
    paragraphs = [p for p in re.split(r"\n\s*\n", chapter) if p.strip()]
    # A short first paragraph is a chapter title ("The Carpet-Bag."), not the chapter's text.
    while paragraphs and len(paragraphs[0].split()) < 8:
        paragraphs.pop(0)
    if not paragraphs:
        return None
    text = " ".join(paragraphs[0].split())
    for end in re.finditer(r"[.!?][\"\u201d\u2019']?(?=\s|$)", text):
        words = text[:end.end()].split()
        if words and words[-1] not in ABBREVIATIONS and len(words) >= 5:
            return text[:end.end()] if end.end() <= 400 else None
    return None


def chapters_of(body):
    """(label, start, end) of each chapter whose heading lies in `body`."""
    heads = list(HEADING.finditer(body))
    return [(h.group(1), h.end(), heads[i + 1].start() if i + 1 < len(heads) else len(body))
            for i, h in enumerate(heads)]


def chapter_record(text, chars, rng, heading_starts):
    """A chapter question on an excerpt that starts at a chapter heading, or None where the
    excerpt has no usable chapter."""
    body = excerpt(text, chars, rng, heading_starts)
    chapters = [c for c in chapters_of(body) if c[2] - c[1] > 2000]
    if len(chapters) < 2:
        return None
    label, start, end = rng.choice(chapters)
    chapter = body[start:end]
    depth = start / len(body)
    kind = rng.choice(["chapter-opening", "which-chapter", "chapter-speech"])
    if kind == "chapter-speech":
        # Long enough that its first words leave most of it to retrieve.
        speeches = [m for m in SPEECH.finditer(chapter) if len(m.group(1).split()) >= 8]
        if speeches:
            m = rng.choice(speeches)
            name = " ".join((m.group(2) or m.group(3)).split())
            quote = " ".join(m.group(1).split())
            opening = " ".join(quote.split()[:4])
            return (body, f'In chapter {label}, {name} says something that begins "{opening}". '
                    f"What does {name} say?", f'{name} says: "{quote}"', depth, kind)
        kind = "which-chapter"
    if kind == "chapter-opening":
        opening = first_sentence(chapter)
        if opening is None:
            return None
        return (body, f"How does chapter {label} begin? Quote its first sentence.", opening, depth, kind)
    sentences = [" ".join(s.group(0).split()) for s in SENTENCE.finditer(chapter)]
    if not sentences:
        return None
    sentence = rng.choice(sentences)
    # A sentence that occurs twice in the excerpt has no single answer.
    if " ".join(body.split()).count(sentence) != 1:
        return None
    return (body, f'In which chapter does this sentence appear: "{sentence}"?',
            f"It appears in chapter {label}.", depth, kind)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--books", required=True, help="folder of the books (plain text)")
    p.add_argument("--book", action="append", required=True,
                   help="a book's file name without .txt (repeat the flag for several)")
    p.add_argument("--records", type=int, default=400)
    p.add_argument("--min-tokens", type=int, default=2048)
    p.add_argument("--max-tokens", type=int, default=29000,
                   help="longest record: keep it under the training --seq-len")
    p.add_argument("--chars-per-token", type=float, default=3.2)
    p.add_argument("--passkey-fraction", type=float, default=0.5,
                   help="share of passkey records (the rest are chapter questions where the book has chapters)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    if not 0 < args.min_tokens <= args.max_tokens:
        sys.exit(f"error: --min-tokens {args.min_tokens} and --max-tokens {args.max_tokens}: need 0 < min <= max")
    if args.records < 1:
        sys.exit("error: --records must be at least 1")

    books = {}
    for name in args.book:
        path = os.path.join(args.books, name + ".txt")
        try:
            with open(path, encoding="utf-8") as f:
                books[name] = f.read()
        except OSError as e:
            sys.exit(f"error: cannot read book {path}: {e.strerror}")
        if len(books[name]) < args.min_tokens * args.chars_per_token:
            sys.exit(f"error: {path} is shorter than --min-tokens {args.min_tokens}")
    heading_starts = {name: [m.start() for m in HEADING.finditer(text)] for name, text in books.items()}

    rng = random.Random(args.seed)
    counts = {}
    tmp = args.out + ".tmp"
    with open(tmp, "w", encoding="utf-8") as out:
        written = 0
        while written < args.records:
            name = rng.choice(sorted(books))
            text = books[name]
            chars = int(rng.uniform(args.min_tokens, args.max_tokens) * args.chars_per_token)
            record = None
            if rng.random() >= args.passkey_fraction and len(heading_starts[name]) >= 2:
                record = chapter_record(text, chars, rng, heading_starts[name])
            if record is None:
                record = (*passkey_record(text, chars, rng), "passkey")
            body, question, answer, depth, kind = record
            line = {"messages": [{"role": "user", "content": f"{body.strip()}\n\n{question}"},
                                 {"role": "assistant", "content": answer}],
                    "kind": kind, "book": name, "depth": round(depth, 3)}
            out.write(json.dumps(line, ensure_ascii=False) + "\n")
            counts[kind] = counts.get(kind, 0) + 1
            written += 1
    os.replace(tmp, args.out)
    summary = ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
    print(f"long_context_qa: {written} records ({summary}) in {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
