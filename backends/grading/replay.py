"""The grading replay (`disagg bench grading`): a class of N submissions, each the lab's app's two Ollama calls
(/api/generate, not streaming: the code analysis on the first model with `format: "json"`, the feedback on the
second), prompt lengths and num_predict drawn (seeded) from the lab's ranges and scaled for a small site, sent by
lanes as the app sends them (default: one lane per model, submissions in order), against a running gateway."""

from __future__ import annotations

import json
import random
import sys
import threading
import time
from dataclasses import asdict, dataclass, field

PROMPT_TOKENS = (6000, 25000)   # rubric + notebook (DESIGN.md "The site's workload")
NUM_PREDICT = (2000, 3500)
CHARS_PER_TOKEN = 2.8           # this notebook text under SmolLM2's BPE (measured); /tokenize gives the real count
HEADER_TOKENS = 170             # the rubric and the task
CLIENT_TIMEOUT_S = 300.0        # the app's
RUBRIC = """You are grading a student's Jupyter notebook for the course "Introduction to Data Analysis".
Rubric (total 10 points):
1. Data loading and cleaning (2 points): the CSV is read, missing values are handled, types are correct.
2. Exploratory analysis (3 points): summary statistics, at least two plots, and a written interpretation.
3. Modelling (3 points): a linear regression with a train/test split and a reported R^2.
4. Code quality (2 points): functions instead of copy-paste, names that say what they hold, comments.
"""
TASKS = {
    "analysis": 'Analyse the code below against the rubric. Answer in JSON only: {"criteria": [{"id": 1, "points": '
                'n, "evidence": "..."}], "bugs": ["..."], "score": n}.',
    "feedback": 'Write feedback for the student on the notebook below. Answer in JSON only: {"strengths": ["..."], '
                '"improvements": ["..."], "summary": "..."}.',
}
_CELLS = [
    "import pandas as pd\nimport numpy as np\ndf = pd.read_csv('{name}.csv')\ndf = df.dropna(subset=['{col}'])\n",
    "# {name}: the mean {col} per group\nsummary = df.groupby('group')['{col}'].agg(['mean', 'std', 'count'])\n"
    "print(summary)\n",
    "import matplotlib.pyplot as plt\nfig, ax = plt.subplots()\nax.hist(df['{col}'], bins={n})\n"
    "ax.set_title('{name} {col}')\nplt.show()\n",
    "from sklearn.linear_model import LinearRegression\nfrom sklearn.model_selection import train_test_split\n"
    "X_train, X_test, y_train, y_test = train_test_split(df[['x{n}']], df['{col}'], test_size=0.2)\n"
    "model = LinearRegression().fit(X_train, y_train)\nprint('R^2', model.score(X_test, y_test))\n",
    "def clean_{col}(frame):\n    # the {name} column has {n} outliers above the 99th percentile\n"
    "    q = frame['{col}'].quantile(0.99)\n    return frame[frame['{col}'] <= q]\n",
    "Markdown: The {col} of {name} rises with x{n}; the plot shows a long right tail, so I used the median.\n",
]
_WORDS = ["income", "height", "price", "rainfall", "score", "weight", "distance", "sales", "age", "yield"]


@dataclass
class Call:
    """One request of the class: `lane` sends its calls in order, one at a time."""

    index: int
    submission: int
    role: str          # "analysis" | "feedback"
    model: str
    prompt: str
    target_tokens: int
    num_predict: int
    json_format: bool
    lane: int = 0
    prompt_tokens: int = 0  # the gateway's /tokenize count, or an estimate
    seed: int = 0           # the sampling seed (the app sends none; a replay is repeatable)


def notebook(rng: random.Random, tokens: int) -> str:
    """Notebook text of about `tokens` tokens: code and markdown cells of one student."""
    parts, chars = [], 0
    while chars < tokens * CHARS_PER_TOKEN:
        cell = rng.choice(_CELLS).format(name=rng.choice(_WORDS), col=rng.choice(_WORDS), n=rng.randint(2, 60))
        parts.append(f"# In[{len(parts) + 1}]:\n{cell}")
        chars += len(parts[-1])
    return "\n".join(parts)


def workload(n: int, models: list[str], scale: float = 1.0, seed: int = 0, concurrency: int | None = None,
             predict_scale: float | None = None, texts: str = "") -> list[Call]:
    """`n` submissions x the app's two calls (the first model analyses with format json, the second gives feedback),
    submission by submission; lanes: `concurrency` split evenly across the models (default one per model);
    `predict_scale` scales num_predict (default: `scale`, as the prompts). `texts`: another class of the same sizes
    and seeds, other notebooks (a second run must not find the first's prompts in a prefix cache)."""
    if len(models) not in (1, 2):
        raise ValueError(f"a class runs on one or two models (analysis, feedback), got {models}")
    rng, text_rng = random.Random(seed), random.Random(f"{seed}/{texts}")
    per_model = max(1, (concurrency or len(models)) // len(models))
    extra = max(0, (concurrency or len(models)) - per_model * len(models))
    lanes = {}
    first = 0
    for i, m in enumerate(models):
        k = per_model + (1 if i < extra else 0)
        lanes[m] = list(range(first, first + k))
        first += k
    calls = []
    for s in range(n):
        for j, role in enumerate(("analysis", "feedback")):
            model = models[j % len(models)]
            target = max(HEADER_TOKENS + 1, int(rng.randint(*PROMPT_TOKENS) * scale))
            text = notebook(text_rng, target - HEADER_TOKENS)
            lane_list = lanes[model]
            lane = lane_list[(s if len(models) == 2 else len(calls)) % len(lane_list)]
            calls.append(Call(len(calls), s, role, model, f"{RUBRIC}\n{TASKS[role]}\n\n{text}", target,
                              max(1, int(rng.randint(*NUM_PREDICT) * (scale if predict_scale is None else
                                                                        predict_scale))), role == "analysis", lane,
                              seed=rng.randrange(2**31)))
    return calls


@dataclass
class Result:
    """One request as the client saw it (seconds from the replay's start) and as the gateway reported it."""

    index: int
    submission: int
    role: str
    model: str
    lane: int
    start: float = 0.0
    end: float = 0.0
    status: int = 0
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    path: str = ""
    node: str = ""
    queue_s: float = 0.0
    prefix_tokens: int = 0  # prompt tokens a prefix cache already held (x-disagg-prefix-tokens)
    prefill_s: float = 0.0
    ttft_s: float = 0.0     # prompt_eval_duration: queue + prefill + KV + the first token
    decode_s: float = 0.0   # eval_duration
    json_valid: bool | None = None
    done_reason: str = ""   # "stop", or "length" when num_predict cut the answer
    answer: str = ""        # the answer's first 160 characters
    segments: dict = field(default_factory=dict)

    @property
    def latency(self) -> float:
        return self.end - self.start


def segments(r: Result) -> dict[str, tuple[float, float]]:
    """The request's timeline: queued, prefill, KV (transfer, ingest and the first token), decode; client clock."""
    dec_start = r.end - r.decode_s
    gen_start = max(r.start, dec_start - r.ttft_s)
    q_end = gen_start + r.queue_s
    p_end = min(dec_start, q_end + (r.prefill_s if r.prefill_s > 0 else max(0.0, r.ttft_s - r.queue_s)))
    return {"queued": (r.start, q_end), "prefill": (q_end, p_end), "kv": (p_end, dec_start),
            "decode": (dec_start, r.end)}


def _json_valid(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


class Replay:
    """Sends the calls lane by lane over one HTTP client each, recording a Result per call."""

    def __init__(self, url: str, api_key: str | None, progress: bool = True, timeout: float = CLIENT_TIMEOUT_S):
        self.url, self.progress, self.timeout = url.rstrip("/"), progress, timeout
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._lock = threading.Lock()
        self._done = self._errors = 0

    def count_tokens(self, calls: list[Call]) -> None:
        """Each prompt's token count from the gateway's /tokenize; the chars/token estimate where it cannot say."""
        httpx = need_httpx()
        with httpx.Client(timeout=60) as http:
            for c in calls:
                try:
                    r = http.post(self.url + "/tokenize", headers=self.headers, json={"model": c.model,
                                  "messages": [{"role": "user", "content": c.prompt}]})
                    c.prompt_tokens = int(r.json()["count"]) if r.status_code == 200 else 0
                except (httpx.HTTPError, ValueError, KeyError):
                    c.prompt_tokens = 0
                c.prompt_tokens = c.prompt_tokens or int(len(c.prompt) / CHARS_PER_TOKEN)

    def run(self, calls: list[Call]) -> tuple[list[Result], float]:
        """(a Result per call, makespan in seconds)."""
        lanes: dict[int, list[Call]] = {}
        for c in calls:
            lanes.setdefault(c.lane, []).append(c)
        results = {c.index: Result(c.index, c.submission, c.role, c.model, c.lane) for c in calls}
        self._done = self._errors = 0
        t0 = time.perf_counter()
        stop = threading.Event()
        bar = threading.Thread(target=self._bar, args=(len(calls), t0, stop), daemon=True)
        if self.progress:
            bar.start()
        threads = [threading.Thread(target=self._lane, args=(q, results, t0)) for q in lanes.values()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        makespan = time.perf_counter() - t0
        stop.set()
        if self.progress:
            bar.join()
            self._draw(len(calls), t0)
            print(file=sys.stderr)
        return [results[c.index] for c in calls], makespan

    def _lane(self, calls: list[Call], results: dict[int, Result], t0: float) -> None:
        httpx = need_httpx()
        with httpx.Client(timeout=httpx.Timeout(self.timeout, connect=30.0)) as http:
            for c in calls:
                r = results[c.index]
                r.start = time.perf_counter() - t0
                self._one(http, c, r)
                r.end = time.perf_counter() - t0
                r.segments = segments(r) if not r.error else {}
                with self._lock:
                    self._done += 1
                    self._errors += bool(r.error)

    def _one(self, http, c: Call, r: Result) -> None:
        httpx = need_httpx()
        body = {"model": c.model, "prompt": c.prompt, "stream": False,
                "options": {"num_predict": c.num_predict, "temperature": 0.2, "top_p": 0.9, "seed": c.seed}}
        if c.json_format:
            body["format"] = "json"
        try:
            resp = http.post(self.url + "/api/generate", headers=self.headers, json=body)
        except httpx.HTTPError as e:
            r.error = f"{type(e).__name__}: {e}"
            return
        r.status = resp.status_code
        try:
            data = resp.json()
        except ValueError:
            data = {}
        if resp.status_code != 200:
            r.error = f"HTTP {resp.status_code}: {data.get('error', resp.text[:200])}"
            return
        h = resp.headers
        r.path, r.node = h.get("x-disagg-path", ""), h.get("x-disagg-decode-node", "")
        r.queue_s = float(h.get("x-disagg-queue-ms", 0)) / 1000
        r.prefill_s = float(h.get("x-disagg-prefill-ms", 0)) / 1000
        r.prefix_tokens = int(h.get("x-disagg-prefix-tokens", 0))
        r.prompt_tokens, r.output_tokens = data.get("prompt_eval_count", 0), data.get("eval_count", 0)
        r.ttft_s = data.get("prompt_eval_duration", 0) / 1e9
        r.decode_s = data.get("eval_duration", 0) / 1e9
        r.json_valid = _json_valid(data.get("response", "")) if c.json_format else None
        r.done_reason, r.answer = data.get("done_reason", ""), data.get("response", "")[:160]

    def _bar(self, total: int, t0: float, stop: threading.Event) -> None:
        while not stop.wait(1.0):
            self._draw(total, t0)

    def _draw(self, total: int, t0: float) -> None:
        done = self._done
        filled = int(30 * done / max(1, total))
        print(f"\r[{'#' * filled}{'.' * (30 - filled)}] {done}/{total} requests, {self._errors} errors, "
              f"{time.perf_counter() - t0:.0f} s", end="", file=sys.stderr, flush=True)


def need_httpx():
    """httpx, the replay's client (the bench extra: `pip install -e '.[bench]'`); a box without it gets the fix."""
    try:
        import httpx
    except ImportError:
        raise SystemExit("disagg bench grading needs httpx (and matplotlib for --png): pip install -e '.[bench]' (or pip install httpx matplotlib)")
    return httpx


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    v = sorted(values)
    k = (len(v) - 1) * q
    lo = int(k)
    return v[lo] + (v[min(lo + 1, len(v) - 1)] - v[lo]) * (k - lo)


def measured(results: list[Result], makespan: float) -> dict:
    ok = [r for r in results if not r.error]
    lat = [r.latency for r in ok]
    json_calls = [r for r in ok if r.json_valid is not None]
    return {"makespan_s": round(makespan, 3), "requests": len(results), "errors": len(results) - len(ok),
            "latency_s": {"p50": round(percentile(lat, 0.5), 3), "p95": round(percentile(lat, 0.95), 3),
                          "max": round(max(lat, default=0.0), 3)},
            "tokens_per_s": {"in": round(sum(r.prompt_tokens for r in ok) / max(makespan, 1e-9), 1),
                             "out": round(sum(r.output_tokens for r in ok) / max(makespan, 1e-9), 1)},
            "json_valid": f"{sum(bool(r.json_valid) for r in json_calls)}/{len(json_calls)}",
            "cut_by_num_predict": sum(r.done_reason == "length" for r in ok),
            "prefix_cached_tokens": sum(r.prefix_tokens for r in ok),
            "paths": {p: sum(r.path == p for r in ok) for p in sorted({r.path for r in ok})}}


def result_rows(results: list[Result]) -> list[dict]:
    return [{**asdict(r), "latency": round(r.latency, 3)} for r in results]
