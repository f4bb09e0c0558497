"""Probe what a Google Cloud Storage server (GCS, or an emulator) supports, on scratch
objects under the job's prefix.

:func:`probe` makes about fifteen small requests under ``<prefix>/.tierckpt-probe-<id>/``
and deletes everything it wrote. The first request (a one-object listing) decides whether
the server can be used at all: a missing bucket or refused credentials are a
:class:`~tierckpt.errors.ConfigError`; no answer or a 5xx a
:class:`~tierckpt.errors.StorageError` (an outage). Each later check records True/False
in :class:`~tierckpt.tier2.capabilities.Capabilities`, read for GCS as:

- ``crc32c_put_verified`` / ``md5_verified``: an upload declaring a wrong ``crc32c`` /
  ``md5Hash`` is refused and no object appears (GCS: yes; fake-gcs-server 1.54: no);
- ``crc32c_head``: the object's metadata reports the CRC32C of the bytes uploaded;
- ``etag_is_md5``: the metadata reports the MD5 of the bytes uploaded (``md5Hash``: GCS's
  per-upload digest, the counterpart of an S3 ETag, which ``md5`` mode compares);
- ``multipart`` / ``crc32c_multipart``: two parts composed into one object give its bytes /
  its full-object CRC32C; ``multipart_list`` / ``multipart_abort``: temporaries can be
  listed and deleted (they are plain objects);
- ``if_none_match``: a second upload with ``ifGenerationMatch=0`` is refused and the first
  object kept.

Whether ``compose`` honours a source generation precondition is recorded in the notes only
(tierckpt pins each source to its generation, which every server tried honours).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import os
import uuid
from collections.abc import Callable

from google.api_core import exceptions as gexc
from google.cloud import storage

from tierckpt.errors import ConfigError, StorageError
from tierckpt.format import checksum
from tierckpt.tier2.capabilities import Capabilities
from tierckpt.tier2.storage.gcs import GCSStorage
from tierckpt.tier2.storage.gcsbase import SDK_ERRORS
from tierckpt.tier2.storage.gcsclient import call, crc_of


def _crc_b64(data: bytes) -> str:
    return checksum.to_b64(checksum.extend(0, data))


def _md5_b64(data: bytes) -> str:
    return base64.b64encode(hashlib.md5(data).digest()).decode("ascii")


class _Probe:
    def __init__(self, st: GCSStorage) -> None:
        self.st, self.bucket = st, st.client.bucket(st.bucket_name)
        self.base = st.object_name(f".tierckpt-probe-{uuid.uuid4().hex[:12]}")
        self.notes: list[str] = []
        self.t = st.config.timeout

    def blob(self, name: str) -> storage.Blob:
        return self.bucket.blob(f"{self.base}/{name}")

    def put(self, name: str, data: bytes, **kw: object) -> storage.Blob:
        b = self.blob(name)
        for field, value in kw.items():
            setattr(b, field, value)
        call(self.st.config, lambda: b.upload_from_string(
            data, content_type="application/octet-stream", checksum=None, retry=None,
            timeout=self.t))
        return b

    def get(self, name: str, **kw: object) -> bytes:
        return bytes(call(self.st.config, lambda: self.blob(name).download_as_bytes(
            raw_download=True, checksum=None, retry=None, timeout=self.t, **kw)))

    def exists(self, name: str) -> bool:
        return call(self.st.config, lambda: self.bucket.get_blob(
            f"{self.base}/{name}", retry=None, timeout=self.t)) is not None

    def ok(self, what: str, fn: Callable[[], str | None]) -> bool:
        """Whether check ``fn`` passes (returns None, not what was wrong); a refusal or a
        wrong answer is noted. An outage (5xx or no answer after retries) is raised: it is
        not a missing feature."""
        try:
            wrong = fn()
        except gexc.GoogleAPICallError as e:
            if e.code is not None and e.code >= 500 and e.code != 501:
                raise
            wrong = f"{e.reason or type(e).__name__} (HTTP {e.code})"
        if wrong is not None:
            self.notes.append(f"{what}: {wrong}")
        return wrong is None

    def refused(self, what: str, name: str, fn: Callable[[], object]) -> bool:
        """Whether the server refuses ``fn`` (an upload it must reject) and stores nothing."""
        try:
            fn()
        except gexc.GoogleAPICallError as e:
            if e.code is not None and e.code >= 500 and e.code != 501:
                raise
            return not self.exists(name)
        self.notes.append(f"{what}: accepted")
        return False

    def first_contact(self) -> None:
        where = f"tier 2 gs://{self.st.bucket_name}"
        try:
            call(self.st.config, lambda: list(self.st.client.list_blobs(
                self.bucket, prefix=self.base, max_results=1, retry=None, timeout=self.t)))
        except gexc.NotFound:
            raise ConfigError(f"{where}: the bucket does not exist; create it or fix the "
                              "bucket name in the tier2 URL") from None
        except (gexc.Unauthorized, gexc.Forbidden) as e:
            raise ConfigError(f"{where}: credentials refused (HTTP {e.code}); check the "
                              "application default credentials (GOOGLE_APPLICATION_CREDENTIALS"
                              ", gcloud auth application-default login) and the bucket's "
                              "IAM roles (storage.objectUser)") from None
        except SDK_ERRORS as e:
            code = getattr(e, "code", None)
            raise StorageError(f"{where}: {type(e).__name__}"
                               + (f" (HTTP {code})" if code else "")) from None

    def run(self) -> Capabilities:
        self.first_contact()
        data = os.urandom(4096)
        if not self.ok("upload/download/metadata/list/delete", lambda: self._basic(data)):
            return Capabilities(server=self.st.url, basic_ops=False, notes=tuple(self.notes))
        ranged = self.ok("ranged download", lambda: self._ranged(data))
        single = self.put("single", data)
        crc_head = crc_of(single.crc32c) == checksum.extend(0, data)
        md5_reported = single.md5_hash == _md5_b64(data)
        crc_verified = self.refused("upload with a wrong CRC32C", "badcrc", lambda: self.put(
            "badcrc", data, crc32c=_crc_b64(data + b"x")))
        md5_verified = self.refused("upload with a wrong MD5", "badmd5", lambda: self.put(
            "badmd5", data, md5_hash=_md5_b64(data + b"x")))
        inm = self._create_only()
        compose_crc: list[bool] = []
        composed = self.ok("compose", lambda: self._compose(data, compose_crc))
        return Capabilities(
            server=self.st.url, basic_ops=True, ranged_get=ranged, multipart=composed,
            multipart_list=True, multipart_abort=True, crc32c_put_verified=crc_verified,
            crc32c_head=crc_head, crc32c_multipart=composed and all(compose_crc),
            md5_verified=md5_verified, etag_is_md5=md5_reported, if_none_match=inm,
            notes=tuple(self.notes))

    def _basic(self, data: bytes) -> str | None:
        b = self.put("basic", data)
        if self.get("basic") != data:
            return "downloaded other bytes"
        if int(b.size or 0) != len(data):
            return "wrong size in the metadata"
        names = {o.name for o in self.st.client.list_blobs(self.bucket, prefix=self.base,
                                                           retry=None, timeout=self.t)}
        if b.name not in names:
            return "not listed"
        call(self.st.config, lambda: b.delete(retry=None, timeout=self.t))
        return None

    def _ranged(self, data: bytes) -> str | None:
        self.put("range", data)
        if self.get("range", start=100, end=199) != data[100:200]:
            return "a range returned other bytes"
        return None

    def _create_only(self) -> bool:
        def create(body: bytes) -> str | None:
            call(self.st.config, lambda: self.blob("inm").upload_from_string(
                body, if_generation_match=0, retry=None, timeout=self.t))
            return None

        if not self.ok("create-only upload", lambda: create(b"first")):
            return False
        try:
            create(b"second")
        except gexc.PreconditionFailed:
            return self.get("inm") == b"first"
        self.notes.append("a second upload with ifGenerationMatch=0: accepted")
        return False

    def _compose(self, data: bytes, crc_ok: list[bool]) -> str | None:
        a, b = self.put("part-1", data[:1000]), self.put("part-2", data[1000:])
        dest = self.blob("composed")
        call(self.st.config, lambda: dest.compose(
            [a, b], if_source_generation_match=[a.generation, b.generation], retry=None,
            timeout=self.t))
        if self.get("composed") != data:
            return "the composed object has other bytes"
        crc_ok.append(crc_of(dest.crc32c) == checksum.extend(0, data))
        if not crc_ok[-1]:
            self.notes.append("compose: no full-object CRC32C reported")
        try:
            self.blob("composed-2").compose([a, b], if_source_generation_match=[
                int(a.generation or 0) + 1, b.generation], retry=None, timeout=self.t)
            self.notes.append("compose: a source generation precondition is ignored")
        except gexc.PreconditionFailed:
            pass
        return None

    def cleanup(self) -> None:
        with contextlib.suppress(*SDK_ERRORS):
            for o in self.st.client.list_blobs(self.bucket, prefix=self.base, retry=None,
                                               timeout=self.t):
                with contextlib.suppress(*SDK_ERRORS):
                    o.delete(retry=None, timeout=self.t)


def probe(storage: GCSStorage) -> Capabilities:
    """Probe ``storage``'s server (see the module docstring); scratch objects are removed."""
    p = _Probe(storage)
    try:
        return p.run()
    except SDK_ERRORS as e:  # an outage mid-way, or a check that broke off
        code = getattr(e, "code", None)
        raise StorageError(f"probing {storage.url}: {type(e).__name__}"
                           + (f" (HTTP {code})" if code else "")) from None
    finally:
        p.cleanup()
