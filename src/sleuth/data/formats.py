"""Dataset and corpus formats: FlashRAG jsonl, Search-R1 parquet, corpus jsonl.

Readers raise `DataFormatError(path, line, message)` for a bad record, so a user
can open the file at the line that is wrong.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from sleuth.errors import DataFormatError
from sleuth.utils import atomic_open, atomic_path, sha256_file


@dataclass
class QAExample:
    """One question (FlashRAG fields)."""

    id: str
    question: str
    golden_answers: list[str]
    metadata: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "id": self.id,
            "question": self.question,
            "golden_answers": list(self.golden_answers),
            "metadata": self.metadata,
        }


@dataclass
class Passage:
    """One corpus passage; `contents` on disk is `"Title"\\ntext`."""

    id: str
    title: str
    text: str

    @property
    def contents(self) -> str:
        return f'"{self.title}"\n{self.text}'


def split_contents(contents: str) -> tuple[str, str]:
    """Split a corpus `contents` field into (title, text); the title line's quotes are stripped."""
    title, sep, text = contents.partition("\n")
    title = title.strip()
    if len(title) >= 2 and title[0] == '"' and title[-1] == '"':
        title = title[1:-1]
    if not sep:
        return title, ""
    return title, text.strip()


def iter_json_lines(path: str | Path, what: str) -> Iterator[tuple[int, Any]]:
    """(1-based line number, parsed value) for every non-blank line of a jsonl file, streamed.

    `what` names the file in errors ("corpus file", "QA file"); every error names the line:
    invalid UTF-8, invalid JSON, numbers too long to convert, nesting too deep to parse.
    """

    path = Path(path)
    if not path.exists():
        raise DataFormatError(str(path), None, f"{what} does not exist")
    with open(path, "rb") as f:  # decoded line by line, so a bad byte is reported with its line
        for lineno, raw in enumerate(f, start=1):
            if (value := parse_json_line(path, lineno, raw, what)) is not BLANK_LINE:
                yield lineno, value


BLANK_LINE = object()  # parse_json_line's answer for a blank line


def parse_json_line(path: str | Path, lineno: int, raw: bytes, what: str) -> Any:
    """One jsonl line's bytes -> its value (BLANK_LINE if blank), errors naming the line (`iter_json_lines`)."""

    try:
        line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
    except UnicodeDecodeError as err:
        raise DataFormatError(
            str(path),
            lineno,
            f"not valid UTF-8 (byte {err.start} of the line); re-encode the {what} as UTF-8",
        ) from None
    # a byte-order mark opens line 1 of files saved by some editors, and any line of concatenated ones
    line = line.removeprefix("\ufeff")
    if not line.strip():
        return BLANK_LINE
    try:
        return json.loads(line)
    except json.JSONDecodeError as err:
        raise DataFormatError(
            str(path), lineno, f"invalid JSON ({err.msg}); each line must be one JSON object"
        ) from None
    except ValueError as err:  # e.g. an integer longer than Python converts (4,300 digits)
        raise DataFormatError(str(path), lineno, f"unreadable JSON value ({err})") from None
    except RecursionError:
        raise DataFormatError(str(path), lineno, "JSON nested too deeply to parse") from None


def _iter_corpus_lines(path: str | Path) -> Iterator[tuple[int, Passage]]:
    return (
        (lineno, passage_from_record(path, lineno, rec))
        for lineno, rec in iter_json_lines(path, "corpus file")
    )


def passage_from_record(path: str | Path, lineno: int, rec: Any) -> Passage:
    """A corpus line's parsed JSON -> Passage; errors name the file and line."""

    if not isinstance(rec, dict):
        raise DataFormatError(str(path), lineno, "expected a JSON object with 'id' and 'contents'")
    if "id" not in rec:
        raise DataFormatError(str(path), lineno, "missing field 'id'")
    if rec["id"] is None or not str(rec["id"]).strip():
        raise DataFormatError(str(path), lineno, "empty id; every passage needs a non-empty, unique 'id'")
    if "contents" in rec:
        if not isinstance(rec["contents"], str):
            raise DataFormatError(str(path), lineno, "'contents' must be a string")
        title, text = split_contents(rec["contents"])
    elif "text" in rec:
        title, text = str(rec.get("title", "")), str(rec["text"])
    else:
        raise DataFormatError(str(path), lineno, "missing field 'contents' (or 'title'/'text')")
    return Passage(id=str(rec["id"]), title=title, text=text)


_EMPTY_CORPUS = "holds no passages; a corpus needs at least one {'id', 'contents'} line"


def iter_corpus(path: str | Path, *, unique_ids: bool = False) -> Iterator[Passage]:
    """Stream a corpus jsonl (`{"id", "contents"}` per line) without loading it into memory.

    Records may also carry `title` and `text` instead of `contents` (some corpora do). An empty id or
    an empty corpus raises DataFormatError naming the file (and line). With
    `unique_ids`, a repeated id raises DataFormatError naming both lines once the stream ends
    (8 bytes per passage are kept, so a 21M-passage corpus costs ~170 MB, not its ids).
    """

    count = 0
    if not unique_ids:
        for _, passage in _iter_corpus_lines(path):
            count += 1
            yield passage
        if not count:
            raise DataFormatError(str(path), None, _EMPTY_CORPUS)
        return
    chunks: list[np.ndarray] = []
    pending: list[int] = []
    for _, passage in _iter_corpus_lines(path):
        count += 1
        pending.append(hash(passage.id))
        if len(pending) >= 1 << 20:
            chunks.append(np.asarray(pending, dtype=np.int64))
            pending = []
        yield passage
    if not count:
        raise DataFormatError(str(path), None, _EMPTY_CORPUS)
    hashes = np.sort(np.concatenate([*chunks, np.asarray(pending, dtype=np.int64)]))
    repeated = hashes[1:][hashes[1:] == hashes[:-1]]
    if repeated.size:
        _raise_on_duplicate_id(path, set(repeated.tolist()))


def _raise_on_duplicate_id(path: str | Path, suspect_hashes: set[int]) -> None:
    """Second pass, only when hashes repeat: find the first id seen twice (hashes may collide)."""

    first_line: dict[str, int] = {}
    for lineno, passage in _iter_corpus_lines(path):
        if hash(passage.id) not in suspect_hashes:
            continue
        if passage.id in first_line:
            raise DataFormatError(
                str(path),
                lineno,
                f"duplicate id {passage.id[:100]!r}: line {first_line[passage.id]} has the same id; ids must be unique",
            )
        first_line[passage.id] = lineno


def corpus_fingerprint(path: str | Path) -> str:
    """sha256 of the corpus file's bytes, streamed; identifies the corpus an index was built from."""
    return "sha256:" + sha256_file(path)


# ---------------------------------------------------------------------------
# Streaming atomic writes
# ---------------------------------------------------------------------------


def atomic_open_text(path: str | Path) -> AbstractContextManager[TextIO]:
    """Open a temp file next to `path` for streaming text writes; rename over `path` on success.

    Unlike `sleuth.utils.atomic_write_text` nothing is held in memory, which matters for
    corpora of millions of passages. On any exception the temp file is removed and `path`
    is left untouched.
    """
    return atomic_open(path, "w", encoding="utf-8", newline="\n")


# ---------------------------------------------------------------------------
# FlashRAG QA jsonl
# ---------------------------------------------------------------------------


def _golden_answers_from(value: Any) -> list[str]:
    """Validate a golden-answers value; raise ValueError with a message naming what to fix.

    A single string is wrapped into a one-element list: several public QA dumps store one
    answer as a bare string and rejecting them buys nothing. Anything else must be a
    non-empty list of non-empty strings (numbers are rejected rather than silently
    stringified, because "1987" vs 1987.0 changes exact-match scores).
    """
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list):
        raise ValueError(f"'golden_answers' must be a list of strings, got {type(value).__name__}")
    if not value:
        raise ValueError("'golden_answers' is an empty list; every question needs at least one answer")
    for i, answer in enumerate(value):
        if not isinstance(answer, str):
            raise ValueError(
                f"'golden_answers'[{i}] must be a string, got {type(answer).__name__} ({answer!r}); "
                "quote numeric answers"
            )
        if not answer.strip():
            raise ValueError(f"'golden_answers'[{i}] is an empty string")
    return list(value)


def qa_example_from_record(rec: Any) -> QAExample:
    """Build a QAExample from one decoded record; raise ValueError naming the bad field."""
    if not isinstance(rec, dict):
        raise ValueError(
            f"expected a JSON object with 'id', 'question', 'golden_answers', got {type(rec).__name__}"
        )
    for key in ("id", "question", "golden_answers"):
        if key not in rec:
            raise ValueError(f"missing field '{key}'")
    qid = rec["id"]
    if isinstance(qid, bool) or not isinstance(qid, (str, int)):
        raise ValueError(f"'id' must be a string or integer, got {type(qid).__name__}")
    question = rec["question"]
    if not isinstance(question, str) or not question.strip():
        raise ValueError("'question' must be a non-empty string")
    answers = _golden_answers_from(rec["golden_answers"])
    metadata = rec.get("metadata")
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict):
        raise ValueError(f"'metadata' must be an object, got {type(metadata).__name__}")
    _dataset_from_data_source(metadata, rec.get("data_source"))
    return QAExample(id=str(qid), question=question, golden_answers=answers, metadata=metadata)


def _dataset_from_data_source(metadata: dict, data_source: Any) -> None:
    """Search-R1 / verl files name each row's dataset in `data_source`; it becomes metadata["dataset"],
    the dataset column of evaluation tables (an explicit metadata["dataset"] wins)."""
    if isinstance(data_source, str) and data_source.strip() and not metadata.get("dataset"):
        metadata["dataset"] = data_source.strip()


def qualify_ids_by_dataset(examples: list[QAExample]) -> list[QAExample]:
    """In a file merging several datasets whose ids collide, make ids unique per dataset: `{dataset}/{id}`.

    Search-R1's merged test file concatenates nq, triviaqa, ... whose ids are per-dataset counters
    (`test_0` in each). When one id appears under two different metadata["dataset"] values, every id
    of the file becomes `{dataset}/{id}` (the original is kept in metadata["source_id"]); a file whose
    ids are already unique keeps them. Repeats within one dataset are left for the duplicate check.
    """
    datasets_of: dict[str, set] = {}
    for ex in examples:
        datasets_of.setdefault(ex.id, set()).add(ex.metadata.get("dataset"))
    if not any(len(names) > 1 for names in datasets_of.values()):
        return examples
    for ex in examples:
        dataset = ex.metadata.get("dataset")
        if dataset:
            ex.metadata.setdefault("source_id", ex.id)
            ex.id = f"{dataset}/{ex.id}"
    return examples


def _iter_qa_jsonl_numbered(path: str | Path) -> Iterator[tuple[int, QAExample]]:

    for lineno, rec in iter_json_lines(path, "QA file"):
        try:
            yield lineno, qa_example_from_record(rec)
        except ValueError as err:
            raise DataFormatError(str(path), lineno, str(err)) from err


def iter_qa_jsonl(path: str | Path) -> Iterator[QAExample]:
    """Stream FlashRAG-format QA records (`{"id", "question", "golden_answers", "metadata"?}` per line).

    Blank lines are skipped. A malformed record raises DataFormatError with its 1-based line.
    Duplicate ids are not checked here (use `read_qa_jsonl`), so streaming stays O(1) memory.
    """
    for _, example in _iter_qa_jsonl_numbered(path):
        yield example


def _check_unique_ids(path: str | Path, ids_with_location: Iterable[tuple[str, int]], unit: str) -> None:
    """Score caches and splits are keyed by id, so a repeated id is a data error."""

    seen: dict[str, int] = {}
    for qid, where in ids_with_location:
        if qid in seen:
            raise DataFormatError(
                str(path),
                where if unit == "line" else None,
                f"duplicate id {qid!r} (first at {unit} {seen[qid]}, again at {unit} {where}); ids must be unique "
                "(merged datasets are kept apart by data_source: `sleuth data convert --data-source NAME`)",
            )
        seen[qid] = where


def read_qa_jsonl(path: str | Path) -> list[QAExample]:
    """Load a FlashRAG QA jsonl fully; ids are made unique per dataset in a merged file
    (`qualify_ids_by_dataset`), then a repeated id is rejected naming both lines."""
    numbered = list(_iter_qa_jsonl_numbered(path))
    qualify_ids_by_dataset([ex for _, ex in numbered])
    _check_unique_ids(path, ((ex.id, lineno) for lineno, ex in numbered), "line")
    return [ex for _, ex in numbered]


def write_qa_jsonl(path: str | Path, examples: Iterable[QAExample]) -> int:
    """Write FlashRAG QA jsonl atomically (streamed to a temp file, then renamed). Returns the count."""
    n = 0
    with atomic_open_text(path) as f:
        for ex in examples:
            f.write(json.dumps(ex.to_dict(), ensure_ascii=False))
            f.write("\n")
            n += 1
    return n


def _read_json_array(path: Path) -> list[QAExample]:
    """A `.json` file holding one JSON array of records (some dataset dumps use this)."""

    try:
        records = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise DataFormatError(str(path), err.lineno, f"invalid JSON ({err.msg})") from err
    if not isinstance(records, list):
        raise DataFormatError(str(path), None, "expected a JSON array of records or one JSON object per line")
    examples = []
    for i, rec in enumerate(records):
        try:
            examples.append(qa_example_from_record(rec))
        except ValueError as err:
            raise DataFormatError(str(path), None, f"record {i} (0-based): {err}") from err
    qualify_ids_by_dataset(examples)
    _check_unique_ids(path, ((e.id, i) for i, e in enumerate(examples)), "record")
    return examples


# ---------------------------------------------------------------------------
# Search-R1 parquet
# ---------------------------------------------------------------------------

# Search-R1's `scripts/data_process/nq_search.py` "base" template; `{question}` is substituted.
SEARCH_R1_TEMPLATE = (
    "Answer the given question. "
    "You must conduct reasoning inside <think> and </think> first every time you get new information. "
    "After reasoning, if you find you lack some knowledge, you can call a search engine by <search> query "
    "</search> and it will return the top searched results between <information> and </information>. "
    "You can search as many times as your want. "
    "If you find no further external knowledge needed, you can directly provide the answer inside <answer> "
    "and </answer>, without detailed illustrations. For example, <answer> Beijing </answer>. "
    "Question: {question}\n"
)
DEFAULT_DATA_SOURCE = "sleuth"  # the data_source column of examples whose dataset is not known


def _question_from_prompt(prompt: Any) -> str | None:
    """The question in the last user message of a chat prompt: the text after its last 'Question:'
    (Search-R1, whose user message holds the whole template), else, when a system message carries
    the instructions, the whole user message (R-Search's `src/pre_data` files)."""
    if not isinstance(prompt, list):
        return None
    has_system = any(isinstance(m, dict) and m.get("role") == "system" for m in prompt)
    for message in reversed(prompt):
        if isinstance(message, dict) and message.get("role") == "user":
            content = message.get("content")
            if not isinstance(content, str):
                return None
            if "Question:" in content:
                question = content.rsplit("Question:", 1)[1].strip()
            elif has_system:
                question = content.strip()
            else:
                return None
            return question or None
    return None


def _example_from_searchr1_row(row: dict, row_number: int) -> QAExample:
    question = row.get("question")
    if question is None:
        question = _question_from_prompt(row.get("prompt"))
        if question is None:
            raise ValueError(
                "no 'question' column, and the user message of 'prompt' has no 'Question:' (nor a system "
                "message beside it); cannot recover the question text"
            )
    if not isinstance(question, str) or not question.strip():
        raise ValueError("'question' must be a non-empty string")

    answers: Any = row.get("golden_answers")
    if answers is None:
        reward_model = row.get("reward_model")
        ground_truth = reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
        answers = ground_truth.get("target") if isinstance(ground_truth, dict) else None
        if answers is None:
            raise ValueError("no 'golden_answers' column and no 'reward_model.ground_truth.target'")
    answers = _golden_answers_from(answers)

    qid = row.get("id")
    if qid is None:
        extra = row.get("extra_info") if isinstance(row.get("extra_info"), dict) else {}
        if extra.get("index") is not None:
            qid = f"{extra.get('split') or 'data'}_{extra['index']}"
        else:
            qid = str(row_number - 1)

    # write_searchr1_parquet's own column: metadata as JSON text (upstream's FlashRAG column is a struct)
    from_sleuth = isinstance(row.get("metadata"), str)
    metadata: Any = row.get("metadata")
    if isinstance(metadata, str):
        # write_searchr1_parquet stores metadata as JSON text: free-form dicts do not fit one parquet schema.
        try:
            metadata = json.loads(metadata) if metadata else {}
        except json.JSONDecodeError as err:
            raise ValueError(f"'metadata' is not valid JSON text ({err.msg})") from err
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict):
        raise ValueError(f"'metadata' must be an object, got {type(metadata).__name__}")
    if not from_sleuth or row.get("data_source") != DEFAULT_DATA_SOURCE:
        # older sleuth files kept `--data-source nq` in the column only; the placeholder "sleuth" names none
        _dataset_from_data_source(metadata, row.get("data_source"))
    return QAExample(id=str(qid), question=question.strip(), golden_answers=answers, metadata=metadata)


def read_searchr1_parquet(path: str | Path) -> list[QAExample]:
    """Read a Search-R1 training/eval parquet into QAExamples.

    The question comes from the `question` column when present (Search-R1's preprocessing keeps
    the FlashRAG columns), else from the user prompt after its last "Question:", else (R-Search: a
    system message holds the instructions) the user message itself. Answers come from
    `golden_answers`, else `reward_model.ground_truth.target` (a list or one string). In files from
    Search-R1 / R-Search / verl (no sleuth `metadata` column) `data_source` becomes metadata["dataset"];
    a file merging several datasets gets ids `{dataset}/{id}`.
    Errors name the 1-based row.
    """
    import pyarrow.parquet as pq

    path = Path(path)
    if not path.exists():
        raise DataFormatError(str(path), None, "parquet file does not exist")
    try:
        parquet = pq.ParquetFile(path)
    except Exception as err:  # pyarrow raises several types for a non-parquet file
        raise DataFormatError(str(path), None, f"not a readable parquet file ({err})") from err
    examples: list[QAExample] = []
    row_number = 0
    for batch in parquet.iter_batches(batch_size=4096):
        for row in batch.to_pylist():
            row_number += 1
            try:
                examples.append(_example_from_searchr1_row(row, row_number))
            except ValueError as err:
                raise DataFormatError(str(path), None, f"row {row_number}: {err}") from err
    qualify_ids_by_dataset(examples)
    _check_unique_ids(path, ((e.id, i + 1) for i, e in enumerate(examples)), "row")
    return examples


def write_searchr1_parquet(
    path: str | Path,
    examples: Iterable[QAExample],
    data_source: str | None = None,
    template: str = SEARCH_R1_TEMPLATE,
    split: str = "train",
    ability: str = "fact-reasoning",
) -> int:
    """Write examples as a Search-R1 parquet (atomic). Returns the number of rows.

    Columns follow Search-R1's preprocessing: data_source (the example's metadata["dataset"], else `data_source`,
    then its metadata["dataset"] too: merged files keep ids apart; else "sleuth"), prompt [{role: user, content}],
    ability, reward_model {style: rule, ground_truth: {target: answers}}, extra_info
    {split, index}, plus the kept id / question / golden_answers columns and metadata as JSON text.
    `template` must contain `{question}`.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    if "{question}" not in template:
        raise ValueError("template must contain '{question}' where the question text goes")
    rows = {
        k: []
        for k in (
            "id",
            "question",
            "golden_answers",
            "metadata",
            "data_source",
            "prompt",
            "ability",
            "reward_model",
            "extra_info",
        )
    }
    for index, ex in enumerate(examples):
        rows["id"].append(ex.id)
        rows["question"].append(ex.question)
        rows["golden_answers"].append(list(ex.golden_answers))
        metadata = (
            ex.metadata
            if ex.metadata.get("dataset") or not data_source
            else {**ex.metadata, "dataset": data_source}
        )
        rows["metadata"].append(json.dumps(metadata, ensure_ascii=False))
        rows["data_source"].append(str(metadata.get("dataset") or DEFAULT_DATA_SOURCE))
        rows["prompt"].append([{"role": "user", "content": template.replace("{question}", ex.question)}])
        rows["ability"].append(ability)
        rows["reward_model"].append({"style": "rule", "ground_truth": {"target": list(ex.golden_answers)}})
        rows["extra_info"].append({"split": split, "index": index})
    schema = pa.schema(
        [
            ("id", pa.string()),
            ("question", pa.string()),
            ("golden_answers", pa.list_(pa.string())),
            ("metadata", pa.string()),
            ("data_source", pa.string()),
            ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
            ("ability", pa.string()),
            (
                "reward_model",
                pa.struct(
                    [
                        ("style", pa.string()),
                        ("ground_truth", pa.struct([("target", pa.list_(pa.string()))])),
                    ]
                ),
            ),
            ("extra_info", pa.struct([("split", pa.string()), ("index", pa.int64())])),
        ]
    )
    table = pa.Table.from_pydict(rows, schema=schema)
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)
    return table.num_rows


# ---------------------------------------------------------------------------
# Corpus writing and format dispatch
# ---------------------------------------------------------------------------


def write_corpus(path: str | Path, passages: Iterable[Passage]) -> int:
    """Stream passages to a corpus jsonl (`{"id", "contents"}`) atomically. Returns the count.

    Memory stays constant: passages are written as they come and the file only appears
    (by rename) once all were written.
    """
    n = 0
    dumps = json.dumps
    with atomic_open_text(path) as f:
        write = f.write
        for p in passages:
            write(dumps({"id": p.id, "contents": p.contents}, ensure_ascii=False))
            write("\n")
            n += 1
    return n


QA_JSONL_SUFFIXES = (".jsonl", ".json")
QA_PARQUET_SUFFIXES = (".parquet",)


def load_qa(path: str | Path) -> list[QAExample]:
    """Load QA examples by extension: .jsonl (FlashRAG lines), .json (lines or one array), .parquet (Search-R1)."""

    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return read_searchr1_parquet(path)
    if suffix in QA_JSONL_SUFFIXES:
        if suffix == ".json" and path.exists():
            with open(path, encoding="utf-8") as f:
                head = f.read(4096).lstrip()
            if head.startswith("["):
                return _read_json_array(path)
        return read_qa_jsonl(path)
    raise DataFormatError(
        str(path),
        None,
        f"unknown QA file extension {suffix or '(none)'!r}; use .jsonl/.json (FlashRAG) or .parquet (Search-R1)",
    )


def save_qa(path: str | Path, examples: Iterable[QAExample], **parquet_options: Any) -> int:
    """Write QA examples by extension (.jsonl/.json lines or .parquet); options go to the parquet writer."""

    suffix = Path(path).suffix.lower()
    if suffix == ".parquet":
        return write_searchr1_parquet(path, examples, **parquet_options)
    if suffix in QA_JSONL_SUFFIXES:
        return write_qa_jsonl(path, examples)
    raise DataFormatError(
        str(path),
        None,
        f"unknown QA file extension {suffix or '(none)'!r}; use .jsonl/.json (FlashRAG) or .parquet (Search-R1)",
    )
