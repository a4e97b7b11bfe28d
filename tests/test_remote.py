"""scripts/remote.sh against a real OpenSSH server on 127.0.0.1.

A session fixture starts sshd on a free port as the current user, with a temporary host key and a
temporary client key in authorized_keys; a temporary folder plays the server's project folder. tmux and
rsync are the real ones; the runs live on a tmux socket of this test session, killed at the end. Where
sshd, tmux or rsync are missing the tests skip, except under CI=true, where they fail.
"""

import fcntl
import getpass
import glob
import json
import os
import pty
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import termios
import time
import uuid
from dataclasses import dataclass

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REMOTE_SH = os.path.join(ROOT, "scripts", "remote.sh")
SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
# A line of .env that remote.sh must never read or show.
UNRELATED_SECRET = f"search-api-key-{uuid.uuid4().hex}"

# configs/smoke-cpu.yaml shrunk to seconds: a tiny model, one short batch a step, no sample at the end.
TINY = [
    "model.d_model=32",
    "model.n_layers=1",
    "model.n_heads=2",
    "model.n_kv_heads=1",
    "model.ffn_hidden=64",
    "model.seq_len=32",
    "train.micro_batch_size=2",
    "train.grad_accum_steps=1",
    "train.warmup_steps=1",
    "train.eval_interval=0",
    "train.log_interval=1",
    "train.eval_batches=1",
    "train.sample_tokens=0",
    "hardware.peak_tflops=1.0",  # skips the start-up matmul that measures it
]


def skip_or_fail(message):
    if os.environ.get("CI") == "true":
        pytest.fail(f"{message} (CI=true: these tests must run in CI, install the packages in .ci/run)")
    pytest.skip(message)


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def keygen(path):
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "", "-f", str(path)], check=True)
    return str(path)


@dataclass
class SshServer:
    home: str
    port: int
    client_key: str
    stranger_key: str
    known_hosts: str
    tmux_socket: str

    def settings(self, remote_dir, **changes):
        """The .env of a developer whose server is this sshd; `changes` replace or (None) drop keys."""
        settings = {
            "REMOTE_HOST": "127.0.0.1",
            "REMOTE_PORT": str(self.port),
            "REMOTE_USER": getpass.getuser(),
            "REMOTE_DIR": str(remote_dir),
            "REMOTE_KEY": self.client_key,
            "REMOTE_PYTHON": sys.executable,
            "REMOTE_TMUX_SOCKET": self.tmux_socket,
            "REMOTE_SSH_OPTS": f"-F /dev/null -o UserKnownHostsFile={self.known_hosts} "
            "-o GlobalKnownHostsFile=/dev/null -o StrictHostKeyChecking=yes",
        }
        settings.update(changes)
        return {key: value for key, value in settings.items() if value is not None}

    def write_env(self, path, settings):
        lines = ["# written by tests/test_remote.py", f"SEARCH_API_KEY={UNRELATED_SECRET}"]
        lines += [f'{key}="{value}"' for key, value in settings.items()]
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")
        return str(path)


def remote_env(env_file, **extra):
    """The process environment for remote.sh: ours minus anything that could steer ssh or tmux."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("REMOTE_")}
    for name in ("TMUX", "SSH_AUTH_SOCK", "ENLACE_ENV_FILE"):
        env.pop(name, None)
    env["ENLACE_ENV_FILE"] = str(env_file)
    env.update(extra)
    return env


def remote(env_file, *args, script=REMOTE_SH, timeout=60):
    return subprocess.run(
        [script, *args],
        env=remote_env(env_file),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def output_of(result):
    return result.stdout + result.stderr


def assert_nothing_secret(result, server):
    text = output_of(result)
    assert UNRELATED_SECRET not in text
    for key in (server.client_key, server.stranger_key):
        with open(key) as f:
            body = [line for line in f.read().splitlines() if line and "PRIVATE KEY" not in line]
        assert not any(line in text for line in body), "key material in remote.sh's output"
    assert "PRIVATE KEY" not in text


@pytest.fixture(scope="session")
def ssh_server(tmp_path_factory):
    missing = [tool for tool in ("ssh", "ssh-keygen", "tmux", "rsync", "git") if shutil.which(tool) is None]
    if not os.access(SSHD, os.X_OK):
        missing.append("sshd")
    if missing:
        skip_or_fail(
            f"remote.sh tests need {', '.join(missing)} (Debian: openssh-server openssh-client tmux rsync)"
        )
    if os.geteuid() == 0 and not os.path.isdir("/run/sshd"):
        os.makedirs(
            "/run/sshd", mode=0o755
        )  # sshd's privilege separation folder, as the Debian unit makes it

    home = tmp_path_factory.mktemp("sshd")
    host_key = keygen(home / "host_key")
    client_key = keygen(home / "client_key")
    stranger_key = keygen(home / "stranger_key")
    shutil.copy(client_key + ".pub", home / "authorized_keys")
    port = free_port()
    (home / "sshd_config").write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {host_key}\nPidFile {home}/sshd.pid\n"
        f"AuthorizedKeysFile {home}/authorized_keys\nPubkeyAuthentication yes\nPasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\nPermitRootLogin prohibit-password\nUsePAM no\nStrictModes no\n"
    )
    with open(host_key + ".pub") as f:
        (home / "known_hosts").write_text(f"[127.0.0.1]:{port} {f.read()}")

    log = open(home / "sshd.log", "wb")
    sshd = subprocess.Popen([SSHD, "-D", "-e", "-f", str(home / "sshd_config")], stdout=log, stderr=log)
    deadline = time.monotonic() + 15
    while True:
        if sshd.poll() is not None:
            log.close()
            pytest.fail(f"sshd exited with {sshd.returncode}: {(home / 'sshd.log').read_text()}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                pytest.fail("sshd did not listen within 15 s")
            time.sleep(0.05)

    server = SshServer(
        home=str(home),
        port=port,
        client_key=client_key,
        stranger_key=stranger_key,
        known_hosts=str(home / "known_hosts"),
        tmux_socket=f"enlace-test-{os.getpid()}",
    )
    yield server
    # The server side's tmux: sessions opened by sshd see no TMUX_TMPDIR, so the socket is under /tmp.
    socket_path = f"/tmp/tmux-{os.getuid()}/{server.tmux_socket}"
    subprocess.run(["tmux", "-S", socket_path, "kill-server"], capture_output=True)
    if os.path.exists(socket_path):
        os.remove(socket_path)
    sshd.terminate()
    sshd.wait(timeout=10)
    log.close()


@pytest.fixture(scope="session")
def project_on_server(ssh_server, tmp_path_factory):
    """This checkout synced to the server and its smoke data built there: what a real run needs."""
    remote_dir = tmp_path_factory.mktemp("server") / "enlace"
    env_file = ssh_server.write_env(tmp_path_factory.mktemp("env") / ".env", ssh_server.settings(remote_dir))
    result = remote(env_file, "sync")
    assert result.returncode == 0, output_of(result)
    result = remote(env_file, "exec", "bash", "scripts/prepare_smoke_data.sh", timeout=120)
    assert result.returncode == 0, output_of(result)
    return str(remote_dir), env_file


def checkout_copy(path):
    """A bare local checkout holding only remote.sh: fetch writes into its runs/, not this repo's."""
    os.makedirs(os.path.join(path, "scripts"))
    shutil.copy(REMOTE_SH, os.path.join(path, "scripts", "remote.sh"))
    return os.path.join(path, "scripts", "remote.sh")


def wait_for(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.1)


def metrics_steps(run_dir):
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        # While the trainer writes, the last line may still be partial: read complete lines only.
        records = [json.loads(line) for line in f if line.endswith("\n") and line.strip()]
    return [record["step"] for record in records if "loss" in record]


# ---------------------------------------------------------------------------------------------------------
# sync


def test_sync_sends_what_git_knows_and_never_venv_runs_data_caches_or_env(ssh_server, tmp_path):
    checkout = tmp_path / "checkout"
    script = checkout_copy(checkout)
    shutil.copy(os.path.join(ROOT, ".gitignore"), checkout / ".gitignore")
    wanted = {
        "train.py": "print('train')\n",
        "configs/smoke-cpu.yaml": "run_name: smoke-cpu\n",
        "configs/data/smoke.yaml": "data: {}\n",
        "scripts/prepare_smoke_data.sh": "#!/bin/sh\n",
        ".env.example": "REMOTE_HOST=\n",
        "notes with spaces $(x).md": "untracked but not ignored: it is code the owner is working on\n",
    }
    unwanted = {
        ".venv/bin/python": "venv",
        "runs/smoke-cpu/ckpt_100.pt": "checkpoint",
        "data/smoke/train.bin": "tokens",
        "data/corpus/shard_000.bin": "tokens",
        "__pycache__/train.cpython-311.pyc": "bytecode",
        "configs/__pycache__/x.pyc": "bytecode",
        ".pytest_cache/README.md": "cache",
        ".env": f"SECRET={UNRELATED_SECRET}\n",
    }
    for name, content in {**wanted, **unwanted}.items():
        (checkout / name).parent.mkdir(parents=True, exist_ok=True)
        (checkout / name).write_text(content)
    subprocess.run(["git", "init", "-q", str(checkout)], check=True)
    subprocess.run(
        ["git", "-C", str(checkout), "add", "train.py", "configs", "scripts", ".gitignore"], check=True
    )

    server_dir = tmp_path / "server" / "enlace"
    (server_dir / "runs" / "earlier").mkdir(parents=True)
    (server_dir / "runs" / "earlier" / "ckpt_5.pt").write_text("a run of the server's own")
    env_file = ssh_server.write_env(tmp_path / ".env", ssh_server.settings(server_dir))

    result = remote(env_file, "sync", script=script)
    assert result.returncode == 0, output_of(result)
    on_server = {
        os.path.relpath(os.path.join(folder, name), server_dir)
        for folder, _, names in os.walk(server_dir)
        for name in names
    }
    expected = set(wanted) | {"scripts/remote.sh", ".gitignore", "runs/earlier/ckpt_5.pt"}
    assert on_server == expected
    for name, content in wanted.items():
        assert (server_dir / name).read_text() == content
    assert os.access(server_dir / "scripts" / "remote.sh", os.X_OK)
    assert_nothing_secret(result, ssh_server)

    (checkout / "train.py").write_text("print('train, edited')\n")
    result = remote(env_file, "sync", script=script)
    assert result.returncode == 0, output_of(result)
    assert (server_dir / "train.py").read_text() == "print('train, edited')\n"


# ---------------------------------------------------------------------------------------------------------
# quoting: shell syntax in an argument is data on the server


def test_exec_passes_arguments_verbatim_and_shell_syntax_never_runs_on_the_server(ssh_server, tmp_path):
    server_dir = tmp_path / "server"
    server_dir.mkdir()
    env_file = ssh_server.write_env(tmp_path / ".env", ssh_server.settings(server_dir))
    marker = tmp_path / "injected"
    arguments = [
        "two words",
        "it's",
        '"double"',
        f"$(touch {marker})",
        f"`touch {marker}`",
        f"x; touch {marker}",
        f"x' ; touch {marker}; echo '",
        f"x\nnewline; touch {marker}",
        "$HOME",
        "*",
        "",
    ]
    result = remote(env_file, "exec", "printf", "[%s]\\n", *arguments)
    assert result.returncode == 0, output_of(result)
    assert result.stdout == "".join(f"[{argument}]\n" for argument in arguments)
    assert not marker.exists()


def test_run_with_shell_syntax_in_config_path_and_overrides_trains_and_runs_nothing_else(
    ssh_server, project_on_server, tmp_path
):
    remote_dir, env_file = project_on_server
    tag = uuid.uuid4().hex[:8]
    markers = [f"pwned-{tag}-{i}" for i in range(4)]
    nasty_config = f'configs/it\'s "odd"; touch {markers[0]} $(touch {markers[1]}) `touch {markers[2]}`.yaml'
    shutil.copy(os.path.join(remote_dir, "configs", "smoke-cpu.yaml"), os.path.join(remote_dir, nasty_config))
    prompt = f"En el principio $(touch {markers[3]}) `touch {markers[3]}`; touch {markers[3]} 'a' \"b\""

    result = remote(
        env_file,
        "run",
        nasty_config,
        "run_name=quoting",
        "train.max_steps=2",
        *TINY,
        f"train.sample_prompt={prompt}",
    )
    assert result.returncode == 0, output_of(result)
    logs = remote(env_file, "logs", "quoting", timeout=120)
    assert "train.py exited with status 0" in logs.stdout, output_of(logs)

    with open(os.path.join(remote_dir, "runs", "quoting", "config.yaml")) as f:
        saved = yaml.safe_load(f)
    assert saved["train"]["sample_prompt"] == prompt
    assert metrics_steps(os.path.join(remote_dir, "runs", "quoting"))[-1] == 2

    missing_config = f"configs/none; touch {markers[0]}.yaml"
    result = remote(env_file, "run", missing_config, *TINY)
    assert result.returncode != 0
    assert f"config {missing_config} not found" in result.stderr

    # An injected `touch NAME` would have run in the login directory or in REMOTE_DIR (ssh, tmux).
    found = [name for name in markers if os.path.exists(os.path.join(os.path.expanduser("~"), name))]
    found += [path for name in markers for path in glob.glob(f"{remote_dir}/**/{name}", recursive=True)]
    assert found == [], f"an argument ran as shell code on the server: {found}"


# ---------------------------------------------------------------------------------------------------------
# runs under tmux


def read_pty_until(fd, needle, timeout):
    seen = b""
    deadline = time.monotonic() + timeout
    while needle not in seen:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            pytest.fail(f"no {needle!r} on the attached terminal within {timeout} s; saw {seen[-500:]!r}")
        ready, _, _ = select.select([fd], [], [], remaining)
        if ready:
            try:
                seen += os.read(fd, 65536)
            except OSError:
                break
    return seen


def checkpoint_steps(run_dir):
    names = [os.path.basename(path) for path in glob.glob(os.path.join(run_dir, "ckpt_*.pt"))]
    return sorted(int(name[len("ckpt_") : -len(".pt")]) for name in names)


def trainer_pid(run_dir):
    """The pid train.py runs as, from the pidfile remote.sh's tmux session writes (the server is local)."""
    path = os.path.join(run_dir, "train.pid")
    wait_for(lambda: os.path.exists(path) and open(path).read().strip(), timeout=20, what=path)
    with open(path) as f:
        return int(f.read())


def test_run_lives_in_tmux_survives_a_killed_ssh_client_and_logs_status_fetch_see_it_finish(
    ssh_server, project_on_server, tmp_path
):
    remote_dir, env_file = project_on_server
    run_dir = os.path.join(remote_dir, "runs", "survivor")
    max_steps = 20
    args = ["configs/smoke-cpu.yaml", "run_name=survivor", f"train.max_steps={max_steps}", *TINY]
    args += ["train.ckpt_interval=10"]

    result = remote(env_file, "run", *args)
    assert result.returncode == 0, output_of(result)
    assert "started run survivor" in result.stdout
    # Hold the trainer still (SIGSTOP) while the connection is cut, so a fast machine cannot finish the
    # run first: what is proven is that nothing the dying connection sends reaches it. A SIGHUP sent
    # now would stay pending and kill it at SIGCONT.
    pid = trainer_pid(run_dir)
    os.kill(pid, signal.SIGSTOP)
    try:
        again = remote(env_file, "run", *args)
        assert again.returncode != 0
        assert "run survivor is already live" in again.stderr

        # The owner is attached when the connection dies: kill the ssh client outright.
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
        attach = subprocess.Popen(
            [REMOTE_SH, "attach", "survivor"],
            stdin=slave,
            stdout=slave,
            stderr=slave,
            env=remote_env(env_file, TERM="xterm"),
            start_new_session=True,
        )
        os.close(slave)
        try:
            read_pty_until(master, b"[survivor]", timeout=30)  # tmux's status line: attached for real
        finally:
            os.killpg(attach.pid, signal.SIGKILL)
            attach.wait()
            os.close(master)

        status = remote(env_file, "status")
        assert status.returncode == 0, output_of(status)
        assert f"survivor (pid {pid})" in status.stdout, "the run died with the ssh connection"
    finally:
        os.kill(pid, signal.SIGCONT)

    logs = remote(env_file, "logs", timeout=180)  # no RUN: the run whose log changed last
    assert logs.returncode == 0, output_of(logs)
    assert "== survivor: live" in logs.stdout
    assert "train.py exited with status 0" in logs.stdout
    assert metrics_steps(run_dir)[-1] == max_steps
    assert checkpoint_steps(run_dir)[-1] == max_steps

    status = remote(env_file, "status")
    assert "survivor" not in status.stdout
    assert "no live runs" in status.stdout

    checkout = tmp_path / "checkout"
    fetched = remote(env_file, "fetch", "survivor", script=checkout_copy(checkout))
    assert fetched.returncode == 0, output_of(fetched)
    local = sorted(os.listdir(checkout / "runs" / "survivor"))
    checkpoints = [name for name in os.listdir(run_dir) if name.startswith("ckpt_") and name.endswith(".pt")]
    assert local == sorted(["metrics.jsonl", "config.yaml", "train.log", *checkpoints])
    assert len(checkpoints) == 2
    for name in local:
        with (
            open(checkout / "runs" / "survivor" / name, "rb") as a,
            open(os.path.join(run_dir, name), "rb") as b,
        ):
            assert a.read() == b.read(), name


def attach_and_cut(env_file, session):
    """The owner attached to the session over ssh, and the connection dying: the ssh client killed."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    attach = subprocess.Popen(
        [REMOTE_SH, "attach", session],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env=remote_env(env_file, TERM="xterm"),
        start_new_session=True,
    )
    os.close(slave)
    try:
        read_pty_until(master, f"[{session}]".encode(), timeout=30)  # tmux's status line: attached for real
    finally:
        os.killpg(attach.pid, signal.SIGKILL)
        attach.wait()
        os.close(master)


def test_a_whole_run_started_over_ssh_survives_the_connection_and_status_and_logs_follow_it(
    ssh_server, project_on_server
):
    remote_dir, env_file = project_on_server
    run_dir = os.path.join(remote_dir, "runs", "whole")
    result = remote(env_file, "chain", "rehearsal-tiny", "chain.folder=runs/whole")
    assert result.returncode == 0, output_of(result)
    assert "started the chain of rehearsal-tiny" in result.stdout and "tmux session whole" in result.stdout
    pid = trainer_pid(run_dir)  # the chain's own process, held still while the connection dies
    os.kill(pid, signal.SIGSTOP)
    try:
        again = remote(env_file, "chain", "rehearsal-tiny", "chain.folder=runs/whole")
        assert again.returncode != 0 and "run whole is already live" in again.stderr
        attach_and_cut(env_file, "whole")
        status = remote(env_file, "status")
        assert f"whole (pid {pid})" in status.stdout, "the whole run died with the ssh connection"
    finally:
        os.kill(pid, signal.SIGCONT)

    # logs follows the live run (test_run_lives_in_tmux... follows one to its end): the chain's plan is
    # there; then the session is ended.
    follow = subprocess.Popen(
        [REMOTE_SH, "logs", "whole"],
        env=remote_env(env_file),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        seen = read_until(follow.stdout, "plan of rehearsal-tiny", timeout=120)
    finally:
        os.killpg(follow.pid, signal.SIGKILL)
        follow.wait()
    assert seen.startswith("== whole: live") and "plan of rehearsal-tiny" in seen, seen
    status = remote(env_file, "status")
    assert f"whole (pid {pid}): " in status.stdout
    socket_path = f"/tmp/tmux-{os.getuid()}/{ssh_server.tmux_socket}"
    subprocess.run(["tmux", "-S", socket_path, "kill-session", "-t", "=whole"], check=True)
    wait_for(
        lambda: "no live runs" in remote(env_file, "status").stdout, timeout=30, what="the session to end"
    )


def read_until(stream, needle, timeout):
    """What a pipe gave until needle appeared (or the time ran out: the test then fails on what it saw)."""
    seen, deadline = b"", time.monotonic() + timeout
    while needle.encode() not in seen and time.monotonic() < deadline:
        ready, _, _ = select.select([stream], [], [], deadline - time.monotonic())
        if not ready:
            break
        chunk = os.read(stream.fileno(), 65536)
        if not chunk:
            break
        seen += chunk
    return seen.decode(errors="replace")


def test_a_chain_with_a_bad_board_or_folder_is_refused_before_anything_starts(ssh_server, project_on_server):
    remote_dir, env_file = project_on_server
    unknown = remote(env_file, "chain", "3090")
    assert unknown.returncode != 0 and "no chain file configs/chain/3090.yaml" in unknown.stderr
    outside = remote(env_file, "chain", "rehearsal-tiny", "chain.folder=elsewhere/x")
    assert outside.returncode == 2 and "keeps it at runs/NAME" in outside.stderr
    assert remote(env_file, "chain", "rehearsal-tiny", "--budget-min").returncode == 2
    assert not os.path.exists(os.path.join(remote_dir, "elsewhere"))


def test_stop_sends_sigint_so_the_trainer_checkpoints_and_exits_and_run_resume_continues(
    ssh_server, project_on_server
):
    remote_dir, env_file = project_on_server
    run_dir = os.path.join(remote_dir, "runs", "stopper")
    args = ["configs/smoke-cpu.yaml", "run_name=stopper", *TINY, "train.ckpt_interval=100000"]
    result = remote(env_file, "run", *args, "train.max_steps=100000")
    assert result.returncode == 0, output_of(result)
    wait_for(lambda: len(metrics_steps(run_dir)) >= 3, timeout=60, what="stopper's first steps")

    stop = remote(env_file, "stop", "stopper", timeout=120)
    assert stop.returncode == 0, output_of(stop)
    assert "sent SIGINT to train.py of run stopper" in stop.stdout
    assert "run stopper stopped" in stop.stdout

    # The only checkpoint is the one SIGINT asked for, at the last step the trainer finished.
    stopped_at = metrics_steps(run_dir)[-1]
    assert checkpoint_steps(run_dir) == [stopped_at]
    assert stopped_at < 100000
    with open(os.path.join(run_dir, "train.log")) as f:
        assert "train.py exited with status 0" in f.read()
    assert not os.path.exists(os.path.join(run_dir, "train.pid"))
    assert "stopper" not in remote(env_file, "status").stdout

    # --resume reaches train.py: the run goes on from the checkpoint, not from step 1.
    result = remote(env_file, "run", *args, f"train.max_steps={stopped_at + 3}", "--resume")
    assert result.returncode == 0, output_of(result)
    logs = remote(env_file, "logs", "stopper", timeout=120)
    assert "train.py exited with status 0" in logs.stdout, output_of(logs)
    with open(os.path.join(run_dir, "train.log")) as f:
        assert f.read().count("train.py exited with status 0") == 2  # train.log is appended to
    assert metrics_steps(run_dir) == list(range(1, stopped_at + 4))


# ---------------------------------------------------------------------------------------------------------
# errors: clear, non-zero, nothing secret


def test_env_file_is_read_as_data_never_run_as_shell(ssh_server, tmp_path):
    marker = tmp_path / "sourced"
    settings = ssh_server.settings(tmp_path)
    lines = [
        f"touch {marker}",
        f"SEARCH_API_KEY=$(touch {marker})",
        f"export REMOTE_HOST={settings['REMOTE_HOST']}\r",
        f"REMOTE_PORT={settings['REMOTE_PORT']}   # sshd of the tests",
        f"REMOTE_USER='{settings['REMOTE_USER']}'",
        *(f'{key}="{settings[key]}"' for key in ("REMOTE_DIR", "REMOTE_KEY", "REMOTE_PYTHON")),
        *(f'{key}="{settings[key]}"' for key in ("REMOTE_TMUX_SOCKET", "REMOTE_SSH_OPTS")),
    ]
    (tmp_path / ".env").write_text("\n".join(lines) + "\n")
    result = remote(tmp_path / ".env", "status")
    assert result.returncode == 0, output_of(result)
    assert "live runs" in result.stdout  # it reached the server: every setting was read as written
    assert not marker.exists()


def test_missing_env_file_is_named(ssh_server, tmp_path):
    result = remote(tmp_path / "no-such.env", "status")
    assert result.returncode != 0
    assert f"settings file {tmp_path / 'no-such.env'} not found" in result.stderr
    assert ".env.example" in result.stderr


@pytest.mark.parametrize("name", ["REMOTE_HOST", "REMOTE_USER", "REMOTE_DIR"])
def test_missing_setting_is_named(ssh_server, tmp_path, name):
    settings = ssh_server.settings(tmp_path, **{name: None})
    env_file = ssh_server.write_env(tmp_path / ".env", settings)
    result = remote(env_file, "status")
    assert result.returncode != 0
    assert f"{name} is not set in {env_file}" in result.stderr
    assert_nothing_secret(result, ssh_server)


def test_misspelt_setting_is_named(ssh_server, tmp_path):
    env_file = ssh_server.write_env(tmp_path / ".env", ssh_server.settings(tmp_path, REMOTE_PROT="22"))
    result = remote(env_file, "status")
    assert result.returncode != 0
    assert "unknown setting REMOTE_PROT" in result.stderr


def test_unreachable_host_gives_a_clear_message(ssh_server, tmp_path):
    closed_port = free_port()
    env_file = ssh_server.write_env(
        tmp_path / ".env", ssh_server.settings(tmp_path, REMOTE_PORT=str(closed_port))
    )
    result = remote(env_file, "status")
    assert result.returncode != 0
    assert f"cannot reach 127.0.0.1 port {closed_port} over ssh" in result.stderr
    assert_nothing_secret(result, ssh_server)


def test_refused_key_gives_a_clear_message_without_key_material(ssh_server, tmp_path):
    settings = ssh_server.settings(tmp_path, REMOTE_KEY=ssh_server.stranger_key)
    env_file = ssh_server.write_env(tmp_path / ".env", settings)
    for command in (["status"], ["sync"], ["run", "configs/smoke-cpu.yaml"]):
        result = remote(env_file, *command)
        assert result.returncode != 0, command
        assert f"{getpass.getuser()}@127.0.0.1 refused the login" in result.stderr, command
        assert ssh_server.stranger_key in result.stderr  # the path helps; the contents never appear
        assert_nothing_secret(result, ssh_server)


def test_missing_remote_python_is_named(ssh_server, tmp_path):
    (tmp_path / "config.py").write_text("")
    (tmp_path / "train.py").write_text("")
    settings = ssh_server.settings(tmp_path, REMOTE_PYTHON="/nonexistent/venv/bin/python")
    env_file = ssh_server.write_env(tmp_path / ".env", settings)
    result = remote(env_file, "run", "configs/smoke-cpu.yaml")
    assert result.returncode != 0
    assert "Python /nonexistent/venv/bin/python not found" in result.stderr
    assert "REMOTE_PYTHON" in result.stderr

    env_file = ssh_server.write_env(tmp_path / ".env", ssh_server.settings(tmp_path, REMOTE_PYTHON=None))
    result = remote(env_file, "run", "configs/smoke-cpu.yaml")
    assert result.returncode != 0
    assert f"Python .venv/bin/python not found in {tmp_path}" in result.stderr


def test_missing_remote_dir_says_to_sync_first(ssh_server, tmp_path):
    env_file = ssh_server.write_env(tmp_path / ".env", ssh_server.settings(tmp_path / "never-synced"))
    result = remote(env_file, "run", "configs/smoke-cpu.yaml")
    assert result.returncode != 0
    assert (
        f"REMOTE_DIR {tmp_path / 'never-synced'} does not exist: run 'scripts/remote.sh sync' first"
        in result.stderr
    )


def test_commands_on_an_unknown_run_say_so(ssh_server, tmp_path):
    env_file = ssh_server.write_env(tmp_path / ".env", ssh_server.settings(tmp_path))
    expected = {
        "stop": "no live run ghost",
        "logs": "no log for run ghost",
        "fetch": "no run ghost",
    }
    for command, message in expected.items():
        result = remote(env_file, command, "ghost", script=checkout_copy(tmp_path / command))
        assert result.returncode != 0, command
        assert message in result.stderr, command
    result = remote(env_file, "logs", "../../etc")
    assert result.returncode == 2
    assert "'../../etc' is not a run name" in result.stderr


def test_invalid_config_or_run_name_is_refused_before_anything_starts(ssh_server, project_on_server):
    remote_dir, env_file = project_on_server
    result = remote(env_file, "run", "configs/smoke-cpu.yaml", "run_name=badcfg", "train.sede=1")
    assert result.returncode == 2
    assert "train.sede" in result.stderr  # config.py's own message, naming the key
    assert not os.path.exists(os.path.join(remote_dir, "runs", "badcfg"))

    # Valid for the schema, but '.' cannot be in a tmux session name.
    result = remote(env_file, "run", "configs/smoke-cpu.yaml", "run_name=v1.2")
    assert result.returncode == 2
    assert "run_name 'v1.2' cannot name a tmux session" in result.stderr
    assert not os.path.exists(os.path.join(remote_dir, "runs", "v1.2"))
