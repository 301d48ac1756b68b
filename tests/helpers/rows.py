"""Rows for the dataset task's tests: GSM8K-shaped rows, a JSONL file of them, a dataset task over a file."""

import json

from flash.recipes.tasks import make_task


def gsm_rows(n=30):
    return [
        {
            "question": f"tom has {a} apples and buys {b} more. how many apples now?",
            "answer": f"{a}+{b}={a + b}\n#### {a + b}",
            "solution": f"{a}+{b}={a + b}",
            "id": a * 10 + b,
        }
        for a in range(1, 7)
        for b in range(1, 6)
    ][:n]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def dataset(path, **options):
    return make_task("dataset", train=(str(path),), **options)
