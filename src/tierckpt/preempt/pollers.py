"""Notice sources asked from the watcher thread: a trigger file, the AWS spot
``instance-action`` and GCP's ``preempted``/``maintenance-event`` metadata keys. Each
implements :class:`tierckpt.preempt.config.Poller`. Stdlib only, torch-free.

The contract every poller here keeps:

1. ``poll()`` returns None while no termination is announced, and a :class:`Notice` once one
   is. From then on it returns *that same* notice on every call without asking again (a
   notice is never withdrawn, and its receipt time and deadline do not drift).
2. ``poll()`` returns or raises within about ``timeout_s`` in all (every request of one poll
   shares that budget). An endpoint that refuses, does not answer in time or sends a body
   it cannot parse raises :class:`~tierckpt.errors.NoticeSourceError` naming the URL; the
   next poll asks again.
3. The HTTP pollers never use a proxy from the environment (``http_proxy``): a metadata
   endpoint is link-local and only the instance itself can answer for it.
"""

from __future__ import annotations

import datetime
import json
import math
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tierckpt.errors import ConfigError, NoticeSourceError
from tierckpt.policy.units import check_seconds
from tierckpt.preempt.notice import Notice

MAX_BODY = 64 * 1024
"""Bytes read from a metadata answer at most; a longer one is not a metadata answer."""

AWS_TOKEN_PATH = "/latest/api/token"
AWS_ACTION_PATH = "/latest/meta-data/spot/instance-action"
GCP_PREEMPTED_PATH = "/computeMetadata/v1/instance/preempted"
GCP_MAINTENANCE_PATH = "/computeMetadata/v1/instance/maintenance-event"

# No ProxyHandler entries: urllib would otherwise send metadata requests to $http_proxy.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _endpoint(field: str, url: str) -> str:
    """``url`` without a trailing slash if it is ``http(s)://host[:port]``, else ConfigError."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname \
            or parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ConfigError(f"{field} must be http://host[:port] (no path), got {url!r}")
    try:
        parts.port  # noqa: B018  (raises on a bad port)
    except ValueError as e:
        raise ConfigError(f"{field}: bad port in {url!r}: {e}") from None
    return url.rstrip("/")


class _Answer:
    """One HTTP answer: status, headers (lower-cased names) and the body as text."""

    def __init__(self, status: int, headers: Mapping[str, str], body: str) -> None:
        self.status, self.headers, self.body = status, headers, body


def _request(url: str, *, method: str, headers: Mapping[str, str], deadline: float,
             who: str) -> _Answer:
    """One request that returns by ``deadline`` (monotonic) or raises NoticeSourceError.

    Any HTTP status comes back as an :class:`_Answer`; only transport failures raise."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise NoticeSourceError(f"{who}: no time left in this poll for {method} {url}")
    req = urllib.request.Request(url, method=method, headers=dict(headers),
                                 data=b"" if method == "PUT" else None)
    try:
        try:
            resp = _OPENER.open(req, timeout=left)
        except urllib.error.HTTPError as e:  # a status >= 400 is an answer, not a failure
            with e:
                body = e.read(MAX_BODY + 1) if e.fp is not None else b""
                return _Answer(e.code, {k.lower(): v for k, v in e.headers.items()},
                               body.decode("utf-8", "replace"))
        with resp:
            body = resp.read(MAX_BODY + 1)
            answer = _Answer(resp.status, {k.lower(): v for k, v in resp.headers.items()},
                             body.decode("utf-8", "replace"))
    except (OSError, ValueError) as e:  # URLError, timeouts, resets, http.client errors
        reason = getattr(e, "reason", e)
        raise NoticeSourceError(
            f"{who}: {method} {url} did not answer within {left:.1f} s ({reason}); check the "
            "endpoint, or leave this poller out where the job does not run on that cloud"
        ) from e
    if len(body) > MAX_BODY:
        raise NoticeSourceError(f"{who}: {method} {url} sent more than {MAX_BODY} bytes; "
                                "that is not a metadata answer (check the endpoint)")
    return answer


class _Latched:
    """The shared half of every poller: the first notice is kept and returned thereafter."""

    name: str
    every_s: float

    def __init__(self) -> None:
        self._notice: Notice | None = None

    @property
    def notice(self) -> Notice | None:
        """The notice this poller has seen (None: none yet)."""
        return self._notice

    def poll(self) -> Notice | None:
        """None while no termination is announced; then the same :class:`Notice` forever."""
        if self._notice is None:
            self._notice = self._ask()
        return self._notice

    def _ask(self) -> Notice | None:
        raise NotImplementedError  # each poller's one look at its source

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, every_s={self.every_s})"


class FileTrigger(_Latched):
    """A notice once ``path`` exists (a sidecar or a preStop hook creates it).

    A number in the file (``"25"``, ``"25.5"``) is the seconds of grace left, counted from
    the file's mtime: deadline = mtime + n. Anything else (empty, text, a negative number)
    gives deadline = now + ``grace_s``, and ``detail`` says why. Write a number atomically
    (to a temp file, then rename): a file seen half-written is read as empty.

    ``since_unix``: a file whose mtime is older is left over from an earlier run and is not
    a notice (None: any file is). Source ``file:<path>``."""

    def __init__(self, path: str | Path, *, grace_s: float, every_s: float = 0.5,
                 since_unix: float | None = None) -> None:
        super().__init__()
        self.path = Path(path)
        self.grace_s = check_seconds("FileTrigger.grace_s", grace_s)
        self.every_s = check_seconds("FileTrigger.every_s", every_s)
        self.since_unix = since_unix
        self.name = f"file:{self.path}"

    def _ask(self) -> Notice | None:
        try:
            st = self.path.stat()
            with open(self.path, "rb") as f:
                raw = f.read(MAX_BODY)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise NoticeSourceError(f"{self.name}: the trigger file exists but cannot be "
                                    f"read ({e}); make it readable by the job") from e
        if self.since_unix is not None and st.st_mtime < self.since_unix:
            return None
        text = raw.decode("utf-8", "replace").strip()
        try:
            left = float(text)
        except ValueError:
            left = math.nan
        if math.isfinite(left) and left >= 0:
            return Notice.now(self.name, grace_s=self.grace_s,
                              deadline_unix=st.st_mtime + left,
                              detail=f"{left:g} s of grace from the file's mtime")
        why = "empty" if not text else f"{text[:40]!r} is not a number of seconds >= 0"
        return Notice.now(self.name, grace_s=self.grace_s,
                          detail=f"file {why}; configured grace {self.grace_s:g} s")


def _parse_aws_time(value: object, url: str) -> float | None:
    """Seconds since the epoch of AWS's ``"2026-12-02T12:00:00Z"`` (UTC); None if absent."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise NoticeSourceError(f"aws: GET {url}: 'time' is {value!r}, not an ISO 8601 string")
    try:
        t = datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError as e:
        raise NoticeSourceError(f"aws: GET {url}: 'time' {value!r} is not ISO 8601") from e
    if t.tzinfo is None:
        t = t.replace(tzinfo=datetime.timezone.utc)
    return t.timestamp()


class AwsSpot(_Latched):
    """The EC2 spot interruption notice: ``spot/instance-action`` in instance metadata.

    Each poll asks with IMDSv2: a session token (PUT ``/latest/api/token``, kept for
    ``token_ttl_s`` and renewed on a 401), then GET ``/latest/meta-data/spot/instance-action``
    with it. A 403, 404 or 405 to the token PUT means the endpoint has no IMDSv2: this
    poller then asks with IMDSv1 (no token) from then on. 404 to the GET: no interruption
    scheduled (None). 200: ``{"action": "terminate"|"stop"|"hibernate", "time": ISO 8601}``
    gives a notice with ``deadline_unix`` from ``time``, source ``aws``, detail the action
    (AWS's notice comes about two minutes ahead; without ``time`` the deadline is now +
    ``grace_s``). A body that is not that JSON object, or a ``time`` that is not ISO 8601,
    raises."""

    def __init__(self, *, endpoint: str = "http://169.254.169.254", grace_s: float = 120.0,
                 every_s: float = 5.0, timeout_s: float = 1.0,
                 token_ttl_s: int = 21600) -> None:
        super().__init__()
        self.endpoint = _endpoint("AwsSpot.endpoint", endpoint)
        self.grace_s = check_seconds("AwsSpot.grace_s", grace_s)
        self.every_s = check_seconds("AwsSpot.every_s", every_s)
        self.timeout_s = check_seconds("AwsSpot.timeout_s", timeout_s)
        if isinstance(token_ttl_s, bool) or not isinstance(token_ttl_s, int) \
                or not 1 <= token_ttl_s <= 21600:
            raise ConfigError(f"AwsSpot.token_ttl_s must be an int in 1..21600 (seconds, "
                              f"IMDSv2's limit), got {token_ttl_s!r}")
        self.token_ttl_s = token_ttl_s
        self.name = "aws"
        self.imds_v1 = False
        """True once the endpoint refused the IMDSv2 token: later polls send none."""
        self._token: str | None = None
        self._token_until = 0.0

    def _token_header(self, deadline: float) -> dict[str, str]:
        if self.imds_v1:
            return {}
        now = time.monotonic()
        if self._token is None or now >= self._token_until:
            url = self.endpoint + AWS_TOKEN_PATH
            a = _request(url, method="PUT", deadline=deadline, who=self.name,
                         headers={"X-aws-ec2-metadata-token-ttl-seconds":
                                  str(self.token_ttl_s)})
            if a.status in (403, 404, 405):
                self.imds_v1 = True
                return {}
            if a.status != 200 or not a.body.strip():
                raise NoticeSourceError(f"aws: PUT {url} answered {a.status} "
                                        f"{a.body[:120]!r}; expected a token")
            self._token = a.body.strip()
            # Renew a minute early so a token never expires between the PUT and the GET.
            self._token_until = now + max(1.0, self.token_ttl_s - 60.0)
        return {"X-aws-ec2-metadata-token": self._token}

    def _ask(self) -> Notice | None:
        deadline = time.monotonic() + self.timeout_s
        url = self.endpoint + AWS_ACTION_PATH
        a = _request(url, method="GET", headers=self._token_header(deadline),
                     deadline=deadline, who=self.name)
        if a.status == 401 and not self.imds_v1:  # token expired or revoked: renew once
            self._token = None
            a = _request(url, method="GET", headers=self._token_header(deadline),
                         deadline=deadline, who=self.name)
        if a.status == 404:
            return None
        if a.status != 200:
            raise NoticeSourceError(f"aws: GET {url} answered {a.status} {a.body[:120]!r}; "
                                    "expected 200 or 404")
        try:
            doc: Any = json.loads(a.body)
        except ValueError as e:
            raise NoticeSourceError(f"aws: GET {url}: the body is not JSON: "
                                    f"{a.body[:120]!r}") from e
        if not isinstance(doc, dict) or not isinstance(doc.get("action"), str):
            raise NoticeSourceError(f"aws: GET {url}: expected {{\"action\": ..., \"time\": "
                                    f"...}}, got {a.body[:120]!r}")
        return Notice.now("aws", grace_s=self.grace_s,
                          deadline_unix=_parse_aws_time(doc.get("time"), url),
                          detail=doc["action"])


class GcpPreemption(_Latched):
    """A GCE VM's termination notices from its metadata server (header
    ``Metadata-Flavor: Google`` on the request, required on the answer).

    ``instance/preempted``: ``TRUE`` is a notice (detail ``preempted``), ``FALSE`` is not.
    ``instance/maintenance-event``: any value but ``NONE`` is a notice whose detail is that
    value (``TERMINATE_ON_HOST_MAINTENANCE``; also ``MIGRATE_ON_HOST_MAINTENANCE``, since a
    VM with GPUs cannot be live-migrated); a 404 there means the key is not served (None).
    GCP gives no deadline: it is now + ``grace_s``. Source ``gcp``."""

    def __init__(self, *, endpoint: str = "http://metadata.google.internal",
                 grace_s: float = 30.0, every_s: float = 1.0, timeout_s: float = 1.0) -> None:
        super().__init__()
        self.endpoint = _endpoint("GcpPreemption.endpoint", endpoint)
        self.grace_s = check_seconds("GcpPreemption.grace_s", grace_s)
        self.every_s = check_seconds("GcpPreemption.every_s", every_s)
        self.timeout_s = check_seconds("GcpPreemption.timeout_s", timeout_s)
        self.name = "gcp"

    def _get(self, path: str, deadline: float, *, missing_ok: bool) -> str | None:
        url = self.endpoint + path
        a = _request(url, method="GET", headers={"Metadata-Flavor": "Google"},
                     deadline=deadline, who=self.name)
        if a.status == 404 and missing_ok:
            return None
        if a.status != 200:
            raise NoticeSourceError(f"gcp: GET {url} answered {a.status} {a.body[:120]!r}; "
                                    "expected 200")
        if a.headers.get("metadata-flavor") != "Google":
            raise NoticeSourceError(f"gcp: GET {url}: the answer lacks 'Metadata-Flavor: "
                                    "Google'; that is not a GCE metadata server")
        return a.body.strip()

    def _ask(self) -> Notice | None:
        deadline = time.monotonic() + self.timeout_s
        preempted = self._get(GCP_PREEMPTED_PATH, deadline, missing_ok=False)
        if preempted == "TRUE":
            return Notice.now("gcp", grace_s=self.grace_s, detail="preempted")
        if preempted != "FALSE":
            raise NoticeSourceError(f"gcp: {self.endpoint + GCP_PREEMPTED_PATH} answered "
                                    f"{str(preempted)[:120]!r}; expected TRUE or FALSE")
        event = self._get(GCP_MAINTENANCE_PATH, deadline, missing_ok=True)
        if event is None or event == "NONE":
            return None
        if not event or not event.replace("_", "").isalnum():
            raise NoticeSourceError(f"gcp: {self.endpoint + GCP_MAINTENANCE_PATH} answered "
                                    f"{event[:120]!r}; expected NONE or an event name")
        return Notice.now("gcp", grace_s=self.grace_s, detail=event)
