"""`worldserve serve`'s start-up order, checked before the minutes-long model load: the device (one GPU per
rank of a parallel layout), flags worldserve refuses (an encrypted --ssl-keyfile, a --config key that is not
a flag), the socket (bound as vLLM binds its API socket; a busy port or bad host is one line, exit 2; a port
taken during the load too), the storage directory (unusable or in use by another server: one line) and the
cache folder the embedded tiny checkpoint is written to; the load itself is replaced by a recorder.
"""

from __future__ import annotations

import importlib.util
import logging
import shutil
import subprocess
import sys

import pytest
import torch

from worldserve.cli import build_parser
from worldserve.commands import serve, serve_backend, serve_http


def parse_args(*argv: str):
    """`worldserve serve ARGV` parsed as the console script parses it."""
    return build_parser(["serve", *argv]).parse_args(["serve", *argv])


@pytest.mark.parametrize(
    "where", ["a file", "under a file", "a database that is not one", "a folder as database"]
)
def test_an_unusable_storage_directory_is_one_line_before_the_model_loads(
    tmp_path, caplog, monkeypatch, where
):
    """Not a folder, or a jobs.sqlite3 that cannot be one: a one-line error naming the path, no
    traceback, no model load; exit 2, as the other config errors found before serving (a busy --port)."""
    (tmp_path / "afile").write_text("x")
    store = {"a file": tmp_path / "afile", "under a file": tmp_path / "afile" / "sub"}.get(
        where, tmp_path / "s"
    )
    if where == "a database that is not one":
        store.mkdir()
        (store / "jobs.sqlite3").write_bytes(b"not a database, not at all" * 40)
    elif where == "a folder as database":
        (store / "jobs.sqlite3").mkdir(parents=True)
    loads = []
    monkeypatch.setattr(serve_backend, "load_backend_within", lambda *a, **k: loads.append(a))
    with caplog.at_level(logging.ERROR, logger="worldserve.serve"):
        assert serve.run(parse_args("--storage-dir", str(store), "--port", "0")) == 2
    [record] = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert record.exc_info is None and str(tmp_path) in record.getMessage() and not loads


def test_a_busy_port_or_a_bad_host_fails_the_start_before_the_model_loads(tmp_path, caplog, monkeypatch):
    import socket

    loads = []
    monkeypatch.setattr(serve_backend, "load_backend_within", lambda *a, **k: loads.append(a))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for argv, needle in ((["--host", "127.0.0.1", "--port", str(port)], "--port"),
                             (["--host", "999.1.1.1", "--port", "0"], "--host")):  # fmt: skip
            caplog.clear()
            with caplog.at_level(logging.ERROR, logger="worldserve.serve"):
                assert serve.run(parse_args(*argv, "--storage-dir", str(tmp_path / "s"))) == 2
            assert needle in caplog.text, caplog.text
    assert not loads and not (tmp_path / "s").exists(), "nothing opened before the address was checked"


def test_the_socket_binds_as_vllm_binds_it():
    """An empty --host is every interface, a name is bound through IPv4 (localhost: 127.0.0.1, as vLLM), an
    IPv6 literal gets an IPv6 socket; nothing listens until the app is ready."""
    import socket

    with serve_http.bind_listener("", 0) as every, serve_http.bind_listener("localhost", 0) as local:
        assert every.family == local.family == socket.AF_INET
        assert every.getsockname()[0] == "0.0.0.0" and local.getsockname()[0] == "127.0.0.1"
        with socket.socket() as probe:
            assert probe.connect_ex(("127.0.0.1", local.getsockname()[1])) != 0, "refused until listening"
    try:
        six = serve_http.bind_listener("::1", 0)
    except ValueError:
        pytest.skip("no IPv6 loopback here")
    with six:
        assert six.family == socket.AF_INET6


def test_accepted_connections_have_nagle_off():
    """asyncio turns TCP_NODELAY on only for sockets whose proto is IPPROTO_TCP: on the listener's accepted
    connections it must be on, or every small keep-alive response (its body written after its headers) waits
    ~40 ms for the client's delayed ACK (/health, job polls, each SSE chunk)."""
    import asyncio
    import socket

    async def main() -> int:
        nodelay = asyncio.get_running_loop().create_future()

        def accepted(reader, writer):
            nodelay.set_result(
                writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
            )
            writer.close()

        with serve_http.bind_listener("127.0.0.1", 0) as sock:
            sock.listen()
            server = await asyncio.start_server(accepted, sock=sock)
            async with server:
                _, writer = await asyncio.open_connection("127.0.0.1", sock.getsockname()[1])
                value = await asyncio.wait_for(nodelay, 5)
                writer.close()
        return value

    assert asyncio.run(main()) != 0


def test_a_port_another_server_took_during_the_load_is_one_line(tmp_path, caplog, monkeypatch):
    """Two sockets with SO_REUSEADDR can both bind a port while neither listens: a second server started on
    the same --port passes the early bind, and the one that listens last gets a one-line error (exit 2),
    not uvicorn's traceback."""
    from worldserve.engine.fake_backend import FakeBackend

    other = serve_http.bind_listener("127.0.0.1", 0)  # another server, still loading its model
    port = other.getsockname()[1]

    def load(*_a, **_k):
        other.listen()  # ... which becomes ready while this one loads
        return FakeBackend(), None

    monkeypatch.setattr(serve_backend, "load_backend_within", load)
    with other, caplog.at_level(logging.ERROR, logger="worldserve.serve"):
        argv = ("--host", "127.0.0.1", "--port", str(port), "--storage-dir", str(tmp_path / "s"))
        assert serve.run(parse_args(*argv)) == 2
    [record] = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert (
        record.exc_info is None and f"cannot listen on --host 127.0.0.1 --port {port}" in record.getMessage()
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--device", "cuda:3"), "--device cuda:3 needs CUDA GPU 3; 0 visible"),
        (
            ("--cfg-parallel-size", "2"),
            "--cfg-parallel-size 2 needs 2 CUDA GPUs; 0 visible. --device cpu runs",
        ),
        # what the checkpoint's config bounds comes first, before the model loads (they had been exit 1 after
        # the load, and a head count the GPU count hid)
        (("--ulysses-degree", "3"), "--ulysses-degree 3 must divide num_attention_heads=4"),
        (("--device", "cpu", "-tp", "3"), "--tensor-parallel-size 3 must divide num_attention_heads=4"),
        (("--max-model-len", "10000000"), "is greater than the derived max_model_len 262144"),
        # (was exit 1 after binding the port, as a failed model load)
        (("--device", "cpu", "--kv-cache-memory-bytes", "10"), "--kv-cache-memory-bytes 10 holds 0 tokens"),
        (("--device", "cpu", "--enable-lora", "--lora-path", __file__), "--lora-path: "),
    ],
)
def test_gpus_this_machine_lacks_fail_before_anything_binds_or_loads(
    tmp_path, caplog, monkeypatch, flags, message
):
    """A device, or a parallel layout's one GPU per rank, that is not there: one line naming the flags, exit 2,
    before the checkpoint is resolved (a parallel layout was: exit 1 after binding and opening the store)."""
    loads = []
    monkeypatch.setattr(serve_backend, "load_backend_within", lambda *a, **k: loads.append(a))
    with caplog.at_level(logging.ERROR, logger="worldserve.serve"):
        assert serve.run(parse_args(*flags, "--storage-dir", str(tmp_path / "s"))) == 2
    assert message in caplog.text
    assert not loads and not (tmp_path / "s").exists()


def test_a_storage_directory_in_use_fails_the_start_before_the_model_loads(tmp_path, caplog, monkeypatch):
    from worldserve.engine.jobs import JobStore

    held = JobStore(tmp_path / "store")  # another server's store
    loads = []
    monkeypatch.setattr(serve_backend, "load_backend_within", lambda *a, **k: loads.append(a))
    with caplog.at_level(logging.ERROR, logger="worldserve.serve"):
        assert serve.run(parse_args("--storage-dir", str(tmp_path / "store"), "--port", "0")) == 2
    assert "in use by another worldserve server" in caplog.text and not loads
    held.close()


def test_a_refused_flag_fails_the_start_before_the_model_loads(tmp_path, caplog, monkeypatch):
    """`serve` exits 2 at once (no store opened, no load), logging the one-line reason."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    loads = []
    monkeypatch.setattr(serve_backend, "load_backend_within", lambda *a, **k: loads.append(a))
    with caplog.at_level(logging.ERROR, logger="worldserve.serve"):
        assert serve.run(parse_args("--cache-backend", "tea_cache")) == 2
    assert "--cache-backend tea_cache: worldserve has no lossy step caching" in caplog.text and not loads
    assert not (tmp_path / "worldserve").exists(), "the job store was not opened"


def test_a_broken_checkpoint_config_is_one_line_before_the_load(
    tiny_copy, tmp_path, monkeypatch, capsys, caplog
):
    """The pre-load checks read the checkpoint as the loader does: a missing or cut transformer/config.json
    is one logged line naming the file (so --log-file has it too), exit 1 (the first version of those
    checks ended in a traceback)."""
    from worldserve.cli import main

    loads = []
    monkeypatch.setattr(serve_backend, "load_backend_within", lambda *a, **k: loads.append(a))
    config = tiny_copy / "transformer" / "config.json"
    for broken, needle in ((lambda: config.write_text('{"num_attention_heads": '), "not valid JSON"),
                           (config.unlink, "transformer/config.json is missing")):  # fmt: skip
        broken()
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="worldserve.serve"):
            rc = main(["serve", str(tiny_copy), "--device", "cpu", "--storage-dir", str(tmp_path / "s")])
        err = capsys.readouterr().err
        assert rc == 1 and "Traceback" not in err, err
        assert "could not load the model" in caplog.text and needle in caplog.text, caplog.text
    assert not loads


def test_every_loader_names_a_broken_transformer_config(tiny_copy):
    """The library's loaders read transformer/config.json through read_transformer_config, as serve's pre-load
    check does: a cut file is a CheckpointError naming it (the parallel loader, the transformer loader and the
    adapter check had each parsed it themselves: a bare JSONDecodeError), before any peer starts."""
    from worldserve.params import LoraRequest
    from worldserve.runner.lora_cache import check_adapter_fits
    from worldserve.runner.parallel_layout import ParallelLayout
    from worldserve.runner.parallel_pipeline import ParallelPipeline
    from worldserve.weights.checkpoint import CheckpointError
    from worldserve.weights.loader import load_transformer

    config = tiny_copy / "transformer" / "config.json"
    config.write_text('{"num_attention_heads": ')
    loads = (
        lambda: load_transformer(tiny_copy, progress=False),
        lambda: ParallelPipeline.from_pretrained(tiny_copy, ParallelLayout(cfg=2), device="cpu"),
        lambda: check_adapter_fits(tiny_copy, LoraRequest(name="a", path=str(tiny_copy)), "--lora-path"),
    )
    for load in loads:
        with pytest.raises(CheckpointError, match="transformer/config.json"):
            load()


@pytest.mark.parametrize("verb", ["serve", "generate", "chat", "info"])
def test_an_unusable_cache_folder_is_one_line_naming_it(tmp_path, monkeypatch, capsys, caplog, verb):
    """No MODEL: the embedded tiny checkpoint is written under $XDG_CACHE_HOME/worldserve. XDG_CACHE_HOME a
    regular file ended every verb writing it in an OSError's traceback; now one line naming the folder, the
    reason and XDG_CACHE_HOME, exit 1 (serve: logged, as its other checkpoint errors, before the port binds)."""
    from worldserve.cli import main

    (tmp_path / "afile").write_text("x")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "afile"))
    loads = []
    monkeypatch.setattr(serve_backend, "load_backend_within", lambda *a, **k: loads.append(a))
    argv = {"serve": ["--device", "cpu", "--storage-dir", str(tmp_path / "s"), "--port", "0"],
            "generate": ["--prompt", "x", "-o", str(tmp_path / "o.mp4")], "chat": ["--message", "hi"],
            "info": []}[verb]  # fmt: skip
    with caplog.at_level(logging.ERROR, logger="worldserve.serve"):
        rc = main([verb, *argv])
    err = capsys.readouterr().err
    said = caplog.text if verb == "serve" else err
    assert rc == 1 and "Traceback" not in err and not loads, err
    assert (
        f"the cache folder {tmp_path / 'afile' / 'worldserve'} (XDG_CACHE_HOME={tmp_path / 'afile'})" in said
    )
    assert "cannot hold the embedded tiny checkpoint: Not a directory; set XDG_CACHE_HOME" in said, said
    assert len(said.strip().splitlines()) == 1 and not list(tmp_path.glob("**/*.tmp*"))


def _encrypted_key_pair(folder) -> tuple[str, str]:
    """A self-signed certificate and its passphrase-protected key (`secret`), made by the `openssl` binary
    (the passphrase given on its command line, stdin closed: it cannot prompt) or by `cryptography`."""
    if shutil.which("openssl"):
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-passout", "pass:secret", "-keyout",
                        "key.pem", "-out", "cert.pem", "-days", "1", "-subj", "/CN=localhost"], cwd=folder,
                       check=True, capture_output=True, stdin=subprocess.DEVNULL, timeout=60)  # fmt: skip
        return str(folder / "key.pem"), str(folder / "cert.pem")
    if importlib.util.find_spec("cryptography") is None:
        pytest.skip("neither the openssl binary nor the cryptography package is here to make a key")
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    name = x509.Name([x509.NameAttribute(x509.oid.NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(1).not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
            .sign(key, hashes.SHA256()))  # fmt: skip
    (folder / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                       serialization.BestAvailableEncryption(b"secret")))  # fmt: skip
    (folder / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(folder / "key.pem"), str(folder / "cert.pem")


def test_an_encrypted_ssl_key_is_refused_before_the_load_without_a_prompt(tmp_path):
    """A passphrase-protected --ssl-keyfile: OpenSSL prompted on the terminal for the passphrase in the
    pre-load check, and uvicorn again after the load (blocking where there is no terminal). Now one line naming
    the flag and how to decrypt the key, exit 2, no prompt. Run as the console script with no terminal to
    prompt on (a new session, stdin closed) and a timeout, so that a prompt fails the test, never hangs it."""
    key, cert = _encrypted_key_pair(tmp_path)
    argv = [
        "serve",
        "--ssl-keyfile",
        key,
        "--ssl-certfile",
        cert,
        "--port",
        "0",
        "--storage-dir",
        str(tmp_path / "s"),
    ]
    done = subprocess.run([sys.executable, "-m", "worldserve.cli", *argv], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, start_new_session=True, timeout=120)  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    [line] = done.stderr.strip().splitlines()
    assert f"--ssl-keyfile {key}: the private key is encrypted" in line, line
    assert f"openssl pkey -in {key} -out {key}.plain" in line and "PEM" not in line, line
    assert not (tmp_path / "s").exists(), "refused before the store opened (and the model loaded)"


@pytest.mark.parametrize("key", ["help", "version", "h", "max-model"])
def test_a_config_file_key_that_is_no_flag_is_refused(tmp_path, caplog, monkeypatch, key):
    """`help: true` in a --config file printed serve's help and exited 0 (argparse took it as --help); an
    abbreviation (`max-model`) was taken as the flag it abbreviates. A key must be a flag's exact name: anything
    else is one line naming the key and the file, exit 2 (as the file's other errors), before the load."""
    (tmp_path / "c.yaml").write_text(f"{key}: true\n")
    loads = []
    monkeypatch.setattr(serve_backend, "load_backend_within", lambda *a, **k: loads.append(a))
    with caplog.at_level(logging.ERROR, logger="worldserve.serve"):
        rc = serve.run(parse_args("--config", str(tmp_path / "c.yaml"), "--storage-dir", str(tmp_path / "s")))
    assert rc == 2 and not loads
    assert f"--config {tmp_path / 'c.yaml'}: {key!r} is not a `worldserve serve` option" in caplog.text
