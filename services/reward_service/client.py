"""Client: ``RewardClient(url, token=None, timeout_s=30.0, max_retries=0).score(prompts, completions,
fields=None)`` returns one finite float per sample and raises ``RewardServiceError`` (with ``.status`` and
the server's message) otherwise. A timeout, a lost connection or a 5xx is retried ``max_retries`` times
with exponential backoff; a 4xx or a malformed answer is not. It never follows redirects, so the token
goes only to the URL given, and it ignores proxy settings of the environment.
"""

from __future__ import annotations

import json
import logging
import math
import urllib.parse
from collections.abc import Callable, Sequence

import httpx
import tenacity

from services.errors import TetherError

log = logging.getLogger("services.reward_service")


class RewardServiceError(TetherError, RuntimeError):
    """The reward service answered with an error, an invalid answer, or could not be reached.

    ``status`` is the HTTP status (None when no HTTP answer came back); ``message`` the server's message.
    """

    def __init__(self, status: int | None, message: str, url: str = "") -> None:
        self.status, self.message, self.url = status, message, url
        where = f" from {url}" if url else ""
        prefix = f"HTTP {status}" if status is not None else "no HTTP answer"
        super().__init__(f"reward service{where}: {prefix}: {message}")

    @property
    def transient(self) -> bool:
        """A timeout, a lost connection or a 5xx: worth another try. A 4xx or a bad answer is not."""
        return self.status is None or self.status >= 500


def reject_constant(name: str) -> object:
    """json.loads' parse_constant: NaN and Infinity are not JSON."""
    raise ValueError(f"{name} is not valid JSON")


class RewardClient:
    """Scores (prompt, completion, fields) samples on a remote reward service."""

    def __init__(self, url: str, token: str | None = None, timeout_s: float = 30.0,
                 max_retries: int = 0) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"reward service url must be http(s)://host:port, got {url!r}")
        if parts.username or parts.password:
            raise ValueError("put the token in token=..., not in the url")
        if token is not None and (not isinstance(token, str) or not token.strip()):
            raise ValueError("token must be a non-empty string or None")
        if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        if not isinstance(max_retries, int) or max_retries < 0:
            raise ValueError(f"max_retries must be an integer >= 0, got {max_retries!r}")
        self.url = url.rstrip("/")
        self.token, self.timeout_s, self.max_retries = token, float(timeout_s), max_retries
        headers = {"Accept": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self._http = httpx.Client(timeout=self.timeout_s, headers=headers, follow_redirects=False,
                                  trust_env=False)

    def __repr__(self) -> str:  # never shows the token
        return (f"RewardClient(url={self.url!r}, token={'set' if self.token else None}, "
                f"timeout_s={self.timeout_s}, max_retries={self.max_retries})")

    def close(self) -> None:
        self._http.close()

    def _request(self, method: str, path: str, payload: dict | None = None) -> dict:
        """One request; the answer's JSON object, or RewardServiceError."""
        endpoint = f"{self.url}{path}"
        body = None if payload is None else json.dumps(payload, allow_nan=False).encode()
        headers = {"Content-Type": "application/json"} if body is not None else {}
        try:
            response = self._http.request(method, endpoint, content=body, headers=headers)
        except httpx.TimeoutException:
            raise RewardServiceError(None, f"no answer within timeout_s={self.timeout_s}", endpoint) from None
        except httpx.HTTPError as e:
            raise RewardServiceError(None, f"request failed: {type(e).__name__}: {e}", endpoint) from None
        text = response.content.decode("utf-8", "replace")
        try:
            decoded = json.loads(text, parse_constant=reject_constant)
        except (ValueError, RecursionError):
            decoded = None
        decoded = decoded if isinstance(decoded, dict) else None
        if response.status_code != 200:
            message = (decoded.get("error") if decoded and isinstance(decoded.get("error"), str)
                       else text[:500])
            raise RewardServiceError(response.status_code, message or "(empty body)", endpoint)
        if decoded is None:
            raise RewardServiceError(200, f"answer is not a JSON object: {text[:200]!r}", endpoint)
        return decoded

    def _with_retries(self, call: Callable[[], dict]) -> dict:
        """``call()``, retried on a timeout, a lost connection or a 5xx with exponential backoff."""
        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception(lambda e: isinstance(e, RewardServiceError) and e.transient),
            stop=tenacity.stop_after_attempt(self.max_retries + 1),
            wait=tenacity.wait_exponential_jitter(multiplier=0.5, max=30.0),
            before_sleep=lambda state: log.warning("reward service: attempt %d failed (%s); retrying",
                                                   state.attempt_number, state.outcome.exception()),
            reraise=True,
        )
        return retrying(call)

    def health(self) -> bool:
        return self._with_retries(lambda: self._request("GET", "/health")).get("ok") is True

    def score(self, prompts: Sequence[str], completions: Sequence[str],
              fields: Sequence[dict] | None = None) -> list[float]:
        """One finite float per (prompt, completion[, fields]) sample, in order."""
        prompts, completions = list(prompts), list(completions)
        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
        for name, items in (("prompts", prompts), ("completions", completions)):
            for i, item in enumerate(items):
                if not isinstance(item, str):
                    raise TypeError(f"{name}[{i}] must be a string, got {type(item).__name__}")
        payload: dict = {"prompts": prompts, "completions": completions}
        if fields is not None:
            fields = list(fields)
            if len(fields) != len(prompts) or not all(isinstance(f, dict) for f in fields):
                raise ValueError(f"fields must be {len(prompts)} dicts, one per sample")
            payload["fields"] = fields
        answer = self._with_retries(lambda: self._request("POST", "/score", payload))
        endpoint = f"{self.url}/score"
        scores = answer.get("scores")
        if not isinstance(scores, list):
            raise RewardServiceError(200, f"answer has no 'scores' list: {json.dumps(answer)[:200]!r}",
                                     endpoint)
        if len(scores) != len(prompts):
            raise RewardServiceError(200, f"got {len(scores)} scores for {len(prompts)} samples", endpoint)
        out = []
        for i, value in enumerate(scores):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise RewardServiceError(200, f"score for sample index {i} is {value!r}, not a finite number",
                                         endpoint)
            out.append(float(value))
        return out

    __call__ = score
