"""A grading class for measuring speculative decoding (bench/bench_class_drafts.py offline, bench/bench_class_spec.py
through a stack): one rubric, varied student notebooks of 2-6k SmolLM2 tokens, each sent twice as the lab's app does
(an analysis in JSON, Ollama `format: "json"`, and feedback in prose), with the answers a model gives cached."""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

from backends.grading.replay import RUBRIC, TASKS  # noqa: F401  (TASKS: the analysis task, for callers)

PROMPT_TOKENS = (2000, 6000)
# The lab's feedback is prose (issue 48); the replay's own feedback task asks JSON of every call.
FEEDBACK_PROSE = ("Write feedback for the student on the notebook above, in plain prose (no JSON, no lists): what "
                  "works, what to fix first, and how, quoting their code where it helps.")
_NAMES = ["income", "height", "price", "rainfall", "score", "weight", "distance", "sales", "age", "yield", "rent",
          "speed", "temperature", "votes", "calories"]
_FRAMES = ["df", "data", "frame", "students", "raw", "table"]
_CELLS = [
    "import pandas as pd\nimport numpy as np\n{f} = pd.read_csv('{a}.csv')\n{f} = {f}.dropna(subset=['{b}'])\n",
    "import pandas as pd\n{f} = pd.read_csv(\"data/{a}_{n}.csv\", sep=';')\nprint({f}.shape)\n{f}.head()\n",
    "# the mean {b} per group\nsummary = {f}.groupby('group')['{b}'].agg(['mean', 'std', 'count'])\nprint(summary)\n",
    "{f}['{b}'] = {f}['{b}'].fillna({f}['{b}'].median())\n{f}['{a}'] = {f}['{a}'].astype(float)\n",
    "import matplotlib.pyplot as plt\nfig, ax = plt.subplots()\nax.hist({f}['{b}'], bins={n})\n"
    "ax.set_title('{a} vs {b}')\nplt.show()\n",
    "plt.scatter({f}['{a}'], {f}['{b}'], alpha=0.{n})\nplt.xlabel('{a}')\nplt.ylabel('{b}')\nplt.savefig('{a}.png')\n",
    "from sklearn.linear_model import LinearRegression\nfrom sklearn.model_selection import train_test_split\n"
    "X_train, X_test, y_train, y_test = train_test_split({f}[['{a}']], {f}['{b}'], test_size=0.{n})\n"
    "model = LinearRegression().fit(X_train, y_train)\nprint('R^2', model.score(X_test, y_test))\n",
    "model = LinearRegression()\nmodel.fit({f}[['{a}', '{b}']], {f}['target'])\n"
    "print(model.coef_, model.intercept_)  # no test split here\n",
    "def clean_{b}(frame):\n    # {n} outliers above the 99th percentile\n    q = frame['{b}'].quantile(0.99)\n"
    "    return frame[frame['{b}'] <= q]\n",
    "def load_and_clean(path, column='{b}'):\n    frame = pd.read_csv(path)\n    frame = frame[frame[column] > 0]\n"
    "    return frame.reset_index(drop=True)\n",
    "for col in ['{a}', '{b}']:\n    print(col, {f}[col].mean(), {f}[col].max())\n    {f}[col + '_z'] = "
    "({f}[col] - {f}[col].mean()) / {f}[col].std()\n",
    "corr = {f}[['{a}', '{b}']].corr()\nprint(corr)\nimport seaborn as sns\nsns.heatmap(corr, annot=True)\n",
    "Markdown: The {b} of {a} rises with x{n}; the plot shows a long right tail, so I used the median.\n",
    "Markdown: I dropped {n} rows where {a} was missing. I am not sure this is right because it removes a lot of "
    "the {b} data.\n",
    "{f}2 = {f}.copy()\n{f}2 = {f}2[{f}2['{a}'] != '']\n{f}2['{b}'] = {f}2['{b}'] * {n}  # convert units?\n",
    "x = {f}['{a}'].values\ny = {f}['{b}'].values\nslope = np.sum((x - x.mean()) * (y - y.mean())) / "
    "np.sum((x - x.mean()) ** 2)\nprint('slope', slope)\n",
]


@dataclass
class ClassCall:
    submission: int
    role: str           # "analysis" (JSON) | "feedback" (prose)
    prompt: str
    json_format: bool
    prompt_tokens: int = 0


def _notebook(rng: random.Random, chars: int) -> str:
    """One student's notebook: cells from a few templates, their names and numbers the student's own."""
    frame = rng.choice(_FRAMES)
    favourites = rng.sample(range(len(_CELLS)), 8)  # each student leans on some cells more than others
    parts, n = [], 0
    while n < chars:
        i = rng.choice(favourites) if rng.random() < 0.7 else rng.randrange(len(_CELLS))
        cell = _CELLS[i].format(f=frame, a=rng.choice(_NAMES), b=rng.choice(_NAMES), n=rng.randint(2, 60))
        parts.append(f"# In[{len(parts) + 1}]:\n{cell}")
        n += len(parts[-1])
    return "\n".join(parts)


def prompt(role: str, text: str) -> str:
    """Rubric, notebook, then the task: the two calls of a submission share everything but the task."""
    task = TASKS["analysis"] if role == "analysis" else FEEDBACK_PROSE
    return f"{RUBRIC}\nThe student's notebook:\n\n{text}\n\n{task}"


def make_class(submissions: int = 20, seed: int = 0, tokens: tuple[int, int] = PROMPT_TOKENS,
               count=None) -> list[ClassCall]:
    """`submissions` x (analysis, feedback). `count(text) -> tokens` sizes each notebook to its drawn length
    (default 2.8 characters a token, SmolLM2's on this text)."""
    if submissions < 1:
        raise ValueError(f"a class needs at least one submission, got {submissions}")
    rng = random.Random(seed)
    calls = []
    for s in range(submissions):
        target = rng.randint(*tokens)
        text = _notebook(rng, int(target * 2.8))
        if count is not None:  # trim or grow to the drawn length with the real tokenizer
            have = count(prompt("analysis", text))
            text = _notebook(random.Random(f"{seed}/{s}"), int(len(text) * target / max(have, 1)))
        for role in ("analysis", "feedback"):
            p = prompt(role, text)
            calls.append(ClassCall(s, role, p, role == "analysis", count(p) if count else 0))
    return calls


def chat_ids(tokenizer, text: str) -> list[int]:
    """The prompt's token ids as the gateway's non-raw /api/generate sends them: one user turn, chat template."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # newer transformers answer a BatchEncoding


def cache_key(calls: list[ClassCall], model_path: str, max_tokens: int) -> str:
    h = hashlib.sha256(json.dumps([asdict(c) for c in calls]).encode())
    h.update(f"{Path(model_path).resolve()}|{max_tokens}".encode())
    return h.hexdigest()[:16]


def answers(calls: list[ClassCall], model_path: str, max_tokens: int, cache_dir: Path,
            progress=None, generate: bool = True) -> list[dict]:
    """Each call's prompt ids and greedy answer ids from mlx-lm in-process (JSON-constrained for the analysis, as
    the node does for `format: "json"`), cached in `cache_dir` by class, model and length. `generate` False: only
    what is cached (the submissions a running generation has finished so far)."""
    path = Path(cache_dir) / f"class-answers-{cache_key(calls, model_path, max_tokens)}.json"
    if path.exists():
        return json.loads(path.read_text())
    partial = path.with_suffix(".partial")  # answers so far: an interrupted run goes on from there
    done = json.loads(partial.read_text()) if partial.exists() else []
    if not generate:
        return done
    path.parent.mkdir(parents=True, exist_ok=True)
    out = _generate(calls, model_path, max_tokens, progress, done, lambda rows: partial.write_text(json.dumps(rows)))
    path.write_text(json.dumps(out))
    partial.unlink(missing_ok=True)
    return out


def _generate(calls: list[ClassCall], model_path: str, max_tokens: int, progress, done: list[dict],
              save) -> list[dict]:
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    from backends.decode.grammar import GrammarCompiler, GrammarSpec

    model, tok = load(model_path)
    grammar = GrammarCompiler(tok._tokenizer, model.args.vocab_size, list(tok.eos_token_ids))
    out = list(done)
    by_sub: dict[int, list[ClassCall]] = {}
    for c in calls:
        by_sub.setdefault(c.submission, []).append(c)
    for sub, pair in by_sub.items():
        if any(row["submission"] == sub for row in done):
            continue
        ids = [chat_ids(tok, c.prompt) for c in pair]
        shared = next((i for i, (a, b) in enumerate(zip(ids[0], ids[-1])) if a != b), min(map(len, ids)))
        base = make_prompt_cache(model)
        for i in range(0, shared - 1, 512):  # the rubric and notebook once for both calls (a prefix cache's way)
            model(mx.array([ids[0][i:min(i + 512, shared - 1)]]), cache=base)
        mx.eval([c.state for c in base])
        for c, p in zip(pair, ids):
            cache = make_prompt_cache(model)
            for dst, src in zip(cache, base):
                dst.state = src.state  # the next update allocates anew: base stays as it is
            procs = [grammar.processor(GrammarSpec())] if c.json_format else None
            answer = []
            for t, _ in generate_step(mx.array(p[shared - 1:]), model, max_tokens=max_tokens, prompt_cache=cache,
                                      logits_processors=procs):
                if int(t) in tok.eos_token_ids:
                    break
                answer.append(int(t))
            out.append({"submission": sub, "role": c.role, "prompt": p, "answer": answer})
            if progress:
                progress(f"submission {sub} {c.role}: {len(p)} prompt tokens, {len(answer)} answer tokens")
        save(out)
    return out
