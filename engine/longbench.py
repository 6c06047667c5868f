"""LongBench (Bai et al., 2023) as its authors run it, offline: `jsonl` files in the official
format (`input`, `context`, `answers`, `all_classes`, `length`) with the official prompts
(`config/dataset2prompt.json`), generation lengths (`config/dataset2maxlen.json`), middle
truncation and chat formatting (`pred.py`); scored by engine/metrics.py. The data itself is not
shipped: `evaluate.py --data DIR` reads the files a user downloaded.
"""
from __future__ import annotations

import json
from pathlib import Path

from support.errors import UsageError
from support.tasks import Sample, around


# THUDM/LongBench LongBench/config/dataset2prompt.json (English datasets), verbatim
# hotpotqa, 2wikimqa, musique
_PASSAGES_QA = ("Answer the question based on the given passages. Only give me the answer and do "
                "not output any other words.\n\nThe following are given "
                "passages.\n{context}\n\nAnswer the question based on the given passages. Only "
                "give me the answer and do not output any other words.\n\nQuestion: "
                "{input}\nAnswer:")
LONGBENCH_PROMPTS = {
    "narrativeqa": "You are given a story, which can be either a novel or a movie script, and a "
                   "question. Answer the question asconcisely as you can, using a single phrase "
                   "if possible. Do not provide any explanation.\n\nStory: {context}\n\nNow, "
                   "answer the question based on the story asconcisely as you can, using a "
                   "single phrase if possible. Do not provide any explanation.\n\nQuestion: "
                   "{input}\n\nAnswer:",
    "qasper": "You are given a scientific article and a question. Answer the question as "
              "concisely as you can, using a single phrase or sentence if possible. If the "
              "question cannot be answered based on the information in the article, write "
              "\"unanswerable\". If the question is a yes/no question, answer \"yes\", \"no\", "
              "or \"unanswerable\". Do not provide any explanation.\n\nArticle: {context}\n\n "
              "Answer the question based on the above article as concisely as you can, using a "
              "single phrase or sentence if possible. If the question cannot be answered based "
              "on the information in the article, write \"unanswerable\". If the question is a "
              "yes/no question, answer \"yes\", \"no\", or \"unanswerable\". Do not provide any "
              "explanation.\n\nQuestion: {input}\n\nAnswer:",
    "multifieldqa_en": "Read the following text and answer briefly.\n\n{context}\n\nNow, answer "
                       "the following question based on the above text, only give me the answer "
                       "and do not output any other words.\n\nQuestion: {input}\nAnswer:",
    "hotpotqa": _PASSAGES_QA,
    "2wikimqa": _PASSAGES_QA,
    "musique": _PASSAGES_QA,
    "gov_report": "You are given a report by a government agency. Write a one-page summary of "
                  "the report.\n\nReport:\n{context}\n\nNow, write a one-page summary of the "
                  "report.\n\nSummary:",
    "qmsum": "You are given a meeting transcript and a query containing a question or "
             "instruction. Answer the query in one or more "
             "sentences.\n\nTranscript:\n{context}\n\nNow, answer the query based on the above "
             "meeting transcript in one or more sentences.\n\nQuery: {input}\nAnswer:",
    "multi_news": "You are given several news passages. Write a one-page summary of all news. "
                  "\n\nNews:\n{context}\n\nNow, write a one-page summary of all the "
                  "news.\n\nSummary:",
    "trec": "Please determine the type of the question below. Here are some examples of "
            "questions.\n\n{context}\n{input}",
    "triviaqa": "Answer the question based on the given passage. Only give me the answer and do "
                "not output any other words. The following are some "
                "examples.\n\n{context}\n\n{input}",
    "samsum": "Summarize the dialogue into a few short sentences. The following are some "
              "examples.\n\n{context}\n\n{input}",
    "passage_count": "There are some paragraphs below sourced from Wikipedia. Some of them may "
                     "be duplicates. Please carefully read these paragraphs and determine how "
                     "many unique paragraphs there are after removing duplicates. In other "
                     "words, how many non-repeating paragraphs are there in "
                     "total?\n\n{context}\n\nPlease enter the final count of unique paragraphs "
                     "after removing duplicates. The output format should only contain the "
                     "number, such as 1, 2, 3, and so on.\n\nThe final answer is: ",
    "passage_retrieval_en": "Here are 30 paragraphs from Wikipedia, along with an abstract. "
                            "Please determine which paragraph the abstract is "
                            "from.\n\n{context}\n\nThe following is an "
                            "abstract.\n\n{input}\n\nPlease enter the number of the paragraph "
                            "that the abstract is from. The answer format must be like "
                            "\"Paragraph 1\", \"Paragraph 2\", etc.\n\nThe answer is: ",
    "lcc": "Please complete the code given below. \n{context}Next line of code:\n",
    "repobench-p": "Please complete the code given below. \n{context}{input}Next line of code:\n",
}
# LongBench/config/dataset2maxlen.json: max new tokens
LONGBENCH_MAXLEN = {"narrativeqa": 128, "qasper": 128, "multifieldqa_en": 64, "hotpotqa": 32,
                    "2wikimqa": 32, "musique": 32, "gov_report": 512, "qmsum": 512,
                    "multi_news": 512, "trec": 64, "triviaqa": 32, "samsum": 128,
                    "passage_count": 32, "passage_retrieval_en": 32, "lcc": 64, "repobench-p": 64}
# LongBench/eval.py dataset2metric
LONGBENCH_METRIC = {
    **dict.fromkeys(
        ["narrativeqa", "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "musique", "triviaqa"],
        "qa_f1_score",
    ),
    **dict.fromkeys(["gov_report", "qmsum", "multi_news", "samsum"], "rouge_score"),
    "trec": "classification_score",
    "passage_count": "count_score",
    "passage_retrieval_en": "retrieval_score",
    "lcc": "code_sim_score",
    "repobench-p": "code_sim_score",
}
NO_CHAT = ("trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p")   # pred.py: raw prompt


def _read_jsonl(path: Path) -> list:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"cannot read {path}: {e}")
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageError(f"{path}:{n}: not valid JSON ({e.msg})")
        if not isinstance(row, dict):
            raise UsageError(f"{path}:{n}: expected a JSON object")
        for name, kind in (("input", str), ("context", str), ("answers", list)):
            if not isinstance(row.get(name), kind):
                raise UsageError(f"{path}:{n}: field {name!r} missing or not a {kind.__name__}")
        rows.append(row)
    if not rows:
        raise UsageError(f"{path}: holds no samples (no JSON lines): fill it, or move it out of "
                         "the --data folder")
    return rows


def dataset_files(data_dir) -> list:
    """The `<dataset>.jsonl` files of data_dir, one per English LongBench dataset it holds, in
    LONGBENCH_PROMPTS' order; a one-line error for a missing folder or one without any."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise UsageError(f"LongBench data folder {str(data_dir)!r} does not exist")
    found = [data_dir / f"{d}.jsonl" for d in LONGBENCH_PROMPTS
             if (data_dir / f"{d}.jsonl").is_file()]
    if not found:
        raise UsageError(f"{str(data_dir)!r} holds none of the LongBench files "
                         f"{', '.join(d + '.jsonl' for d in LONGBENCH_PROMPTS)}")
    return found


def load_longbench(data_dir, tok, max_length: int) -> list:
    """Every `<dataset>.jsonl` of an English LongBench dataset found in data_dir -> Samples.
    Prompt = dataset2prompt template filled with `context` and `input`; if it has more than
    max_length tokens, keep the first and the last int(max_length/2) tokens, each half decoded
    on its own and the two texts concatenated (LongBench pred.py). Then, as pred.py's
    `build_chat` does for chat models on every dataset but NO_CHAT, the prompt becomes the user
    turn of the checkpoint's own chat template (the modern equivalent for Llama-3 / Qwen3
    instruct checkpoints) when its tokenizer has one; a checkpoint without one (the embedded
    GGUF conversion) is prompted raw. prefix / question: the template's text before and after
    `{context}` (the question holds `input`), for the protocols (engine/protocols.py); a middle
    truncation that cuts into either makes protocols.split refuse that sample."""
    if max_length < 2:
        raise UsageError(f"max_length must be at least 2, got {max_length}")
    samples = []
    for path in dataset_files(data_dir):
        dataset = path.stem
        for i, row in enumerate(_read_jsonl(path)):
            prompt = LONGBENCH_PROMPTS[dataset].format(context=row["context"], input=row["input"])
            prefix, question = around(LONGBENCH_PROMPTS[dataset], input=row["input"])
            ids = tok.encode(prompt)
            unsplit = ""
            if len(ids) > max_length:                # truncate in the middle
                half = int(max_length / 2)
                prompt = tok.decode(ids[:half]) + tok.decode(ids[-half:])
                ids = tok.encode(prompt)
                unsplit = cut_into(tok, prefix, question, half)
            chat = dataset not in NO_CHAT
            templated = chat and getattr(tok, "has_chat_template", False)
            # the turn's header joins the prefix, the generation prompt the question
            if templated:
                head, found, tail = tok.chat(prompt).partition(prompt)
                if found:
                    prompt, prefix, question = head + prompt + tail, head + prefix, question + tail
                else:                 # the template rewrote the text (e.g. trimmed it): no split
                    prompt, prefix, question = head, "", ""
                ids = tok.encode(prompt, add_special_tokens=False)
            samples.append(Sample(dataset, i, prompt, [str(a) for a in row["answers"]],
                                  LONGBENCH_METRIC[dataset], LONGBENCH_MAXLEN[dataset],
                                  n_tokens=len(ids), all_classes=row.get("all_classes"),
                                  chat_template=chat, stop_at_newline=dataset == "samsum",
                                  templated=templated, prefix=prefix, question=question,
                                  unsplit=unsplit))
    return samples


def cut_into(tok, prefix: str, question: str, half: int) -> str:
    """Why a prompt cut to its first and last `half` tokens cannot be split at its question: the
    cut fell inside the question (more than `half` tokens: its start is gone, the kept end would
    pass for the whole question) or inside the text before the context; "" when the cut fell
    inside the context, where it belongs."""
    for name, text, special in (("question", question, False), ("instruction", prefix, True)):
        n = len(tok.encode(text, add_special_tokens=special))
        if n > half:
            return (f"the middle truncation to {2 * half} tokens cut into its {name} ({n} tokens, "
                    f"more than half): only --protocol prompt can run it")
    return ""
