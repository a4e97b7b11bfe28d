"""Running at home: `make install-service` installs scripts/enlace.service with the repository's paths, a
unit that systemd accepts (`systemd-analyze verify`), that runs serve/app.py as its own user from the
repository, with the run and the port as environment settings and a restart after a failure. systemctl is
replaced by echo (a test machine has no systemd running); the rest runs as it would on the server."""

import os
import re
import shlex
import shutil
import subprocess

import pytest
from conftest import ROOT
from test_docs import check_python
from test_makefile import STAMP, fresh_clone
from users_shell import users_env

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 and os.environ.get("CI") != "true", reason="installing a service needs root (CI has it)"
)


def install(clone, units, *settings):
    """`make install-service` in the clone, as root on the server, with the unit going to `units`."""
    env = users_env()
    return subprocess.run(
        ["make", "-o", STAMP, "install-service", f"UNIT_DIR={units}", "SYSTEMCTL=echo systemctl", *settings],
        cwd=clone,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def unit_settings(path):
    """{(section, key): [values]} of a systemd unit file (a key may repeat, as Environment= does)."""
    settings, section = {}, None
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line.startswith("["):
                section = line.strip("[]")
            elif line and not line.startswith(("#", ";")):
                key, value = line.split("=", 1)
                settings.setdefault((section, key), []).append(value)
    return settings


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("service")
    clone = fresh_clone(tmp_path)
    (clone / "runs" / "familia").mkdir(parents=True)
    units = tmp_path / "units"
    units.mkdir()
    user = subprocess.run(["id", "-un"], capture_output=True, text=True, check=True).stdout.strip()
    done = install(clone, units, f"SERVICE_USER={user}", "RUN=runs/familia")
    assert done.returncode == 0, done.stderr
    return clone, units / "enlace.service", user, done.stdout


def test_the_installed_unit_passes_systemd_analyze_verify(installed):
    if shutil.which("systemd-analyze") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("systemd-analyze is missing: .ci/run installs the systemd package")
        pytest.skip("systemd-analyze is not installed (apt-get install systemd)")
    _, unit, _, _ = installed
    verify = subprocess.run(
        ["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60
    )
    ours = [line for line in (verify.stdout + verify.stderr).splitlines() if "enlace.service" in line]
    assert verify.returncode == 0 and not ours, (
        verify.stdout + verify.stderr
    )  # unknown keys are only warnings


def test_the_unit_runs_serve_py_from_the_repository_as_its_own_user_and_restarts_on_failure(installed):
    clone, unit, user, printed = installed
    settings = unit_settings(unit)
    assert settings["Service", "User"] == [user]
    assert settings["Service", "WorkingDirectory"] == [str(clone)]
    assert settings["Service", "Restart"] == ["on-failure"]
    assert settings["Service", "UMask"] == ["0077"]  # the database and snapshots: this user's alone
    assert settings["Install", "WantedBy"] == ["multi-user.target"]
    environment = dict(value.split("=", 1) for value in settings["Service", "Environment"])
    # The run as given, the port and address of configs/serve/default.yaml, the device the run trained on.
    assert {k: environment[k] for k in ("ENLACE_RUN", "ENLACE_PORT", "ENLACE_HOST", "ENLACE_DEVICE")} == {
        "ENLACE_RUN": "runs/familia",
        "ENLACE_PORT": "8000",
        "ENLACE_HOST": "127.0.0.1",
        "ENLACE_DEVICE": "auto",
    }
    assert [line for line in printed.splitlines() if line.startswith("systemctl ")] == [
        "systemctl daemon-reload",
        "systemctl enable enlace.service",
        "systemctl restart enlace.service",
    ]
    assert not re.search(r"@[A-Z]+@", unit.read_text())  # every field filled in


def test_the_command_the_unit_starts_is_accepted_by_serve_py(installed):
    clone, unit, _, _ = installed
    settings = unit_settings(unit)
    environment = dict(value.split("=", 1) for value in settings["Service", "Environment"])
    (start,) = settings["Service", "ExecStart"]
    words = shlex.split(re.sub(r"\$\{(\w+)\}", lambda m: environment[m[1]], start))
    assert words[0] == f"{clone}/.venv/bin/python" and os.access(words[0], os.X_OK)
    assert words[1:] == [
        "-m",
        "serve",
        "runs/familia",
        "--host",
        "127.0.0.1",
        "--port",
        "8000",
        "--device",
        "auto",
    ]
    assert check_python(("python", *words[1:]), False, ()) is None


def test_the_unit_holds_no_secrets(installed):
    text = installed[1].read_text()
    assert not re.search(r"(?i)(password|passwd|api_key|secret|token)\s*=", text)
    assert "enl-" not in text and "BRAVE" not in text


def test_port_address_and_device_are_settings_of_the_install_and_a_missing_run_installs_nothing(
    installed, tmp_path
):
    clone, _, user, _ = installed
    units = tmp_path / "units"
    units.mkdir()
    settings = ("RUN=runs/familia", "PORT=8080", "HOST=0.0.0.0", "DEVICE=cuda")
    done = install(clone, units, f"SERVICE_USER={user}", *settings)
    assert done.returncode == 0, done.stderr
    environment = unit_settings(units / "enlace.service")["Service", "Environment"]
    assert "ENLACE_PORT=8080" in environment and "ENLACE_HOST=0.0.0.0" in environment
    assert "ENLACE_DEVICE=cuda" in environment

    (units / "enlace.service").unlink()
    missing = install(clone, units, f"SERVICE_USER={user}", "RUN=runs/nadie")
    assert missing.returncode != 0
    assert "install-service: no run runs/nadie; pass RUN=runs/NAME" in missing.stderr
    assert not (units / "enlace.service").exists()


def test_by_default_the_service_runs_as_the_system_user_enlace_created_when_missing():
    env = users_env()
    dry = subprocess.run(
        ["make", "-n", "-B", "install-service", "RUN=runs/x"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert dry.returncode == 0, dry.stderr
    assert re.search(r"id -u enlace .*\|\| useradd --system .* enlace\n", dry.stdout.replace("\\\n\t", ""))
    assert "chown -R enlace: var" in dry.stdout and "-e 's|@USER@|enlace|g'" in dry.stdout
