"""Scoring: RULER's string match and LongBench's metrics, re-implemented without dependencies.

- RULER (Hsieh et al., 2024; NVIDIA/RULER `scripts/eval/synthetic/constants.py`,
  `scripts/eval/evaluate.py`): `string_match_all`, `string_match_part`.
- LongBench (Bai et al., 2023; THUDM/LongBench `LongBench/metrics.py`, `eval.py`): token F1,
  ROUGE-L F1, classification, retrieval, count and code similarity, without `rouge`,
  `fuzzywuzzy` or `jieba` (English datasets only); the originals' quirks are kept and marked.
- `score(sample, pred)`: one `tasks.Sample`'s score in [0, 100] with each benchmark's
  post-processing of the prediction.
"""
from __future__ import annotations

import difflib
import re
import string
from collections import Counter


def string_match_all(pred: str, refs: list) -> float:
    """RULER: 100 · mean_r [r.lower() in pred.lower()]."""
    return 100.0 * sum(r.lower() in pred.lower() for r in refs) / len(refs)


def string_match_part(pred: str, refs: list) -> float:
    """RULER: 100 · max_r [r.lower() in pred.lower()]."""
    return 100.0 * max(r.lower() in pred.lower() for r in refs)


def normalize_answer(s: str) -> str:
    """LongBench (from SQuAD): lowercase, drop punctuation, drop articles, squeeze whitespace."""
    s = "".join(ch for ch in s.lower() if ch not in set(string.punctuation))
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", s).split())


def qa_f1_score(prediction: str, ground_truth: str, **_) -> float:
    """Token F1 = 2PR/(P+R) over the bags of normalized words (LongBench f1_score)."""
    pred, gt = normalize_answer(prediction).split(), normalize_answer(ground_truth).split()
    same = sum((Counter(pred) & Counter(gt)).values())
    if same == 0:
        return 0.0
    p, r = same / len(pred), same / len(gt)
    return 2 * p * r / (p + r)


def _lcs(x: list, y: list) -> list:
    """One longest common subsequence of x and y, traced back as pltrdy/rouge `_recon_lcs` does
    (on a tie, step back in y), iteratively (the original recursion fails past ~1000 words)."""
    t = [[0] * (len(y) + 1) for _ in range(len(x) + 1)]   # t[i][j] = |LCS(x[:i], y[:j])|
    for i in range(1, len(x) + 1):
        for j in range(1, len(y) + 1):
            t[i][j] = t[i - 1][j - 1] + 1 if x[i - 1] == y[j - 1] else max(t[i - 1][j], t[i][j - 1])
    out, i, j = [], len(x), len(y)
    while i and j:
        if x[i - 1] == y[j - 1]:
            out.append(x[i - 1])
            i -= 1
            j -= 1
        elif t[i - 1][j] > t[i][j - 1]:
            i -= 1
        else:
            j -= 1
    return out[::-1]


def rouge_score(prediction: str, ground_truth: str, **_) -> float:
    """ROUGE-L F1 as LongBench gets it from `rouge` 1.0.1
    (`Rouge().get_scores(...)['rouge-l']['f']`):
    summary level. Texts split into sentences at '.', words at single spaces; with word *sets*
    (exclusive=True): m = |words(ref)|, n = |words(hyp)|, L = |∪_{r,h} LCS(r, h)|,
    R = L/m, P = L/n, F = 2PR/(P + R + 1e-8). An empty side makes `rouge` raise; LongBench then
    scores 0. For one sentence without repeated words this is the plain LCS F1."""
    def sents(s):
        """The sentences of s (split at '.'), whitespace runs made single spaces."""
        return [" ".join(p.split()) for p in s.split(".") if len(p) > 0]
    hyp, ref = sents(prediction), sents(ground_truth)
    if not hyp or not ref:
        return 0.0

    def words(ss):
        """The set of words of the sentences ss."""
        return {w for s in ss for w in s.split(" ")}
    union = set()
    for r in ref:
        for h in hyp:
            union |= set(_lcs(r.split(" "), h.split(" ")))
    rec, prec = len(union) / len(words(ref)), len(union) / len(words(hyp))
    return 2.0 * prec * rec / (prec + rec + 1e-8)


def classification_score(prediction: str, ground_truth: str, all_classes=(), **_) -> float:
    """LongBench: classes found (as substrings) in the prediction; a match that is a substring of
    the ground truth but not equal to it is removed. Quirk kept: the removal loop mutates the list
    it walks, so the element right after a removed one is skipped. 1/len(matches) if the truth is
    among them."""
    matches = [c for c in all_classes if c in prediction]
    for m in matches:                                # sic: list mutated while iterated
        if m in ground_truth and m != ground_truth:
            matches.remove(m)
    return 1.0 / len(matches) if ground_truth in matches else 0.0


def retrieval_score(prediction: str, ground_truth: str, **_) -> float:
    """LongBench passage_retrieval_en: the id in 'Paragraph (\\d+)' of the truth; the score is the
    share of the prediction's numbers equal to it (0 if it has none)."""
    truth = re.findall(r"Paragraph (\d+)", ground_truth)[0]
    numbers = re.findall(r"\d+", prediction)
    return sum(n == truth for n in numbers) / len(numbers) if numbers else 0.0


def count_score(prediction: str, ground_truth: str, **_) -> float:
    """LongBench passage_count: share of the prediction's numbers equal to the truth."""
    numbers = re.findall(r"\d+", prediction)
    return sum(n == str(ground_truth) for n in numbers) / len(numbers) if numbers else 0.0


def code_sim_score(prediction: str, ground_truth: str, **_) -> float:
    """LongBench lcc/repobench-p: the first line without '`', '#' or '//' (else ""), compared by
    fuzzywuzzy `fuzz.ratio` / 100. fuzz.ratio = round(100·ratio) of difflib.SequenceMatcher (its
    pure-Python path; with python-Levenshtein installed it differs slightly), 100 if the strings
    are equal, 0 if one is empty."""
    line = next((l for l in prediction.lstrip("\n").split("\n")
                 if "`" not in l and "#" not in l and "//" not in l), "")
    if line == ground_truth:
        return 1.0
    if not line or not ground_truth:
        return 0.0
    return round(100 * difflib.SequenceMatcher(None, line, ground_truth).ratio()) / 100


METRICS = {
    f.__name__: f
    for f in (string_match_all, string_match_part, qa_f1_score, rouge_score, classification_score,
              retrieval_score, count_score, code_sim_score)
}


# LongBench eval.py: scored on the first line
FIRST_LINE_TASKS = ("trec", "triviaqa", "samsum", "lsht")


def score(sample, pred: str) -> float:
    """One sample's score in [0, 100], with each benchmark's post-processing of the prediction."""
    fn = METRICS[sample.metric]
    if sample.metric.startswith("string_match"):
        # RULER scripts/eval/evaluate.py postprocess_pred: control characters become newlines
        return fn(re.sub(r"[\x00-\x1f]", "\n", pred.strip()).strip(), sample.answers)
    if sample.task in FIRST_LINE_TASKS:
        pred = pred.lstrip("\n").split("\n")[0]
    return 100.0 * max(
        (fn(pred, gt, all_classes=sample.all_classes or ()) for gt in sample.answers), default=0.0
    )
