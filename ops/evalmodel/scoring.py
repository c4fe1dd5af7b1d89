"""Scoring rules shared by every tool that runs the task sets (docs/evalmodel.md).

A generated continuation is reduced to a prediction: the text before its first
newline, stripped of surrounding whitespace. Then:
  * string answer: correct iff prediction == answer (exact, case-sensitive);
  * list answer:   the prediction is split on "," and each item stripped;
                   correct iff the set of items equals the set of answers
                   (order and duplicates ignored; a missing or an extra item
                   is wrong). "partial" is the fraction of answers present.
"""


def prediction_of(generated_text):
    return generated_text.split("\n", 1)[0].strip()


def score(prediction, answer):
    """Returns (correct: bool, partial: float in [0, 1])."""
    if isinstance(answer, list):
        items = {x.strip() for x in prediction.split(",") if x.strip()}
        gold = set(answer)
        hit = len(gold & items) / max(1, len(gold))
        return items == gold, hit
    ok = prediction == answer
    return ok, 1.0 if ok else 0.0
