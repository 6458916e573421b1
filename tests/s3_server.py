"""An S3-protocol server on 127.0.0.1 for the table tests: moto's standalone server, a process
of its own that keeps buckets in its memory and answers the S3 REST API (signed requests,
ranges, listings) as delta-rs and pyarrow speak it; waited for with a deadline, stopped with
its process group."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from server_process import free_port, stop_group, wait_answering

START_DEADLINE_S = 30.0
REGION = "us-east-1"


def s3_server_binary() -> str | None:
    beside = os.path.join(os.path.dirname(sys.executable), "moto_server")
    return beside if os.access(beside, os.X_OK) else shutil.which("moto_server")


class S3Server:
    def __init__(self, directory: Path) -> None:
        binary = s3_server_binary()
        if binary is None:
            raise RuntimeError("moto_server is not installed: `make test-python` installs it with the test group "
                               "(moto[s3], flask)")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = directory / "s3-server.log"
        self._log = open(self.log_path, "wb")
        self.process = subprocess.Popen([binary, "-H", "127.0.0.1", "-p", str(self.port)], stdout=self._log,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_answering(self.process, self.url + "/moto-api/", "the S3 server", START_DEADLINE_S, self.log_text)
        except BaseException:
            self.stop()
            raise

    def storage_options(self) -> dict[str, str]:
        """delta-rs's keys for this store: its endpoint over plain http, and any credentials (it
        checks the signature's form, not the key)."""
        return {"AWS_ENDPOINT_URL": self.url, "AWS_ALLOW_HTTP": "true", "AWS_ACCESS_KEY_ID": "fanrun-test",
                "AWS_SECRET_ACCESS_KEY": "fanrun-test-secret", "AWS_REGION": REGION,
                "AWS_S3_ALLOW_UNSAFE_RENAME": "true"}

    def client(self):
        import boto3

        options = self.storage_options()
        return boto3.client("s3", endpoint_url=self.url, region_name=REGION,
                            aws_access_key_id=options["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=options["AWS_SECRET_ACCESS_KEY"])

    def upload(self, folder: Path, bucket: str, prefix: str) -> list[str]:
        """Every file below `folder` into s3://bucket/prefix/..., the bucket made; their keys."""
        client = self.client()
        client.create_bucket(Bucket=bucket)
        keys = []
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            key = f"{prefix}/{path.relative_to(folder).as_posix()}"
            client.upload_file(str(path), bucket, key)
            keys.append(key)
        return keys

    def log_text(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        stop_group(self.process)
        self._log.close()
