"""Each request's latency against the app's client timeout (300 s): median, 95th percentile, max and how many passed
it, per concurrency, for the prediction (`--predict`) and the replay alike; and the highest concurrency none passed."""

from __future__ import annotations

from backends.grading.replay import CLIENT_TIMEOUT_S, percentile


def latency_report(latencies: list[float], timeout_s: float = CLIENT_TIMEOUT_S, gave_up: int = 0) -> dict:
    """`latencies` in seconds of the requests that answered; `gave_up`: requests the client abandoned at its timeout
    (their latency is at least the timeout), counted as past it."""
    lat = sorted(latencies)
    past = sum(x > timeout_s for x in lat) + gave_up
    return {"timeout_s": timeout_s, "requests": len(lat) + gave_up, "median_s": round(percentile(lat, 0.5), 1),
            "p95_s": round(percentile(lat, 0.95), 1), "max_s": round(max(lat, default=0.0), 1)
            if not gave_up else max(round(max(lat, default=0.0), 1), timeout_s), "past_timeout": past}


def predicted(outcomes, timeout_s: float = CLIENT_TIMEOUT_S) -> dict:
    """The cost model's outcomes (backends/grading/predict.py): each request from its sending to its last token."""
    return latency_report([o.end - o.sent for o in outcomes], timeout_s)


def measured(results, timeout_s: float = CLIENT_TIMEOUT_S) -> dict:
    """The replay's results: answered requests by their latency; those whose client timed out as past it."""
    gave_up = [r for r in results if r.error and "timeout" in r.error.lower()]
    ok = [r.latency for r in results if not r.error]
    return latency_report(ok, timeout_s, len(gave_up))


def highest_within(rows: dict[int, dict]) -> int | None:
    """The highest concurrency asked at which no request passed the timeout, with none passing at any lower one;
    None when even the lowest did."""
    best = None
    for c in sorted(rows):
        if rows[c]["past_timeout"]:
            break
        best = c
    return best


def line(concurrency: int, rep: dict, label: str = "") -> str:
    return (f"  concurrency {concurrency:>3}{label}: latency median {rep['median_s']:.0f} s, p95 {rep['p95_s']:.0f} s, "
            f"max {rep['max_s']:.0f} s; {rep['past_timeout']} of {rep['requests']} past the client's "
            f"{rep['timeout_s']:g} s")


def verdict(rows: dict[int, dict], timeout_s: float) -> str:
    best = highest_within(rows)
    if best is None:
        return f"at every concurrency asked ({sorted(rows)}) some request passes the client's {timeout_s:g} s"
    return (f"highest concurrency at which no request passes the client's {timeout_s:g} s: {best} (of "
            f"{sorted(rows)} asked)")
