"""A real Mosquitto broker for tests, started from the project's deploy/mosquitto.conf.

Use the fixtures by importing them into your test folder's conftest.py (pytest finds
imported fixtures; importing them into the test module itself trips ruff's F811):

    # tests/<area>/conftest.py
    from support.mosquitto import mosquitto, mosquitto_broker  # noqa: F401

    # tests/<area>/test_x.py
    @pytest.mark.mqtt
    async def test_x(mosquitto: str) -> None:   # "mqtt://127.0.0.1:PORT"
        ...

The broker gets a free port on 127.0.0.1 and never touches the shared one on 1883.
Without the binary the tests are skipped, except under TESSERA_REQUIRE_MQTT=1 (CI), where
they fail: the MQTT backend must never go untested there.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.ports import free_port, wait_for_port
from support.procs import REPO_ROOT, ManagedProcess

PROJECT_CONFIG = REPO_ROOT / "deploy" / "mosquitto.conf"
_CANDIDATES = ("/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto", "/opt/homebrew/sbin/mosquitto")


def mosquitto_binary() -> str | None:
    for candidate in _CANDIDATES:
        if os.access(candidate, os.X_OK):
            return candidate
    return shutil.which("mosquitto")


def render_config(port: int, source: Path = PROJECT_CONFIG) -> str:
    """The project's config with its listener moved to 127.0.0.1:`port`."""
    text = source.read_text()
    text, replaced = re.subn(
        r"^listener\s+\d+.*$", f"listener {port} 127.0.0.1", text, flags=re.MULTILINE
    )
    if replaced != 1:
        raise ValueError(f"{source} must contain exactly one `listener PORT` line")
    return text


def secure_config(config: str, cert: Path, key: Path, password_file: Path) -> str:
    """``config`` with its listener over TLS and a login required, as a hosted broker is."""
    config = re.sub(
        r"^(listener\s.*)$", rf"\1\ncertfile {cert}\nkeyfile {key}", config, flags=re.MULTILINE
    )
    config, replaced = re.subn(
        r"^allow_anonymous\s+true$", "allow_anonymous false", config, flags=re.MULTILINE
    )
    if replaced != 1:
        raise ValueError("the config must contain exactly one `allow_anonymous true` line")
    config += f"\npassword_file {password_file}\n"
    if os.geteuid() == 0:
        # Started as root, Mosquitto drops to the `mosquitto` user before it reads the
        # password file, which sits in this test's private temporary folder.
        config += "user root\n"
    return config


class MosquittoBroker:
    """One broker process on a fixed free port; restartable on the same port.

    With ``tls`` (certificate chain, key) it listens over TLS, and with ``login`` (user,
    password) it refuses anyone else: ``url`` then is mqtts://USER:PASS@127.0.0.1:PORT."""

    def __init__(
        self,
        work_dir: Path,
        binary: str,
        tls: tuple[Path, Path] | None = None,
        login: tuple[str, str] | None = None,
    ) -> None:
        self.work_dir = work_dir
        self.binary = binary
        self.port = free_port()
        self.tls, self.login = tls, login
        self.config_path = work_dir / "mosquitto.conf"
        config = render_config(self.port)
        if tls is not None and login is not None:
            passwords = work_dir / "passwords"
            subprocess.run(
                ["mosquitto_passwd", "-b", "-c", str(passwords), *login],
                check=True, capture_output=True, timeout=30,
            )  # fmt: skip
            config = secure_config(config, *tls, passwords)
        self.config_path.write_text(config)
        self.process: ManagedProcess | None = None
        self._starts = 0

    @property
    def url(self) -> str:
        if self.tls is not None and self.login is not None:
            return f"mqtts://{self.login[0]}:{self.login[1]}@127.0.0.1:{self.port}"
        return f"mqtt://127.0.0.1:{self.port}"

    def start(self) -> None:
        self._starts += 1
        log = self.work_dir / f"mosquitto-{self._starts}.log"
        self.process = ManagedProcess(
            [self.binary, "-c", self.config_path], log, name="mosquitto"
        ).start()
        try:
            wait_for_port("127.0.0.1", self.port, timeout=10)
        except TimeoutError as exc:
            raise RuntimeError(f"mosquitto did not start:\n{self.process.tail()}") from exc

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process = None

    def restart(self) -> None:
        self.stop()
        self.start()


def require_mosquitto_binary() -> str:
    """The broker's path; skips the test without it (fails it under TESSERA_REQUIRE_MQTT=1)."""
    binary = mosquitto_binary()
    if binary is None:
        reason = "mosquitto is not installed (apt-get install mosquitto); MQTT tests need it"
        if os.environ.get("TESSERA_REQUIRE_MQTT") == "1":
            pytest.fail(reason + " and TESSERA_REQUIRE_MQTT=1 forbids skipping")
        pytest.skip(reason)
    return binary


@pytest.fixture
def mosquitto_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MosquittoBroker]:
    """A running broker object (`.url`, `.restart()`, `.stop()`), killed after the test."""
    broker = MosquittoBroker(tmp_path_factory.mktemp("mosquitto"), require_mosquitto_binary())
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture
def mosquitto(mosquitto_broker: MosquittoBroker) -> str:
    """The URL of a fresh broker: mqtt://127.0.0.1:PORT."""
    return mosquitto_broker.url
