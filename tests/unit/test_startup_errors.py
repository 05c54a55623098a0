"""An ``epd`` command that cannot start says what is wrong and what to do in two lines
(``services.startup_errors``), the traceback staying in the service's log; ``epd up`` shows a failed
service's own two lines, not its log's tail."""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
import time

import pytest
from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

from services.child import Service, ServiceExited, wait_ready
from services.cli import build_parser
from services.common.spawn import child_env
from services.startup_errors import StartupError, check_model, check_port, explain, summary_from_log

pytestmark = pytest.mark.unit

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _raised_inside(cause: BaseException) -> RuntimeError:
    """``cause`` as a service meets it: wrapped by whatever called vLLM."""
    try:
        try:
            raise cause
        except BaseException as e:
            raise RuntimeError("while building the engine's arguments") from e
    except RuntimeError as wrapped:
        return wrapped


def test_a_model_not_in_the_cache_while_offline_says_how_to_download_it():
    e = explain(_raised_inside(LocalEntryNotFoundError("Cannot find an appropriate cached snapshot folder")),
                "Qwen/Qwen2-VL-2B-Instruct", environ={})
    assert e is not None
    what, todo = str(e).split("\n")
    assert "Qwen/Qwen2-VL-2B-Instruct is not in this machine's Hugging Face cache" in what
    assert todo.strip().startswith("download it first (huggingface-cli download Qwen/Qwen2-VL-2B-Instruct)")
    assert "HF_HUB_OFFLINE=0" in todo


def test_a_model_that_could_not_be_downloaded_while_online_says_to_check_the_network():
    e = explain(_raised_inside(LocalEntryNotFoundError("no connection")), "org/model", {"HF_HUB_OFFLINE": "0"})
    assert "could not be downloaded" in e.what and "network" in e.todo


def test_a_model_path_that_does_not_exist_is_named_as_such_before_and_after_vllm_is_asked(tmp_path):
    missing = str(tmp_path / "no-such-model")
    e = explain(_raised_inside(HFValidationError("Repo id must be in the form 'repo_name'")), missing)
    assert e.what == f"model {missing}: no such directory, and not a Hugging Face model name (org/name)"
    with pytest.raises(StartupError, match="no such directory"):
        check_model(missing)
    check_model(str(tmp_path))  # a directory that exists: vLLM decides
    check_model("org/name")  # a Hub name: vLLM decides


def test_a_directory_without_a_model_is_named_as_such(tmp_path):
    e = explain(_raised_inside(ValueError("Invalid repository ID or local directory specified")), str(tmp_path))
    assert "holds no model" in e.what and "config.json" in e.todo


def test_a_port_in_use_is_named_with_its_flag_before_the_service_starts():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(StartupError) as e:
            check_port("--grpc-port", "127.0.0.1", port)
        assert str(e.value).startswith(f"--grpc-port {port}: 127.0.0.1:{port} is in use\n  ")
        assert "--grpc-port" in e.value.todo
    check_port("--port", "127.0.0.1", 0)  # any free port: never refused


def test_a_bind_that_fails_later_is_explained_too():
    in_use = explain(_raised_inside(OSError(errno.EADDRINUSE, "error while attempting to bind on address")))
    assert "is in use" in in_use.what and "ss -ltnp" in in_use.todo
    grpc_bind = explain(RuntimeError("Failed to bind to address 10.9.9.9:50051; set GRPC_VERBOSITY=debug"))
    assert "cannot listen" in grpc_bind.what and "10.9.9.9:50051" in grpc_bind.what


def test_anything_else_is_not_explained_and_keeps_its_traceback():
    assert explain(_raised_inside(KeyError("x")), "org/model") is None
    assert explain(ValueError("bad value"), "org/model") is None


def test_a_bad_flag_value_is_two_lines_not_a_usage_block(capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["encoder", "--port", "abc"])
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "epd encoder: error: argument --port: invalid int value: 'abc'",
        "  `epd encoder --help` lists the flags and their values"]


def test_the_reason_a_service_printed_is_found_at_the_end_of_its_log():
    log = "INFO starting\nTraceback (most recent call last):\n  File x\nOSError: boom\n" \
          "epd: error: what is wrong\n  what to do\n"
    assert summary_from_log(log) == "epd: error: what is wrong\n  what to do"
    assert summary_from_log("x\nepd lm: error: argument --port: invalid int value: 'a'\n") == \
        "epd lm: error: argument --port: invalid int value: 'a'"
    assert summary_from_log("INFO starting\nSegmentation fault\n") == ""


def test_epd_up_shows_a_service_that_did_not_start_by_its_own_two_lines(tmp_path):
    script = ("import sys; print('INFO loading'); print('Traceback (most recent call last): ...'); "
              "print('epd: error: model m is not here', file=sys.stderr); print('  download it', file=sys.stderr); "
              "sys.exit(2)")
    svc = Service("lm", [], str(tmp_path / "lm.log"), command=[sys.executable, "-c", script])
    svc.start(child_env())
    with pytest.raises(ServiceExited) as e:
        wait_ready({svc: lambda: False}, time.monotonic() + 300, poll_s=0.05)
    svc.finish(time.monotonic())
    assert str(e.value) == f"lm did not start: model m is not here\n  download it\n  (its log: {svc.log_path})"
    assert isinstance(e.value, RuntimeError)


def test_a_service_that_crashed_without_a_reason_shows_its_last_log_lines(tmp_path):
    svc = Service("encoder", [], str(tmp_path / "encoder.log"),
                  command=[sys.executable, "-c", "print('the last words'); raise SystemExit(1)"])
    svc.start(child_env())
    with pytest.raises(ServiceExited, match="exited during start-up; last log lines:\nthe last words"):
        wait_ready({svc: lambda: False}, time.monotonic() + 300, poll_s=0.05)
    svc.finish(time.monotonic())


@pytest.mark.parametrize("cmd", ["encoder", "lm"])
def test_epd_with_a_model_directory_that_does_not_exist_says_so_in_two_lines_and_exits_2(cmd, tmp_path):
    missing = str(tmp_path / "no-such-model")
    r = subprocess.run([sys.executable, "-m", "services.cli", cmd, "--model", missing, "--port", "0"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300, env=child_env())
    assert r.returncode == 2
    assert r.stderr.splitlines()[-2:] == [
        f"epd: error: model {missing}: no such directory, and not a Hugging Face model name (org/name)",
        "  pass a model directory that exists, or a model name such as Qwen/Qwen2-VL-2B-Instruct"]
    assert "Traceback" not in r.stderr  # refused before vLLM was asked: nothing to trace


@pytest.mark.slow  # imports vLLM and asks it (about 15 s)
def test_epd_lm_with_a_model_not_in_the_cache_logs_the_traceback_and_ends_with_two_lines(tmp_path):
    env = child_env({"HF_HOME": str(tmp_path / "hf")})
    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        env.pop(key, None)  # the services' default: offline
    r = subprocess.run([sys.executable, "-m", "services.cli", "lm", "--model", "epd-tests/not-cached", "--port", "0"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 2
    assert "LocalEntryNotFoundError" in r.stderr  # the traceback, in the log
    assert r.stderr.splitlines()[-2:] == [
        "epd: error: model epd-tests/not-cached is not in this machine's Hugging Face cache, and epd does not "
        "download (HF_HUB_OFFLINE=1 unless you set it)",
        "  download it first (huggingface-cli download epd-tests/not-cached), or export HF_HUB_OFFLINE=0 "
        "TRANSFORMERS_OFFLINE=0 to let the services download it"]
