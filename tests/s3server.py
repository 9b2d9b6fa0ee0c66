"""moto's S3 server on a local port, set up as a user would point a client at S3, for the remote tests."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

ACCESS_KEY = "AKIADTYPEAUDITTEST42"
SECRET_KEY = "dtypeaudit-secret-key-that-must-never-be-printed"


@contextmanager
def moto_s3(bucket: str, files: Path, keep: Callable[[Path], bool] = lambda p: True) -> Iterator[tuple[dict[str, str], Any]]:
    """A bucket on a fresh moto server holding ``files`` (those ``keep`` accepts), with the environment
    (AWS_* variables, AWS_ENDPOINT_URL) set; yields that environment and a boto3 client. Empties and
    deletes the bucket afterwards: moto's server keeps its buckets in the process, for the next server too.
    Skips the test that asked for it where s3fs or moto (the test extra) is not installed."""
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    import boto3
    import s3fs
    from moto import server as moto_server

    from dtypeaudit.formats import remote

    s3fs.S3FileSystem.clear_instance_cache()  # fsspec keeps filesystems, with another server's endpoint
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {
        "AWS_ACCESS_KEY_ID": ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
    }
    mp = pytest.MonkeyPatch()
    for k, v in env.items():
        mp.setenv(k, v)
    client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"])
    client.create_bucket(Bucket=bucket)
    for p in sorted(files.rglob("*")):
        if p.is_file() and keep(p):
            client.upload_file(str(p), bucket, p.relative_to(files).as_posix())
    try:
        yield env, client
    finally:
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            for o in page.get("Contents", []):
                client.delete_object(Bucket=bucket, Key=o["Key"])
        client.delete_bucket(Bucket=bucket)
        mp.undo()
        remote.forget()
        s3fs.S3FileSystem.clear_instance_cache()
        server.stop()
