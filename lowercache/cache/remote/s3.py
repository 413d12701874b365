"""The S3 backend (or any S3-compatible store): ``s3://bucket[/prefix]`` URLs."""

from __future__ import annotations

import os
import re
from urllib.parse import urlsplit

from ...errors import LowercacheError
from .backend import DEFAULT_PREFIX, DEFAULT_TIMEOUT, Remote, import_client, redact
from .seal import EntryTooLarge

ENV_S3_ENDPOINT = "LOWERCACHE_S3_ENDPOINT"


class S3Remote(Remote):
    """An S3 bucket, or any S3-compatible store (MinIO, Ceph, moto).

    The endpoint comes from ``endpoint_url``, else ``LOWERCACHE_S3_ENDPOINT``,
    else boto3's own settings (``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL``,
    config files); credentials and region come from boto3's usual chain. S3
    has no per-object TTL: expire old entries with a bucket lifecycle rule.
    """

    def __init__(self, url: str, timeout: float = DEFAULT_TIMEOUT, endpoint_url: str | None = None):
        self.bucket, self.prefix = _parse_s3_url(url)
        self.name = f"s3://{self.bucket}/{self.prefix}"
        boto3 = import_client("boto3", "an s3:// remote")
        from botocore.config import Config

        endpoint_url = endpoint_url or os.environ.get(ENV_S3_ENDPOINT) or None
        config = Config(
            connect_timeout=timeout,
            read_timeout=timeout,
            retries={"total_max_attempts": 1},
            # Custom endpoints are usually one host without per-bucket DNS names.
            s3={"addressing_style": "path"} if endpoint_url else None,
        )
        try:
            self._client = boto3.session.Session().client("s3", endpoint_url=endpoint_url, config=config)
        except Exception as e:  # botocore raises many types for bad settings
            raise LowercacheError(f"cannot set up remote {self.name}: {e}") from None
        self._conditional = True  # until the store says it has no conditional writes

    def get(self, key: str) -> bytes | None:
        from botocore.exceptions import ClientError

        try:
            response = self._client.get_object(Bucket=self.bucket, Key=self.prefix + key)
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404", "NotFound"):
                return None
            raise
        body = response["Body"]
        try:
            length = response.get("ContentLength")
            if length is not None and length > self.max_value_size:
                raise EntryTooLarge(f"object is {length} bytes, too large to be an entry")
            return body.read()
        finally:
            body.close()

    def put(self, key: str, data: bytes) -> None:
        self._client.put_object(Bucket=self.bucket, Key=self.prefix + key, Body=data)

    def add(self, key: str, data: bytes) -> bool:
        """A conditional write (``If-None-Match: *``); a HEAD first on stores without one."""
        from botocore.exceptions import ClientError

        if self._conditional:
            try:
                self._client.put_object(Bucket=self.bucket, Key=self.prefix + key, Body=data, IfNoneMatch="*")
                return True
            except ClientError as e:
                code = e.response.get("Error", {}).get("Code")
                if code in ("PreconditionFailed", "412", "ConditionalRequestConflict", "409"):
                    return False
                if code not in ("NotImplemented", "501"):
                    raise
                self._conditional = False
        try:
            self._client.head_object(Bucket=self.bucket, Key=self.prefix + key)
            return False
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") not in ("NoSuchKey", "404", "NotFound"):
                raise
        self.put(key, data)
        return True

    def close(self) -> None:
        self._client.close()


_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


def _parse_s3_url(url: str) -> tuple[str, str]:
    """``(bucket, prefix)``; the prefix ends with ``/`` and defaults to ``lowercache/``."""
    parts = urlsplit(url)
    if parts.scheme != "s3" or parts.query or parts.fragment or "@" in parts.netloc or ":" in parts.netloc:
        raise LowercacheError(f"bad remote URL {redact(url)!r}; use s3://bucket/prefix")
    if not _BUCKET.fullmatch(parts.netloc):
        raise LowercacheError(f"bad remote URL {redact(url)!r}: {parts.netloc!r} is not an S3 bucket name")
    prefix = parts.path.strip("/")
    return parts.netloc, f"{prefix}/" if prefix else DEFAULT_PREFIX
