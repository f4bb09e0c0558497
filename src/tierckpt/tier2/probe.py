"""Probe a tier 2 once and turn the answer into the options its uploader runs with.

:func:`probe_url` opens the store and asks what it supports (an object store: a real
probe on scratch keys — :mod:`~tierckpt.tier2.storage.s3probe`,
:mod:`~tierckpt.tier2.storage.gcsprobe`, :mod:`~tierckpt.tier2.storage.azureprobe`;
``file://`` and ``memory://``: fixed, they verify every byte themselves and create
atomically). :meth:`ProbeResult.store_options` turns the chosen modes into the options of
that store's config. The result is cached on tier 1
(``upload-state/tier2-probe.json``, through the tier-1 catalogue) with the server's
identity, so the uploader process and ``tierckpt upload`` use the same modes without
probing again. Raises :class:`~tierckpt.errors.ConfigError` when the server cannot be used
(missing bucket, refused credentials, "not supported" to a call tierckpt needs — or no
integrity mode tierckpt can trust) and :class:`~tierckpt.errors.StorageError` when it does
not answer (an outage). "Not supported" (HTTP 501 ``NotImplemented``) to an optional call,
e.g. listing or aborting multipart uploads, is neither: it is a capability the modes follow
(:class:`~tierckpt.tier2.capabilities.UploadMode`).
"""

from __future__ import annotations

import dataclasses
import importlib
import time
from typing import Any

from tierckpt.errors import ConfigError
from tierckpt.tier1.catalog import Tier1Catalog
from tierckpt.tier2.capabilities import (
    Capabilities,
    IntegrityMode,
    MarkerMode,
    Modes,
    UploadMode,
    choose,
)
from tierckpt.tier2.storage import open_storage
from tierckpt.tier2.storage.url import option_names, parse_url


@dataclasses.dataclass(frozen=True)
class ProbeResult:
    """What :func:`probe_url` found: the capabilities and the modes chosen from them."""

    url: str
    capabilities: Capabilities
    modes: Modes
    probed_unix: float

    def store_options(self) -> dict[str, Any]:
        """The options that carry these modes to the object store :attr:`url` names, as far
        as its config takes them (:func:`~tierckpt.tier2.storage.url.option_names`):
        ``S3Config`` takes integrity, marker and upload; ``GCSConfig`` integrity (its
        markers are always ``ifGenerationMatch=0``, its parts always composed);
        ``AzureConfig`` none (Content-MD5 on every request and ``If-None-Match`` markers
        always). Empty for ``file://`` and ``memory://``."""
        if self.modes.integrity is None:  # unusable: require_usable says why
            return {}
        modes = {"integrity": self.modes.integrity.value, "marker": self.modes.marker.value,
                 "upload": self.modes.upload.value}
        names = option_names(parse_url(self.url).scheme)
        return {k: v for k, v in modes.items() if k in names}

    def to_json(self) -> dict[str, Any]:
        m = self.modes
        return {"url": self.url, "capabilities": self.capabilities.to_json(),
                "integrity": m.integrity.value if m.integrity else None,
                "marker": m.marker.value, "upload": m.upload.value, "weaker": list(m.weaker),
                "probed_unix": self.probed_unix}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ProbeResult:
        modes = Modes(integrity=IntegrityMode(d["integrity"]) if d.get("integrity") else None,
                      marker=MarkerMode(d["marker"]), weaker=tuple(d.get("weaker", ())),
                      upload=UploadMode(d.get("upload", UploadMode.MULTIPART.value)))
        return cls(url=str(d["url"]), capabilities=Capabilities.from_json(d["capabilities"]),
                   modes=modes, probed_unix=float(d.get("probed_unix", 0.0)))


_LOCAL = Capabilities(server="local", basic_ops=True, ranged_get=True, multipart=True,
                      multipart_list=True, multipart_abort=True,
                      crc32c_put_verified=True, crc32c_head=True, crc32c_multipart=True,
                      md5_verified=None, etag_is_md5=None, if_none_match=True,
                      notes=("a directory or in-memory store: every byte is checked against "
                             "its CRC32C by tierckpt itself; creates are atomic links",))


_PROBES = {"s3": "tierckpt.tier2.storage.s3probe", "gs": "tierckpt.tier2.storage.gcsprobe",
           "az": "tierckpt.tier2.storage.azureprobe"}
"""scheme -> the module whose ``probe(storage) -> Capabilities`` tries that store's server."""


def probe_url(url: str, **options: Any) -> ProbeResult:
    """Probe the store at ``url`` (see the module docstring); ``options`` open it
    (:func:`~tierckpt.tier2.storage.open_storage`). An object store's capabilities name
    its :func:`server_identity`, the key of the cache."""
    scheme = parse_url(url).scheme
    with open_storage(url, **options) as opened:
        st = getattr(opened, "shared", opened)  # a sibling run's: the server is the prefix's
        if scheme in _PROBES:  # the store's client library: only for its own URLs
            caps = importlib.import_module(_PROBES[scheme]).probe(st)
            caps = dataclasses.replace(caps, server=server_identity(url))
        else:
            caps = dataclasses.replace(_LOCAL, server=st.url)
    return ProbeResult(url=url, capabilities=caps, modes=choose(caps),
                       probed_unix=time.time())


def require_usable(result: ProbeResult, *, conditional_writes: bool = False) -> None:
    """ConfigError unless ``result`` allows an integrity mode (and, with
    ``conditional_writes``, create-only markers)."""
    caps, modes = result.capabilities, result.modes
    if not caps.basic_ops or not caps.ranged_get:
        lacks = "PUT/GET/HEAD/LIST/DELETE" if not caps.basic_ops else "ranged GET"
        raise ConfigError(
            f"tier 2 {result.url} cannot be used: tierckpt needs {lacks} "
            f"({'; '.join(caps.notes) or 'it failed'}). Run `tierckpt doctor` on it, or use "
            "another server")
    if modes.integrity is None:
        missing = [n for n in caps.notes] or ["no checksum or digest check works"]
        raise ConfigError(
            f"tier 2 {result.url} cannot be verified end to end: it honours neither "
            f"CRC32C checksums nor Content-MD5/ETag digests ({'; '.join(missing)}). "
            "Run `tierckpt doctor` on it, or use another server")
    if conditional_writes and modes.marker is not MarkerMode.CREATE_ONLY:
        raise ConfigError(f"tier 2 {result.url} ignores If-None-Match and "
                          "tier2_require_conditional_writes=True; use a server that honours "
                          "conditional writes, or allow the read-back marker")


def server_identity(url: str) -> str:
    """Which server ``url`` means now, from the environment (no secrets): for an object
    store its endpoint and the bucket (container) — S3: ``AWS_ENDPOINT_URL`` or ``aws``;
    GCS: ``STORAGE_EMULATOR_HOST`` or ``https://storage.googleapis.com``; Azure: the
    account's blob endpoint (:func:`~tierckpt.tier2.storage.azureclient.account_endpoint`)
    — so a probe cached for one server is never used for another; else the URL. Each
    store's client library is imported only for its own URLs."""
    u = parse_url(url)
    if u.scheme == "s3":
        from tierckpt.tier2.storage.s3client import endpoint

        return f"{endpoint() or 'aws'}|{u.location}"
    if u.scheme == "gs":
        from tierckpt.tier2.storage.gcsclient import PUBLIC_ENDPOINT, emulator_host

        return f"{emulator_host() or PUBLIC_ENDPOINT}|{u.location}"
    if u.scheme == "az":
        from tierckpt.tier2.storage.azureclient import account_endpoint

        return f"{account_endpoint() or 'azure'}|{u.location}"
    return url


def recorded(local: Tier1Catalog) -> ProbeResult | None:
    """The probe the last job (or uploader) recorded on ``local``, whatever its server, or
    None (none, or unreadable): the modes ``tierckpt ls`` shows."""
    d = local.tier2_probe()
    if not d:
        return None
    try:
        return ProbeResult.from_json(d)
    except (KeyError, ValueError, TypeError):
        return None


def cached(local: Tier1Catalog, url: str) -> ProbeResult | None:
    """The probe recorded on ``local`` for ``url`` on the same server, or None."""
    r = recorded(local)
    if r is None:
        return None
    return r if r.url == url and r.capabilities.server == server_identity(url) else None


def probe_cached(local: Tier1Catalog, url: str, **options: Any) -> ProbeResult:
    """The cached probe for ``url``, else a fresh one opened with ``options`` (recorded
    for the next reader)."""
    r = cached(local, url)
    if r is None:
        r = probe_url(url, **options)
        if local.root.is_dir():
            local.write_tier2_probe(r.to_json())
    return r
